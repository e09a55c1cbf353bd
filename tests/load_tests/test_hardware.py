"""load_tests/hardware.py: the CPU model and ISA flags from a made-up /proc/cpuinfo, and the one
machine record every benchmark writes."""

from __future__ import annotations

import sys

from load_tests import hardware

CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 amx_tile amx_bf16 avx512_vnni
bugs\t\t: spectre_v1

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 amx_tile amx_bf16 avx512_vnni avx512_fp16 amx_int8
"""


def test_model_and_isa_flags_of_the_first_cpu():
    assert hardware.cpu_model(CPUINFO) == "Intel(R) Xeon(R) Platinum 8488C"
    flags = hardware.cpu_flags(CPUINFO)
    assert "avx512_vnni" in flags and "amx_int8" not in flags  # the first `flags` line only
    assert hardware.isa_features(flags) == {
        "avx2": True, "avx512f": True, "avx512_bf16": True, "avx512_fp16": False,
        "amx_bf16": True, "amx_tile": True, "amx_int8": False,
    }
    assert list(hardware.isa_features(flags)) == list(hardware.ISA_FLAGS)


def test_avx2_only_arm_and_empty_cpuinfo():
    epyc = "model name\t: AMD EPYC\nflags\t\t: fpu avx avx2 fma\n"
    assert hardware.cpu_model(epyc) == "AMD EPYC"
    assert [k for k, v in hardware.isa_features(hardware.cpu_flags(epyc)).items() if v] == ["avx2"]
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16 sve\n"
    assert hardware.cpu_flags(arm) == frozenset({"fp", "asimd", "bf16", "sve"})
    assert not any(hardware.isa_features(hardware.cpu_flags(arm)).values())
    assert hardware.cpu_flags("") == frozenset()


def test_machine_record_has_the_isa_cores_and_threads(monkeypatch):
    loads = [(0.5, 0.4, 0.3), (1.25, 0.5, 0.3)]  # at the start, then at the end and after
    monkeypatch.setattr(hardware.os, "getloadavg", lambda: loads.pop(0) if len(loads) > 1 else loads[0])
    record = hardware.machine_record(num_threads=2, ray_version="x")
    assert set(record["isa"]) == set(hardware.ISA_FLAGS)
    assert all(isinstance(v, bool) for v in record["isa"].values())
    assert record["num_threads"] == 2 and record["ray_version"] == "x"
    assert 1 <= record["nproc"] <= record["num_cores"]
    assert record["load_avg_1m_at_start"] == 0.5 and "load_avg_1m_at_end" not in record
    assert hardware.finish_machine_record(record, cores_pinned=[[0]]) is record
    assert record["load_avg_1m_at_end"] == 1.25 and record["cores_pinned"] == [[0]]
    assert hardware.machine_record()["num_threads"] is None


def test_hardware_does_not_import_torch():
    import subprocess

    code = "import sys; from load_tests import hardware; hardware.machine_record(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
