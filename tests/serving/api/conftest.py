"""What the API tests share: one tiny engine per test module (float32, 4 MiB of KV, no prefix
caching, one thread), so each module's requests see the same fresh engine."""

from __future__ import annotations

import pytest

from tests.helpers import tiny_async_engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = tiny_async_engine(tiny_model_dir)
    yield engine
    engine.shutdown()
