"""`kvrelay bench pd-sim` (bench.py): where prefill/decode disaggregation pays, simulated.

    params.py      its arguments (argparse only)
    sim.py         the discrete-event simulator (routing.py: kvrelay's routers inside it)
    costs.py       what a step costs: the GPU fit and this machine's, fitted by probe.py from the
                   engine (probe_engine.py), the served path (served_probe.py) and a co-run (corun.py)
    workload.py    the request mixes; sweep.py the grid; validate.py the check against a scenario
    report.py      tables and the PNG"""

__all__: list[str] = []
