"""The suite's own machinery: the CI skip gate, the kernel paths line, the OpenAI error-shape
check of the fuzz runs, polling with a deadline, SSE parsing."""

from __future__ import annotations

import textwrap

import pytest

from tests.ci_skips import ALLOWED_SKIPS, AllowedSkip, Skip, SkipGate, unexpected
from tests.kernel_paths import summary_line
from tests.openapi_fuzz import openai_error_problem

SKIPPING_TESTS = textwrap.dedent('''
    import pytest

    def test_runs():
        assert True

    def test_without_cuda():
        pytest.skip("needs CUDA")

    def test_missing_tool():
        pytest.skip("promtool is not installed")

    @pytest.mark.xfail(reason="known")
    def test_expected_to_fail():
        assert False
''')


# ---- the CI skip gate ------------------------------------------------------------------------
def test_only_skips_off_the_allow_list_are_unexpected():
    skips = [Skip("a::cuda", "needs CUDA"), Skip("b::gemma", "the optional Gemma 3 270M checkpoint is not installed (make gemma3)"),
             Skip("c::packed", "kernel path 'packed-bf16' untested here: packed_linear needs AVX512-BF16"),
             Skip("d::peft", "could not import 'peft': No module named 'peft'"),
             Skip("e::native", "kernel path 'native' untested here: no native kernels (pytorch (the native build failed))"),
             Skip("f::cuda", "needs CUDA to be fast")]
    assert unexpected(skips) == [skips[3], skips[4], skips[5]]
    assert unexpected(skips, [AllowedSkip("peft", "why")]) == [s for s in skips if s.nodeid != "d::peft"]
    assert all(entry.why for entry in ALLOWED_SKIPS)


@pytest.fixture
def suite(pytester):
    """A small suite of its own, run in-process with the plugins a test gives it."""
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    return pytester


@pytest.mark.parametrize("ci", [True, False])
def test_under_ci_a_skip_off_the_allow_list_fails_the_run_and_is_named(suite, ci):
    suite.makepyfile(test_skips=SKIPPING_TESTS)
    gate = SkipGate(ci=ci)
    result = suite.runpytest_inprocess("-p", "no:randomly", plugins=[gate])
    result.assert_outcomes(passed=1, skipped=2, xfailed=1)
    assert gate.skips == [Skip("test_skips.py::test_without_cuda", "needs CUDA"),
                          Skip("test_skips.py::test_missing_tool", "promtool is not installed")]
    named = [line for line in result.outlines if line.startswith("FAILED ")]
    if ci:
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        assert named == ["FAILED test_skips.py::test_missing_tool - skipped under CI: promtool is not installed"]
    else:
        assert result.ret == pytest.ExitCode.OK
        assert named == []


def test_a_module_skipped_at_import_is_a_skip_too(suite):
    # a name no test module of the suite has: pytester runs in this process, where a test_lora is imported
    suite.makepyfile(test_skipped_at_import='import pytest\npytest.importorskip("no_such_module_here")\n\ndef test_x():\n    pass\n')
    gate = SkipGate(ci=True)
    result = suite.runpytest_inprocess("-p", "no:randomly", plugins=[gate])
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    [skip] = gate.skips
    assert (skip.nodeid, skip.reason) == ("test_skipped_at_import.py", "could not import 'no_such_module_here': No module named 'no_such_module_here'")


# ---- kernel paths ----------------------------------------------------------------------------
def test_the_kernel_paths_line_names_what_ran_and_what_went_untested():
    assert summary_line(set(), {}) is None
    assert summary_line({"native", "packed-bf16"}, {}) == "kernel paths: ran ['native', 'packed-bf16']; untested on this CPU: []"
    assert summary_line({"native"}, {"packed-bf16": "this CPU has no AVX512-BF16"}) == (
        "kernel paths: ran ['native']; untested on this CPU: ['packed-bf16' (this CPU has no AVX512-BF16)]")
    assert summary_line(set(), {"native": "pytorch (KVRELAY_DISABLE_NATIVE=1)"}) == (
        "kernel paths: ran []; untested on this CPU: ['native' (pytorch (KVRELAY_DISABLE_NATIVE=1))]")


# ---- the OpenAI error shape ------------------------------------------------------------------
def test_only_openai_shaped_error_bodies_pass():
    good = {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}
    assert openai_error_problem(good) is None
    assert openai_error_problem({"error": {**good["error"], "param": "max_tokens", "code": "invalid_value"}}) is None
    assert openai_error_problem({"detail": "Not Found"}) == "keys ['detail'], not ['error']"
    assert openai_error_problem({**good, "detail": "x"}) == "keys ['detail', 'error'], not ['error']"
    assert openai_error_problem([good]) == "keys list, not ['error']"
    assert openai_error_problem({"error": {"message": "m"}}) == "error keys ['message'], not ['code', 'message', 'param', 'type']"
    assert openai_error_problem({"error": {**good["error"], "extra": 1}}) == (
        "error keys ['code', 'extra', 'message', 'param', 'type'], not ['code', 'message', 'param', 'type']")
    assert openai_error_problem({"error": {**good["error"], "message": None, "code": 3}}) == "wrong types of ['message', 'code']"
    assert openai_error_problem({**good, "partial": {}}, also=frozenset({"partial"})) is None
