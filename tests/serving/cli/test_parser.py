"""`kvrelay bench`'s targets come from load_tests/registry.py: listed with their help without
importing a benchmark, each target's arguments imported only when it is parsed, and a clear
refusal where the benchmarks are not installed."""

import importlib
import json
import subprocess
import sys

import pytest

from load_tests.registry import BENCHMARKS
from serving.cli import dispatch, parser
from serving.cli.parser import NO_BENCHMARKS, build_parser
from tests.helpers import REPO


def _run(code: str, cwd=REPO) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True).stdout


def test_bench_help_lists_every_target_with_its_help_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "--help"])
    assert exit_info.value.code == 0
    listed = " ".join(capsys.readouterr().out.split())
    assert list(BENCHMARKS) == ["engine", "serve-overhead", "routing", "serve", "scenario", "pd-sim", "soak", "hostile"]
    for name, benchmark in BENCHMARKS.items():
        assert f"{name} {' '.join(benchmark.help.split())}" in listed


def test_a_target_imports_only_its_arguments_module_when_parsed():
    code = ("import json, sys; from serving.cli.parser import build_parser; p = build_parser(); "
            "before = sorted(m for m in sys.modules if m.startswith('load_tests')); "
            "p.parse_args(['bench', 'serve', '--base-url', 'http://x']); "
            "after = sorted(m for m in sys.modules if m.startswith('load_tests')); "
            "print(json.dumps([before, after, 'torch' in sys.modules]))")
    before, after, has_torch = json.loads(_run(code))
    assert before == ["load_tests", "load_tests.registry"]
    assert after == ["load_tests", "load_tests.registry", "load_tests.serve", "load_tests.serve.params"]
    assert has_torch is False


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_each_target_declares_its_arguments_and_runs_from_them(name):
    benchmark = BENCHMARKS[name]
    arguments = importlib.import_module(benchmark.arguments_module)
    assert isinstance(arguments.DESCRIPTION, str) and callable(arguments.add_arguments)
    assert callable(importlib.import_module(benchmark.module).run_from_args)
    args = build_parser().parse_args(["bench", name, *(["peers"] if name == "scenario" else [])])
    assert args.target == name


def test_the_description_comes_from_the_targets_module(capsys):
    from load_tests.hostile.bench import DESCRIPTION

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "hostile", "--help"])
    assert " ".join(DESCRIPTION.split()) in " ".join(capsys.readouterr().out.split())


def test_the_checkout_is_found_where_load_tests_is_not_on_the_path(tmp_path):
    code = (f"import sys; sys.path = [p for p in sys.path if p not in ('', {str(REPO)!r})]; "
            "from serving.cli.parser import load_benchmarks; print(sorted(load_benchmarks()))")
    assert _run(code, cwd=tmp_path).strip() == repr(sorted(BENCHMARKS))


def test_without_the_benchmarks_bench_says_how_to_get_them(monkeypatch, capsys):
    monkeypatch.setattr(parser, "load_benchmarks", lambda: None)
    monkeypatch.setattr(dispatch, "load_benchmarks", lambda: None)
    assert dispatch.main(["bench", "engine", "--quick"]) == 2
    assert capsys.readouterr().err == f"kvrelay bench: {NO_BENCHMARKS}\n"
    assert "pip install -e '.[bench]'" in NO_BENCHMARKS
