"""vLLM's KV events as kvrelay's: the exact prefix router on a vLLM pool.

vLLM publishes BlockStored / BlockRemoved over ZMQ (an ipc socket per engine). KVEventRelay
re-derives each stored block's hash from its tokens with kvrelay's hash (block_hash.py: the
parent's, the tokens, the cache salt and adapter), keeps vLLM's hash -> ours, and hands the
subscribers kvrelay's events: the router's index and the ingress's prompt hashes stay in one hash
space, whichever engine a pool runs. A hash vLLM holds in several blocks (two requests missing the
cache at once) goes only with its last block.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["KVEventRelay", "cache_salt"]

logger = logging.getLogger(__name__)


class KVEventRelay:
    """vLLM's KV events as kvrelay's (module docstring), read on a thread of their own."""

    def __init__(self, endpoint: str, block_size: int, lora_paths: dict[str, str], deliver: Callable[[list], None]):
        self.endpoint, self.block_size, self._lora_paths, self._deliver = endpoint, block_size, lora_paths, deliver
        # vLLM's block hash -> [ours, the extra keys it hashed with, how many of vLLM's blocks hold it]
        # (two requests missing the cache at once each store a block of the same hash)
        self._ours: dict[int, list] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        socket = zmq.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(self.endpoint)
        last_seq = None
        try:
            while not self._stop.is_set():
                if not socket.poll(100):
                    continue
                _topic, seq, payload = socket.recv_multipart()
                seq = int.from_bytes(seq, "big")
                if last_seq is not None and seq != last_seq + 1:
                    logger.warning("vLLM's KV events %d..%d were lost: the router's index of this replica "
                                   "misses what they said", last_seq + 1, seq - 1)
                last_seq = seq
                try:
                    events = self.translate(decoder.decode(payload).events)
                    if events:
                        self._deliver(events)
                except Exception:  # noqa: BLE001 - one bad batch, not the relay
                    logger.exception("relaying a batch of vLLM's KV events failed; relaying goes on")
        finally:
            socket.close(linger=0)

    def translate(self, events) -> list:
        from serving.engine.kv.block_hash import ROOT_HASH, block_extra_keys, hash_blocks
        from serving.engine.kv.events import BlockRemoved, BlockStored

        out = []
        for event in events:
            kind = type(event).__name__
            if getattr(event, "group_idx", None) not in (None, 0):  # another KV cache group's copy
                continue
            if kind == "BlockStored":
                if event.parent_block_hash is None:
                    parent, first = ROOT_HASH, event.extra_keys[0] if event.extra_keys else None
                    lora = event.lora_name
                    salt = cache_salt(first, lora)
                    extra = block_extra_keys(salt, lora, self._lora_paths.get(lora) if lora else None)
                elif event.parent_block_hash in self._ours:
                    parent, extra, _ = self._ours[event.parent_block_hash]
                else:  # its parent was never seen (stored before we listened): cannot be chained
                    continue
                tokens = list(event.token_ids)
                ours = hash_blocks(tokens, self.block_size, extra, parent_hash=parent)
                for theirs, mine in zip(event.block_hashes, ours):
                    entry = self._ours.setdefault(theirs, [mine, extra, 0])
                    entry[2] += 1
                out.append(BlockStored(tuple(ours), parent, tuple(tokens[: len(ours) * self.block_size]), self.block_size))
            elif kind == "BlockRemoved":
                gone = []
                for theirs in event.block_hashes:
                    entry = self._ours.get(theirs)
                    if entry is not None:
                        entry[2] -= 1
                        if entry[2] <= 0:  # vLLM's last block of that hash
                            gone.append(self._ours.pop(theirs)[0])
                if gone:
                    out.append(BlockRemoved(tuple(gone)))
            elif kind == "AllBlocksCleared" and self._ours:
                out.append(BlockRemoved(tuple(entry[0] for entry in self._ours.values())))
                self._ours.clear()
        return out


def cache_salt(extra_keys, lora_name: str | None) -> str | None:
    """The cache salt among the extra keys vLLM reports for a sequence's first block. vLLM 0.32's
    events hold them untagged, the adapter's name first (when the request has one), the salt
    last; a tagged ("cache_salt", salt) pair is read too."""
    plain = []
    for key in extra_keys or ():
        if isinstance(key, (tuple, list)) and len(key) == 2 and key[0] == "cache_salt":
            return key[1]
        if isinstance(key, str):
            plain.append(key)
    if lora_name is not None and plain and plain[0] == lora_name:
        plain = plain[1:]
    return plain[-1] if plain else None
