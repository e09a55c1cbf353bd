"""`kvrelay bench hostile` (bench.py): a normal stream's TTFT beside clients sending the hostile
requests of cases.py (the same list the hostile-input test sends)."""

__all__: list[str] = []
