"""The import layers of docs/architecture.md: a module never imports from a layer above its own.

    serving.engine → serving.observability → router → serving.config → serving.api
        → serving.deployments → cluster → load_tests → serving.cli

Every import counts, a lazy one inside a function too: a layer below must work without the
layers above it installed or imported."""

import ast
from pathlib import Path

import pytest

from tests.helpers import REPO

LAYERS = ("serving.engine", "serving.observability", "router", "serving.config", "serving.api",
          "serving.deployments", "cluster", "load_tests", "serving.cli")
PACKAGES = ("serving", "router", "cluster", "load_tests")


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the longest layer that is `module` or contains it."""
    best = None
    for index, layer in enumerate(LAYERS):
        if (module == layer or module.startswith(layer + ".")) and (best is None or len(layer) > len(LAYERS[best])):
            best = index
    return best


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def imported_modules(path: Path) -> set[tuple[int, str]]:
    """(line, module) of each import of ours in the file; `from a import b` counts as `a.b` when
    a.b is a module and as `a` otherwise."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] in PACKAGES}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] in PACKAGES:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                as_path = REPO / candidate.replace(".", "/")
                is_module = as_path.with_suffix(".py").is_file() or (as_path / "__init__.py").is_file()
                found.add((node.lineno, candidate if is_module else node.module))
    return found


def product_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def upward_imports() -> list[str]:
    found = []
    for path in product_files():
        own = layer_of(module_name(path))
        for line, module in sorted(imported_modules(path)):
            target = layer_of(module)
            if own is not None and target is not None and target > own:
                found.append(f"{path.relative_to(REPO)}:{line} ({LAYERS[own]}) imports {module} ({LAYERS[target]})")
    return found


def test_every_product_module_has_a_layer():
    unplaced = [str(p.relative_to(REPO)) for p in product_files()
                if layer_of(module_name(p)) is None and p.name != "__init__.py"]
    assert unplaced == []


def test_no_module_imports_from_a_layer_above_its_own():
    assert upward_imports() == []


@pytest.mark.parametrize(("module", "layer"), [
    ("serving.engine.engine", "serving.engine"), ("serving.config", "serving.config"),
    ("router.autoscaling.decide", "router"), ("serving.cli.dispatch", "serving.cli"),
    ("load_tests.soak.bench", "load_tests"), ("serving", None),
])
def test_layer_of_takes_the_longest_prefix(module, layer):
    index = layer_of(module)
    assert (None if index is None else LAYERS[index]) == layer


# Loading a config or running an ops command needs no torch, no model code and no benchmark: the
# Serve controller imports the autoscaling policy, `kvrelay status` and `scale` the config.
LIGHT_MODULES = ("serving.config", "router.autoscaling.decide", "router.autoscaling.policy", "router.index",
                 "serving.cli.dispatch", "cluster.dashboard")
HEAVY = ("torch", "matplotlib", "load_tests", "serving.engine.engine")


def test_configs_and_ops_commands_load_without_torch_or_the_benchmarks():
    import subprocess
    import sys

    code = (f"import sys\nfor m in {LIGHT_MODULES!r}: __import__(m)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or m in {HEAVY!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
