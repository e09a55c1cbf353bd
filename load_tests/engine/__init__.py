"""`kvrelay bench engine` (bench.py) and what its --structured, --speculative and --lora run
(structured.py, speculative.py, lora.py); beside them, measurements run by hand: the suffix
proposer (spec_suffix.py), batch-invariant mode (deterministic.py), the grammar backends
(grammar_backends.py)."""

__all__: list[str] = []
