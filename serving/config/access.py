"""Who may call the API and how much: API keys (stored hashed) and the tiers they belong to.

    api_keys:                          # each entry one of
      - sk-plain-key                   #   a plain key: hashed when the config is loaded
      - {key: sk-..., name: team-a, tier: gold}
      - {name: team-b, key_sha256: "sha256:<salt>:<digest>", hint: "sk-...abcd", tier: free}
    tiers:
      gold: {requests_per_minute: 600, tokens_per_minute: 200000, max_concurrent_requests: 32,
             highest_priority: -10, models: null}
      default: {}                      # keys that name no tier; no limits unless set here

A plain key never reaches a deployment: the validator replaces it with its salted SHA-256
(`hash_key`), and that is what Serve's dashboard shows. `kvrelay hash-key` prints the stored
form of a key, so configs can carry only digests. Priorities follow vLLM's convention: lower is
more important.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from typing import Any, Literal

from pydantic import Field, model_validator

from serving.engine.strict import StrictModel

__all__ = ["APIKey", "TierConfig", "DEFAULT_TIER", "KEY_HASH_PREFIX", "hash_key", "key_hint", "parse_key_entries"]

DEFAULT_TIER = "default"
KEY_HASH_PREFIX = "sha256:"
_SALT_BYTES = 16
_KEY_HASH = re.compile(r"^sha256:[0-9a-f]{2,128}:[0-9a-f]{64}$")


class TierConfig(StrictModel):
    requests_per_minute: int | None = Field(
        None, ge=1, description="Requests a key may start per minute (a bucket of this size that refills "
        "evenly over the minute). null: no limit.",
    )
    tokens_per_minute: int | None = Field(
        None, ge=1, description="Prompt plus max_tokens a key may ask for per minute (unused max_tokens "
        "are given back when a request ends). null: no limit.",
    )
    max_concurrent_requests: int | None = Field(
        None, ge=1, description="Requests of a key in flight at once, across ingress replicas. null: no limit.",
    )
    priority: int = Field(
        0, ge=-(2**31), le=2**31 - 1,
        description="The priority of a request that sets none (lower is more important, as vLLM's).",
    )
    highest_priority: int = Field(
        0, ge=-(2**31), le=2**31 - 1,
        description="The most important priority a request may ask for; a lower value is clamped to it "
        "(the response's x-kvrelay-priority header says so) or refused, per priority_over_limit.",
    )
    priority_over_limit: Literal["clamp", "refuse"] = Field(
        "clamp", description="What a request asking for more than highest_priority gets: clamped, or a 400.",
    )
    non_stream_priority_offset: int = Field(
        0, ge=0, le=1000,
        description="Levels added to the priority of a request that does not stream: batch work waits "
        "behind the interactive streams of its tier. 0: no difference.",
    )
    priority_cost_step_tokens: int | None = Field(
        None, ge=1,
        description="Every this many tokens of a request's estimated work (its prompts plus n x max_tokens, "
        "what tokens_per_minute counts) make it one level less important, up to max_cost_priority_levels: "
        "a short request passes a long one of its tier. null: cost does not change priority.",
    )
    max_cost_priority_levels: int = Field(
        2, ge=0, le=1000, description="The most levels a request's estimated cost can add (priority_cost_step_tokens).",
    )
    models: list[str] | None = Field(
        None, description="Model names (and adapters, which are served as models) this tier may use. null: all.",
    )
    max_timeout_s: float | None = Field(
        None, gt=0, description="The longest `timeout` a request may ask for, and the cap on the server's "
        "default for this tier. null: the server's request_timeout_s bounds it.",
    )

    @model_validator(mode="after")
    def _check(self) -> TierConfig:
        if self.priority < self.highest_priority:
            raise ValueError(
                f"priority = {self.priority} is more important than highest_priority = {self.highest_priority}; "
                "the default must be allowed (raise priority or lower highest_priority)"
            )
        return self


class APIKey(StrictModel):
    name: str = Field(min_length=1, max_length=128, description="How usage, logs and metrics name the key.")
    key_sha256: str = Field(description="`sha256:<salt hex>:<SHA-256(salt || key) hex>` (kvrelay hash-key).")
    hint: str = Field("...", max_length=32, description="What /v1/usage shows of the key, e.g. `sk-...abcd`.")
    tier: str = Field(DEFAULT_TIER, min_length=1, description="The key's tier (`tiers`).")
    is_admin: bool = Field(False, description="Also sees every key's totals at GET /v1/usage.")

    @model_validator(mode="after")
    def _check(self) -> APIKey:
        if not _KEY_HASH.match(self.key_sha256):
            raise ValueError(
                f"key_sha256 of {self.name!r} is not `sha256:<salt hex>:<64 hex digits>`; "
                "make one with `kvrelay hash-key`, or give the plain key as `key:`"
            )
        return self


def key_hint(key: str) -> str:
    """OpenAI-style `sk-...abcd`, less of it for short keys."""
    if len(key) >= 16:
        return f"{key[:3]}...{key[-4:]}"
    return f"...{key[-2:]}" if len(key) >= 8 else "..."


def hash_key(key: str, *, name: str | None = None, tier: str = DEFAULT_TIER, is_admin: bool = False,
             salt: bytes | None = None) -> APIKey:
    """The stored form of a plain key; `name` defaults to `key-` and 8 hex digits of its digest."""
    if not key:
        raise ValueError("an API key must not be empty")
    salt = secrets.token_bytes(_SALT_BYTES) if salt is None else salt
    digest = hashlib.sha256(salt + key.encode()).hexdigest()
    return APIKey(
        name=name or f"key-{digest[:8]}", key_sha256=f"{KEY_HASH_PREFIX}{salt.hex()}:{digest}",
        hint=key_hint(key), tier=tier, is_admin=is_admin,
    )


def parse_key_entries(entries: Any, *, field: str, is_admin: bool) -> Any:
    """`api_keys` / `admin_api_keys` as written -> stored entries (dicts of APIKey's fields):
    plain keys hashed, everything else left for validation to judge."""
    if not isinstance(entries, list):
        return entries
    parsed: list[Any] = []
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            if not entry:
                raise ValueError(f"{field}[{i}] is empty; remove it or give a key")
            parsed.append(hash_key(entry, is_admin=is_admin).model_dump())
        elif isinstance(entry, dict) and "key" in entry:
            rest = {k: v for k, v in entry.items() if k != "key"}
            unknown = sorted(set(rest) - {"name", "tier"})
            if unknown:
                raise ValueError(f"{field}[{i}]: unknown {', '.join(unknown)} beside `key` (allowed: name, tier)")
            if not isinstance(entry["key"], str) or not entry["key"]:
                raise ValueError(f"{field}[{i}].key must be a non-empty string")
            parsed.append(hash_key(entry["key"], is_admin=is_admin, **rest).model_dump())
        elif isinstance(entry, dict):
            parsed.append({**entry, "is_admin": is_admin} if is_admin else entry)
        else:
            parsed.append(entry)
    return parsed
