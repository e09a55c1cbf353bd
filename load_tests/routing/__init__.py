"""`kvrelay bench routing` (bench.py): the prefill pool's routing policies on a real pool (real.py)
or simulated replicas (sim.py, costed by calibration.py), over one workload (workload.py) or a
grid of them (sweep.py, with the references of bounds.py); metrics.py is what each run reports."""

__all__: list[str] = []
