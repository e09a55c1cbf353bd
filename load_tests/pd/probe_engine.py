"""The engine both CPU probes time (probe.py's steps, corun.py's co-run): one served replica's
scheduler limits, so that the fit's steps are the steps a pd-interference replica takes. Apart
from probe.py so that the co-run probe, which probe.py calls, needs nothing of it."""

from __future__ import annotations

from pathlib import Path

__all__ = ["PROBE_ENGINE", "probe_engine"]

PROBE_ENGINE = {"max_num_batched_tokens": 512, "long_prefill_token_threshold": 256, "max_num_seqs": 128}


def probe_engine(model_dir: Path, dtype: str):
    """The probes' engine: one served replica's (PROBE_ENGINE), one torch thread, prefix caching
    off (every prompt computed), 256 MiB of KV."""
    from serving.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, kv_cache_bytes=256 * 2**20, enable_prefix_caching=False,
                                  num_threads=1, **PROBE_ENGINE))
