"""Parts of one job each: no product module over 400 lines, no function over 60, without its reason.

A module or function past the bound states why in its own docstring, on a line that starts with
`Length:` (e.g. `Length: one table of the OpenAI fields, read top to bottom.`): the reason a reader
would otherwise ask for. Everything else splits by responsibility (../shared/STYLE.md, habit 1).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT_FOLDERS = ("serving", "router", "cluster")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def product_modules() -> list[Path]:
    return sorted(path for folder in PRODUCT_FOLDERS for path in (ROOT / folder).rglob("*.py"))


def states_its_length(docstring: str | None) -> bool:
    return any(line.strip().startswith("Length:") for line in (docstring or "").splitlines())


def oversized(source: str, name: str) -> list[str]:
    """Every part of one module's source past its bound without a `Length:` reason, as `name:line what (N lines)`."""
    tree = ast.parse(source)
    found = []
    num_lines = len(source.splitlines())
    if num_lines > MAX_MODULE_LINES and not states_its_length(ast.get_docstring(tree)):
        found.append(f"{name} module ({num_lines} lines)")
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES and not states_its_length(ast.get_docstring(node)):
                found.append(f"{name}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_the_checker_finds_long_parts_and_accepts_stated_reasons():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert oversized(f"def f():\n{body}", "m.py") == ["m.py:1 f (61 lines)"]
    assert oversized(f'def f():\n    """Length: one table."""\n{body}', "m.py") == []
    assert oversized(f"def f():\n{body[: -len('    x59 = 59')-1]}", "m.py") == []
    many = "x = 1\n" * (MAX_MODULE_LINES + 1)
    assert oversized(many, "m.py") == ["m.py module (401 lines)"]
    assert oversized('"""Design.\n\nLength: a generated table."""\n' + many, "m.py") == []


@pytest.mark.parametrize("folder", PRODUCT_FOLDERS)
def test_product_modules_and_functions_are_within_bounds_or_say_why(folder):
    found = []
    for path in product_modules():
        if path.relative_to(ROOT).parts[0] == folder:
            found += oversized(path.read_text(), str(path.relative_to(ROOT)))
    assert found == [], "split by responsibility, or state a `Length:` reason in the docstring:\n" + "\n".join(found)
