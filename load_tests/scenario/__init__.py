"""`kvrelay bench scenario NAME` (bench.py): the servers a question needs (servers.py), loaded by
the `kvrelay bench serve` client at rates set from this machine (calibration.py), with the CPU
other processes took (foreign_cpu.py) and a PNG (report.py)."""

__all__: list[str] = []
