"""`kvrelay bench serve` (bench.py): the client any OpenAI-compatible server is measured by.
params.py (its arguments, argparse only) -> datasets.py -> load.py (the schedule) -> client.py
(one timed request) -> metrics.py (the figures) -> report.py (the PNG)."""

__all__: list[str] = []
