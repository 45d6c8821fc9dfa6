"""The packages of `megatron/` depend on each other without a cycle, and so do the modules of
megatron/config: every import, at module level, inside a function or under TYPE_CHECKING, read by
parsing the sources, never by importing them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

MEGATRON = Path(__file__).resolve().parents[1] / "megatron"


def unit_of(module: str) -> str | None:
    """The unit a `megatron...` module belongs to: its subpackage (`megatron.checkpoint`) or, for a module at
    the top of `megatron/`, that module (`megatron.NAME`); None outside `megatron`."""
    parts = module.split(".")
    if parts[0] != "megatron" or len(parts) < 2:
        return None
    return ".".join(parts[:2])


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every module `source` (the text of `module`) imports, relative imports resolved."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.add(target)
            # `from megatron import mpu` imports the subpackage megatron.mpu (`from megatron.config import validate`
            # the module); names that are no module (`from megatron.config import Config`) match none in the graphs
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def module_of(path: Path, root: Path) -> tuple[str, bool]:
    """The dotted name of the module in `path` under `root` (a `megatron` package), and whether it is a package's
    __init__.py (named as the package)."""
    relative = path.relative_to(root.parent).with_suffix("")
    is_package = relative.name == "__init__"
    return ".".join(relative.parts[:-1] if is_package else relative.parts), is_package


def unit_graph(root: Path) -> dict[str, set[str]]:
    """Unit -> the other units it imports, over every .py file under `root` (a `megatron` package)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        module, is_package = module_of(path, root)
        unit = unit_of(module)
        if unit is None:  # megatron/__init__.py
            continue
        targets = {unit_of(name) for name in imported_modules(path.read_text(encoding="utf-8"), module, is_package)}
        graph.setdefault(unit, set()).update(t for t in targets if t is not None and t != unit)
    return graph


def module_graph(package: Path, top: Path | None = None) -> dict[str, set[str]]:
    """Module -> the other modules of `package` (a folder of a `megatron` package, or the top-level folder `top`
    itself, e.g. benchmarks/) it imports."""
    modules = {path: module_of(path, top or package.parent) for path in sorted(package.rglob("*.py"))}
    names = {module for module, _ in modules.values()}
    return {module: (imported_modules(path.read_text(encoding="utf-8"), module, is_package) & names) - {module}
            for path, (module, is_package) in modules.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every node `start` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for child in graph.get(todo.pop(), ()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for child in sorted(graph.get(node, ())):
            if state.get(child) == "open":
                return path[path.index(child):] + [child]
            if child not in state and (cycle := visit(child)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_megatron_packages_import_each_other_without_a_cycle():
    graph = unit_graph(MEGATRON)
    assert {"megatron.checkpoint", "megatron.growth", "megatron.inference", "megatron.training"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between megatron's packages: " + " -> ".join(cycle)


def test_the_ranks_and_deepy_py_share_only_what_both_run():
    """The ranks' code (megatron/runtime and what it serves) never imports deepy.py's side (megatron/launch),
    nor does deepy.py's side import theirs: what both need is megatron/host."""
    graph = unit_graph(MEGATRON)
    for rank_side in ("megatron.runtime", "megatron.training", "megatron.inference"):
        assert "megatron.launch" not in reachable(graph, rank_side), rank_side
    assert "megatron.runtime" not in reachable(graph, "megatron.launch")
    assert reachable(graph, "megatron.host") <= {"megatron.config"}


def test_the_modules_of_megatron_config_import_each_other_without_a_cycle():
    graph = module_graph(MEGATRON / "config")
    assert {"megatron.config", "megatron.config.config", "megatron.config.validate"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between megatron.config's modules: " + " -> ".join(cycle)


@pytest.mark.parametrize("folder", ["benchmarks", "tools", "data_prep"])
def test_the_scripts_outside_megatron_import_each_other_without_a_cycle(folder):
    """The modules of benchmarks/, tools/ and data_prep/ import each other without a cycle, under TYPE_CHECKING
    too: a cycle would make each module readable only together with the others."""
    root = MEGATRON.parent / folder
    graph = module_graph(root, root)
    assert folder != "benchmarks" or "benchmarks.incremental_scaling.report" in graph
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle between {folder}'s modules: " + " -> ".join(cycle)


def test_no_checkpoint_module_is_left_at_the_top_of_megatron():
    loose = sorted(p.name for p in MEGATRON.glob("*.py") if "checkpoint" in p.name or p.stem in (
        "output_directory", "work_split", "rng_state"))
    assert loose == []


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "megatron" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "megatron"


@pytest.mark.parametrize("where", ["module level", "inside a function", "relative"])
def test_a_cycle_between_packages_is_found(tmp_path, where):
    back = {"module level": "from megatron.training.loop import run\n",
            "inside a function": "def load():\n    from megatron.training import loop\n",
            "relative": "from ..training import loop\n"}[where]
    root = write_package(tmp_path, {
        "__init__.py": "", "training/__init__.py": "", "training/loop.py": "from megatron.checkpoint import save\n",
        "checkpoint/__init__.py": "", "checkpoint/save.py": back, "metrics.py": "import megatron.training\n"})
    assert find_cycle(unit_graph(root)) == ["megatron.checkpoint", "megatron.training", "megatron.checkpoint"]


def test_imports_within_a_package_and_one_way_imports_are_no_cycle(tmp_path):
    root = write_package(tmp_path, {
        "__init__.py": "", "checkpoint/__init__.py": "from megatron.checkpoint import save\n",
        "checkpoint/save.py": "from . import __init__\nfrom megatron import mpu\n", "mpu/__init__.py": "",
        "training/__init__.py": "from megatron.checkpoint.save import x\nfrom megatron import mpu\n"})
    graph = unit_graph(root)
    assert graph["megatron.training"] == {"megatron.checkpoint", "megatron.mpu"}
    assert find_cycle(graph) is None


def test_a_cycle_between_modules_of_a_package_is_found_also_under_type_checking(tmp_path):
    package = write_package(tmp_path, {
        "__init__.py": "", "config/__init__.py": "",
        "config/config.py": "from megatron.config.validate import check\n",
        "config/validate.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .config import Config\n",
        "config/loader.py": "from megatron.config import config, validate\n"})
    graph = module_graph(package / "config")
    assert graph["megatron.config.loader"] == {"megatron.config", "megatron.config.config", "megatron.config.validate"}
    assert find_cycle(graph) == ["megatron.config.config", "megatron.config.validate", "megatron.config.config"]
