"""What the API tests share: one tiny engine per test module (float32, 4 MiB of KV, no prefix
caching, one thread), so each module's requests see the same fresh engine."""

from __future__ import annotations

import pytest

from serving.engine import EngineConfig
from serving.engine.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = AsyncEngine(EngineConfig(
        model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=4 * 2**20, enable_prefix_caching=False, num_threads=1,
    ))
    yield engine
    engine.shutdown()
