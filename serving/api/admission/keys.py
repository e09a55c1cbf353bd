"""Checking a presented API key against the stored digests (serving/config/access.py), in
constant time.

    Authorization: Bearer <key> ──KeyRing.check──▶ APIKey (name, hint, tier), or None → 401

Every stored digest is computed and compared with `hmac.compare_digest`, matched or not, so the
time a refusal takes says nothing about how much of a key matched, nor which entry it was near.
A key that passed is remembered by its own SHA-256 (in this process only; a bounded LRU), so a
client's later requests cost one hash, not one per configured key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict
from collections.abc import Iterable

from serving.config.access import DEFAULT_TIER, KEY_HASH_PREFIX, APIKey

__all__ = ["KeyRing", "ANONYMOUS"]

# Every request's identity when no keys are configured.
ANONYMOUS = APIKey(name="anonymous", key_sha256=f"{KEY_HASH_PREFIX}00:{'0' * 64}", hint="anonymous", tier=DEFAULT_TIER)

_REMEMBERED = 4096


class KeyRing:
    def __init__(self, keys: Iterable[APIKey]):
        self._entries: list[tuple[bytes, bytes, APIKey]] = []
        for entry in keys:
            salt_hex, _, digest_hex = entry.key_sha256.removeprefix(KEY_HASH_PREFIX).partition(":")
            self._entries.append((bytes.fromhex(salt_hex), bytes.fromhex(digest_hex), entry))
        self._remembered: OrderedDict[bytes, APIKey] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._entries)

    def check(self, presented: str) -> APIKey | None:
        raw = presented.encode()
        fingerprint = hashlib.sha256(raw).digest()
        found = self._remembered.get(fingerprint)
        if found is not None:
            self._remembered.move_to_end(fingerprint)
            return found
        for salt, digest, entry in self._entries:  # all of them: no early exit on a match
            if hmac.compare_digest(hashlib.sha256(salt + raw).digest(), digest):
                found = entry
        if found is not None:
            self._remembered[fingerprint] = found
            if len(self._remembered) > _REMEMBERED:
                self._remembered.popitem(last=False)
        return found
