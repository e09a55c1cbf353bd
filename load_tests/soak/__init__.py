"""`kvrelay bench soak` (bench.py): mixed load with client aborts (workload.py, client.py), watched
(monitor.py), with kills under --chaos (chaos.py), the app read through app_probe.py, and the
verdict (report.py); params.py holds its arguments (argparse only)."""

__all__: list[str] = []
