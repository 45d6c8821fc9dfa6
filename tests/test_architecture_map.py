"""docs/architecture.md's map of `megatron/` stays true: one row per package, and its "Imports" column is
exactly the packages it imports (every import, at module level or inside a function, read from the sources)."""

from __future__ import annotations

import re

from tests.conftest import REPO
from tests.test_import_graph import MEGATRON, unit_graph

MAP = REPO / "docs" / "architecture.md"
ROW = re.compile(r"^\| `(?P<unit>megatron\.\w+)` \| (?P<owns>[^|]+) \| (?P<imports>[^|]*) \|$")


def documented_graph() -> dict[str, set[str]]:
    graph = {}
    for line in MAP.read_text(encoding="utf-8").splitlines():
        if match := ROW.match(line.strip()):
            assert match["unit"] not in graph, f"{match['unit']} has two rows in {MAP.name}"
            graph[match["unit"]] = {f"megatron.{name}" for name in re.findall(r"`(\w+)`", match["imports"])}
    return graph


def test_the_architecture_map_lists_every_package_and_exactly_what_it_imports():
    actual, documented = unit_graph(MEGATRON), documented_graph()
    assert set(documented) == set(actual), (
        f"{MAP.name} rows: add {sorted(set(actual) - set(documented))}, remove {sorted(set(documented) - set(actual))}")
    wrong = {unit: f"imports {sorted(name.removeprefix('megatron.') for name in actual[unit])}"
             for unit in actual if documented[unit] != actual[unit]}
    assert not wrong, f"{MAP.name} is out of date: {wrong}"
