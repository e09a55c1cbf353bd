"""The routing policies' parameters, typed: one pydantic model per policy, told apart by the
policy's name (`policy`, the discriminator), so the serve config's `routing.prefill_params` and
`routing.decode_params` are validated like the rest of the config and documented field by field
(the Helm values schema and the config reference are generated from these models).

    routing:
      prefill_policy: prefix_cost            ─▶ prefill_params: PrefixCostParams
      prefill_params: {max_load_ratio: 1.25}    (the name is the discriminator; the YAML does not repeat it)

Types are strict: YAML's `admission: "off"` is a string, which Python would take as true, and
`load_window_per_replica: 3.5` is not an int. Each policy's constructor takes the same keywords
and checks them here (`parse_params`), so a policy built in code and one built from the config
accept the same values with the same messages. router/policies.py and router/prefix_cost.py say
what each parameter does.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_serializer

from serving.engine.strict import StrictModel

__all__ = [
    "PolicyParams", "PrefixCostParams", "LeastKVParams", "RoundRobinParams", "PowerOfTwoParams",
    "CharPrefixTreeParams", "PrefillParams", "DecodeParams", "PARAMS", "parse_params",
]


class PolicyParams(StrictModel):
    """The base of every policy's parameters: unknown keys and values of another type are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @model_serializer(mode="wrap")
    def _as_written(self, handler) -> dict[str, Any]:
        """The keys given, as written: a dumped config says what its YAML said, and the policy's
        defaults stay the policy's."""
        return {key: value for key, value in handler(self).items() if key in self.model_fields_set}


def _policy(name: str):
    return Field(name, exclude=True, description="The policy these parameters are for (its routing.*_policy).")


class PrefixCostParams(PolicyParams):
    policy: Literal["prefix_cost"] = _policy("prefix_cost")
    default_prefill_tokens_per_s: float = Field(
        2000.0, gt=0, description="The pool's prefill rate while no replica has measured its own.",
    )
    tie_tolerance: float = Field(
        0.25, ge=0, lt=1,
        description="Replicas within this fraction of the cheapest cost that hold as much of the prompt are ties.",
    )
    max_imbalance_tokens: int = Field(
        16384, ge=0,
        description="The least-loaded replica is taken when the chosen one's queued tokens lead it by more.",
    )
    max_imbalance_ratio: float | None = Field(
        None, ge=1,
        description="...or exceed this many times the pool's mean (leading by min_imbalance_tokens); null: off.",
    )
    min_imbalance_tokens: int = Field(512, ge=0, description="The lead the relative imbalance guard needs.")
    max_load_ratio: float | None = Field(
        1.25, ge=1,
        description="Only replicas whose recent load stays within this many times the pool's mean are "
        "eligible (bounded load); null: no bound.",
    )
    load_window_per_replica: int = Field(
        64, ge=1, description="Requests per replica over which the load bound's counters decay.",
    )
    session_affinity: bool = Field(
        False, description="Requests with the same `user` prefer the replica rendezvous hashing gives it.",
    )
    affinity_slack_s: float = Field(
        0.05, description="How much dearer (seconds) the session's replica may be and still be taken.",
    )
    price_evictions: bool = Field(True, description="Cost includes the recompute time of what a placement evicts.")
    price_delay: bool = Field(True, description="Cost includes the delay a placement causes later requests.")
    reuse_window_requests: int = Field(
        2048, ge=1, description="Requests over which a block's chance of being wanted again is estimated.",
    )
    admission: bool = Field(
        True, description="A cold prompt's blocks are kept cached only when worth more than what they evict.",
    )
    rate_spread: float | None = Field(
        2.0, ge=1,
        description="A replica's own measured rate counts only when this many times off the pool's median; "
        "null: every replica's own rate.",
    )


class LeastKVParams(PolicyParams):
    policy: Literal["least_kv"] = _policy("least_kv")


class RoundRobinParams(PolicyParams):
    policy: Literal["round_robin"] = _policy("round_robin")


class PowerOfTwoParams(PolicyParams):
    policy: Literal["pow2"] = _policy("pow2")
    seed: int | None = Field(None, description="Seed of the random pair; null: a fresh one.")


class CharPrefixTreeParams(PolicyParams):
    policy: Literal["char_prefix_tree"] = _policy("char_prefix_tree")
    match_rate_threshold: float = Field(
        0.1, ge=0, le=1,
        description="The longest match's owners are taken when it covers at least this fraction of the text.",
    )
    imbalanced_threshold: float | None = Field(
        None, ge=0,
        description="Power of two choices when the replicas' queue lengths differ by more; null: never.",
    )
    seed: int | None = Field(None, description="Seed of the random choices; null: a fresh one.")


PrefillParams = Annotated[
    PrefixCostParams | PowerOfTwoParams | RoundRobinParams | CharPrefixTreeParams, Field(discriminator="policy"),
]
DecodeParams = Annotated[LeastKVParams | PowerOfTwoParams | RoundRobinParams, Field(discriminator="policy")]

PARAMS: dict[str, type[PolicyParams]] = {
    typing.get_args(cls.model_fields["policy"].annotation)[0]: cls
    for cls in (PrefixCostParams, LeastKVParams, RoundRobinParams, PowerOfTwoParams, CharPrefixTreeParams)
}

_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"), "less_than_equal": ("le", "<="),
           "less_than": ("lt", "<")}


def parse_params(policy: str, params: dict[str, Any]) -> PolicyParams:
    """`params` checked against `policy`'s model; ValueError names the policy, the key, the value
    and what it must be."""
    try:
        model = PARAMS[policy]
    except KeyError:
        raise ValueError(f"unknown routing policy {policy!r}; choose one of {sorted(PARAMS)}") from None
    try:
        return model.model_validate({**params, "policy": policy})
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ValueError(f"routing policy {policy!r}: {_problem(model, err)}") from None


def _problem(model: type[PolicyParams], err: dict) -> str:
    key, value = str(err["loc"][0]), err.get("input")
    if err["type"] == "extra_forbidden":
        allowed = [name for name in model.model_fields if name != "policy"]
        return f"unknown parameter {key!r} (allowed: {', '.join(allowed) or 'none'})"
    annotation = model.model_fields[key].annotation
    union = isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
    kinds = typing.get_args(annotation) if union else (annotation,)
    nullable = " or null" if type(None) in kinds else ""
    if err["type"] in _BOUNDS:
        attr, op = _BOUNDS[err["type"]]
        limit = err["ctx"][attr]
        limit = int(limit) if float(limit).is_integer() else limit
        return f"{key} must be {op} {limit}{nullable}, got {value!r}"
    wanted = " or ".join(t.__name__ for t in kinds if t is not type(None)) + nullable
    return f"{key} must be {wanted}, got {value!r} ({type(value).__name__})"
