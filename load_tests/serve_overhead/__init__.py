"""`kvrelay bench serve-overhead` (bench.py): the Serve path against the engine in-process, and the
KV hand-off against a memcpy (kv_transfer_timing.py)."""

__all__: list[str] = []
