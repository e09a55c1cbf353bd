"""Usage and cost: prices per model, what each request costs, and totals per API key.

    pricing YAML ──load_pricing──▶ PricingConfig ──price_for(served model)──▶ ModelPrice
                                                                              │
    request ends ──Usage──▶ RequestAccount.settle ──cost──▶ usage.cost, x-kvrelay-cost header
                                      └──────────▶ UsageLedger[api key] ──▶ GET /v1/usage

The pricing file (`pricing:` in the ServeConfig; deploy/pricing.yaml is a sample):

    models:                       # keyed by the name clients pass as `model`
      smollm2-135m-instruct:
        input_per_million: 0.05   # price of one million prompt tokens
        output_per_million: 0.20  # price of one million completion tokens
        currency: USD             # ISO 4217, default USD

cost = prompt_tokens × input_per_million / 10⁶ + completion_tokens × output_per_million / 10⁶,
computed in Decimal from the prices as written, so it is exact; cached prompt tokens cost the same
as the others. The header carries the exact decimal; JSON bodies carry the nearest float.

Totals live in the ingress replica that served the requests (in memory, since its start): with
`ingress.num_replicas > 1` each replica counts its own share and `GET /v1/usage` answers from the
replica the proxy picked. A request counts once its tokens are final: when its response is built,
or when its stream ends, a client that left included (what was generated until then). A
non-streamed request that ends early (the client left, or it failed mid-generation) counts the
same way once it has generated a token; requests refused before generation (4xx, 429, 503) do
not count.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

from pydantic import Field

from serving.api.generation.pipeline import Usage
from serving.config import ConfigError, read_yaml_mapping, validate_model
from serving.engine.strict import StrictModel

__all__ = [
    "ModelPrice",
    "PricingConfig",
    "load_pricing",
    "request_cost",
    "format_cost",
    "KeyTotals",
    "UsageLedger",
    "RequestAccount",
    "COST_HEADER",
    "CURRENCY_HEADER",
]

COST_HEADER = "x-kvrelay-cost"
CURRENCY_HEADER = "x-kvrelay-cost-currency"
_MILLION = Decimal(10**6)


class ModelPrice(StrictModel):
    input_per_million: Decimal = Field(ge=0, allow_inf_nan=False, description="Price of one million prompt (input) tokens.")
    output_per_million: Decimal = Field(ge=0, allow_inf_nan=False, description="Price of one million completion (output) tokens.")
    currency: str = Field("USD", pattern=r"^[A-Z]{3}$", description="ISO 4217 code of both prices.")


class PricingConfig(StrictModel):
    models: dict[str, ModelPrice] = Field(
        min_length=1, description="Per served model name (what clients pass as `model`), its prices."
    )

    def price_for(self, model_name: str, source: str = "pricing") -> ModelPrice:
        price = self.models.get(model_name)
        if price is None:
            raise ConfigError(
                f"{source}: no price for the served model {model_name!r} (the file prices "
                f"{', '.join(sorted(self.models))}); add it under `models:`"
            )
        return price


def load_pricing(path: str | os.PathLike) -> PricingConfig:
    """The pricing YAML; errors name the file, the field, the value and the fix."""
    data = read_yaml_mapping(path, what="pricing file", shape="with `models:`")
    return validate_model(PricingConfig, data, str(path))


def request_cost(price: ModelPrice, prompt_tokens: int, completion_tokens: int) -> Decimal:
    return (prompt_tokens * price.input_per_million + completion_tokens * price.output_per_million) / _MILLION


def format_cost(cost: Decimal) -> str:
    """Plain decimal notation without trailing zeros: 0.0000006, 12.5, 0."""
    text = format(cost, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text or "0"


@dataclass
class KeyTotals:
    num_requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cost: Decimal = Decimal(0)

    def to_dict(self, currency: str | None) -> dict:
        """OpenAI's usage API names (num_model_requests, input_tokens, ...), plus the cost."""
        return {
            "num_model_requests": self.num_requests,
            "input_tokens": self.prompt_tokens,
            "output_tokens": self.completion_tokens,
            "input_cached_tokens": self.cached_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "cost": float(self.cost) if currency is not None else None,
            "currency": currency,
        }


class UsageLedger:
    """Totals per API key in this process (single event loop: no lock needed)."""

    def __init__(self):
        self._totals: dict[str, KeyTotals] = {}

    def record(self, key: str, usage: Usage, cost: Decimal | None) -> None:
        totals = self._totals.setdefault(key, KeyTotals())
        totals.num_requests += 1
        totals.prompt_tokens += usage.prompt_tokens
        totals.completion_tokens += usage.completion_tokens
        totals.cached_tokens += usage.cached_tokens
        if cost is not None:
            totals.cost += cost

    def totals(self, key: str) -> KeyTotals:
        return self._totals.get(key, KeyTotals())

    def keys(self) -> list[str]:
        return sorted(self._totals)

    def sum(self, keys: list[str]) -> KeyTotals:
        total = KeyTotals()
        for key in keys:
            t = self.totals(key)
            total.num_requests += t.num_requests
            total.prompt_tokens += t.prompt_tokens
            total.completion_tokens += t.completion_tokens
            total.cached_tokens += t.cached_tokens
            total.cost += t.cost
        return total


class RequestAccount:
    """One request's bill: who pays, at what price, and its tokens once they are final.

    The handler points it at the request's usage (`track`) once generation starts; `settle`
    records it in the ledger exactly once (the usage chunk of a stream, the response body, or
    the end of a stream nobody asked usage of) and returns the `usage` object to send."""

    def __init__(self, ledger: UsageLedger, api_key: str, price: ModelPrice | None):
        self.api_key = api_key
        self._ledger = ledger
        self._price = price
        self._usage_fn: Callable[[], Usage] | None = None
        self._settled: tuple[Usage, Decimal | None] | None = None

    def track(self, usage_fn: Callable[[], Usage]) -> None:
        self._usage_fn = usage_fn

    def hand_over(self) -> None:
        """Another app serves this request and bills it there (graceful degradation,
        serving/api/admission/degradation.py): this account settles nothing."""
        assert self._settled is None, "a settled request cannot be handed over"
        self._usage_fn = None

    def settle_if_generated(self) -> dict | None:
        """Settle a request that ended early (its client left, or it failed) if it generated at
        least one token: like a stream, it pays for what it got. One refused before its first
        token is not billed."""
        if self._settled is None and (self._usage_fn is None or self._usage_fn().completion_tokens == 0):
            return None
        return self.settle()

    def settle(self) -> dict | None:
        """The response's `usage` (with `cost` and `currency` when priced); None before `track`."""
        if self._settled is None:
            if self._usage_fn is None:
                return None
            usage = self._usage_fn()
            cost = request_cost(self._price, usage.prompt_tokens, usage.completion_tokens) if self._price else None
            self._ledger.record(self.api_key, usage, cost)
            self._settled = (usage, cost)
        usage, cost = self._settled
        body = usage.to_dict()
        if cost is not None:
            body["cost"] = float(cost)
            body["currency"] = self._price.currency
        return body

    def headers(self) -> dict[str, str]:
        """The cost headers of a settled, priced request (not of a stream: its headers leave first)."""
        if self._settled is None or self._settled[1] is None:
            return {}
        return {COST_HEADER: format_cost(self._settled[1]), CURRENCY_HEADER: self._price.currency}

    @property
    def usage(self) -> Usage | None:
        return self._settled[0] if self._settled is not None else None
