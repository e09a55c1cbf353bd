"""kvrelay's benchmarks, peers and simulators: one subpackage per `kvrelay bench` target (engine/,
serve/, serve_overhead/, routing/, scenario/, pd/, soak/, hostile/), the peers they are measured
against (peers/), and the scaffolding they share (common.py, hardware.py, local_ray.py,
roofline.py). registry.py lists the targets. Not part of the installed product: the wheel leaves
this package out, and `kvrelay bench` runs it from a checkout (the `[bench]` extra)."""

__all__: list[str] = []
