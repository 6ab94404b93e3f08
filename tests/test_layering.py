"""The engine stays usable without Prefect: `vime_core` never imports prefect, tasks or flows (not even inside a
function), and its module-level imports form no cycle. Read from the source (AST), so no engine is imported."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "vime_core"


def imports(path: Path, module_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def core_modules() -> dict[str, Path]:
    return {f"vime_core.{p.stem}": p for p in CORE.glob("*.py") if p.stem != "__init__"}


def test_vime_core_never_imports_the_orchestration_layer():
    offenders = {
        name: sorted(i for i in imports(path, module_level_only=False) if i.split(".")[0] in ("prefect", "tasks", "flows"))
        for name, path in core_modules().items()
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_vime_core_module_level_imports_have_no_cycle():
    mods = core_modules()
    graph = {name: {i for i in imports(path, module_level_only=True) if i in mods} for name, path in mods.items()}
    assert graph["vime_core.loop"], "the parser found no edges: the test would pass vacuously"
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                path = stack + [node]
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
