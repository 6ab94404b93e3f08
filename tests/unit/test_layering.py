"""The engine stays usable without Prefect: `vime_core` never imports prefect, tasks or flows (not even inside a
function), and its module-level imports form no cycle. Read from the source (AST), so no engine is imported."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
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
    """Every module of vime_core, subpackages included (`vime_core/config/__init__.py` is `vime_core.config`)."""
    mods = {
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p for p in CORE.rglob("*.py")
    }
    mods.pop("vime_core", None)
    return mods


def module_level_edges(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The vime_core modules `name` imports at module level. Importing `a.b.c` first runs the package `a.b`, so that
    is an edge too, unless `name` lies inside `a.b` (then `a.b` is already being imported)."""
    edges = set()
    for i in imports(path, module_level_only=True):
        parts = i.split(".")
        for k in range(2, len(parts) + 1):
            target = ".".join(parts[:k])
            if target in mods and target != name and not name.startswith(target + "."):
                edges.add(target)
    return edges


def test_module_discovery_covers_subpackages():
    mods = core_modules()
    assert {"vime_core.loop", "vime_core.config", "vime_core.config.schema", "vime_core.models.qwen3"} <= set(mods)
    graph = {n: module_level_edges(n, p, mods) for n, p in mods.items()}
    assert (
        "vime_core.config" in graph["vime_core.models.spec"]
        and "vime_core.config.checks" in graph["vime_core.config.schema"]
    )


# runtime <- config <- models <- ...: what the lowest packages may import from vime_core (at any depth): their own
# package, the ones below, and leaf utilities (modules that import no vime_core module but vime_core.errors)
LOWER = {
    "vime_core.config": ("vime_core.runtime", "vime_core.config"),
    "vime_core.models": ("vime_core.runtime", "vime_core.config", "vime_core.models"),
}


def leaf_utilities(mods: dict[str, Path]) -> set[str]:
    return {
        n
        for n, p in mods.items()
        if not n.startswith(tuple(LOWER))
        and {i for i in imports(p, module_level_only=False) if i.startswith("vime_core.")}
        <= {"vime_core.errors", "vime_core.errors.VimeError"}
    }


def test_config_and_models_import_only_from_below():
    mods = core_modules()
    leaves = leaf_utilities(mods)
    assert {"vime_core.errors", "vime_core.platform"} <= leaves and "vime_core.checkpoint" not in leaves
    offenders = {}
    for name, path in mods.items():
        package = next((p for p in LOWER if name == p or name.startswith(p + ".")), None)
        if package is None:
            continue
        above = {
            i
            for i in imports(path, module_level_only=False)
            if i.startswith("vime_core.")
            and not any(i == ok or i.startswith(ok + ".") for ok in (*LOWER[package], *leaves))
        }
        if above:
            offenders[name] = sorted(above)
    assert any(n.startswith("vime_core.models.") for n in mods), (
        "no models package found: the test would pass vacuously"
    )
    assert offenders == {}, "config and models sit below everything but the runtime: move the code or the import"


def test_vime_core_never_imports_the_orchestration_layer():
    offenders = {
        name: sorted(
            i for i in imports(path, module_level_only=False) if i.split(".")[0] in ("prefect", "tasks", "flows")
        )
        for name, path in core_modules().items()
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_vime_core_module_level_imports_have_no_cycle():
    mods = core_modules()
    graph = {name: module_level_edges(name, path, mods) for name, path in mods.items()}
    assert graph["vime_core.loop"], "the parser found no edges: the test would pass vacuously"
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                path = stack + [node]
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


# --- no private names across modules; function-level imports form no cycle either ------------------------------------
SCANNED = ("vime_core", "tasks", "flows", "tests", "bench", "scripts")


def runtime_import_nodes(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of `path`, at any depth, except those under `if TYPE_CHECKING:` (never executed)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skipped]


def private_imports(path: Path) -> list[str]:
    """`from m import _x` / `import m._x` of a private (single underscore) name of one of our modules, as
    'line: statement'. Other packages' private modules (torch._dynamo, ray._private) are their business."""
    out = []
    for node in runtime_import_nodes(path):
        if isinstance(node, ast.ImportFrom):
            if node.level or (node.module or "").split(".")[0] not in SCANNED:
                continue
            names = [a.name for a in node.names] + node.module.split(".")
        else:
            names = [part for a in node.names if a.name.split(".")[0] in SCANNED for part in a.name.split(".")]
        if any(n.startswith("_") and not n.startswith("__") for n in names):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def test_private_name_is_found(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\nfrom vime_core.x import y, _z\nif TYPE_CHECKING:\n"
        "    from vime_core.a import _b\ndef f():\n    import vime_core._c\n    from torch._dynamo import d\n"
    )
    assert private_imports(probe) == ["2: from vime_core.x import y, _z", "6: import vime_core._c"]


def test_no_module_imports_a_private_name_of_another():
    files = [p for d in SCANNED for p in sorted((REPO / d).rglob("*.py"))]
    assert len(files) > 50, "the scan found too few files: the test would pass vacuously"
    offenders = {str(p.relative_to(REPO)): hits for p in files if (hits := private_imports(p))}
    assert offenders == {}, "make the name public (and document it) or move it to the module that uses it"


def core_graph_any_depth() -> dict[str, set[str]]:
    """vime_core module -> the vime_core modules it imports anywhere (module level or inside a function)."""
    mods = {
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p for p in CORE.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        edges = set()
        for node in runtime_import_nodes(path):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in mods and t != name}
        # a package's __init__ re-exporting its own submodules is not a cycle with them
        graph[name] = {e for e in edges if not (e.startswith(name + ".") and mods[name].name == "__init__.py")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                path = stack + [node]
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, stack + [node])):
                return found
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name, [])):
            return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_vime_core_imports_have_no_cycle_even_inside_functions():
    """A function-level import hides a cycle from the interpreter, not from the design: the two modules cannot be
    understood, tested or moved apart (loop <-> evaluation, sources <-> tracking were such pairs)."""
    graph = core_graph_any_depth()
    assert "vime_core.evaluation" in graph["vime_core.loop"], "the parser found no function-level edges"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle (counting imports inside functions): " + " -> ".join(cycle or [])


def imports_inside_functions(path: Path) -> list[ast.Import | ast.ImportFrom]:
    tree = ast.parse(path.read_text(), filename=str(path))
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return [n for f in funcs for stmt in f.body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_stdlib_is_imported_at_module_level():
    """Lazy imports are for heavy or optional packages (ray, vllm, megatron, mlflow, transformers, prefect); a stdlib
    import inside a function only hides what a module depends on."""
    import sys

    offenders = []
    for d in ("vime_core", "tasks", "flows"):
        for path in sorted((REPO / d).rglob("*.py")):
            for node in imports_inside_functions(path):
                mod = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                if mod and not getattr(node, "level", 0) and mod.split(".")[0] in sys.stdlib_module_names:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == []


def test_no_vime_core_file_is_over_500_lines():
    """Small files: a module past 500 lines holds two concerns (CONTRIBUTING.md); split it."""
    long = {name: n for name, p in core_modules().items() if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def repo_python_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (REPO / d).rglob("*.py") if ".venv" not in p.parts)


def test_no_python_file_of_the_repo_is_over_500_lines():
    """The same for the orchestration layer, the bench scripts and the tests: a test file past 500 lines holds
    several topics."""
    dirs = ("tasks", "flows", "bench", "tests", "scripts", "infra")
    long = {
        str(p.relative_to(REPO)): n for p in repo_python_files(*dirs) if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long


def long_functions(path: Path, limit: int = 60) -> list[str]:
    """`name:lines` of every function (methods and nested ones too) in `path` longer than `limit` lines."""
    tree = ast.parse(path.read_text())
    return [
        f"{node.name}:{node.end_lineno - node.lineno + 1}"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_vime_core_function_is_over_60_lines():
    """Small functions (CONTRIBUTING.md): one over 60 lines does several things; name them."""
    long = {name: found for name, p in core_modules().items() if (found := long_functions(p))}
    assert not long, long


def test_no_function_of_the_rest_of_the_repo_is_over_60_lines():
    """The same outside vime_core: the orchestration layer, the bench scripts, the tests (a test past 60 lines
    checks several things; its steps become named helpers) and the scripts."""
    dirs = ("tasks", "flows", "bench", "tests", "scripts", "infra")
    long = {str(p.relative_to(REPO)): found for p in repo_python_files(*dirs) if (found := long_functions(p))}
    assert not long, long


def test_the_function_length_check_finds_a_long_one(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(60))
    planted = tmp_path / "planted.py"
    planted.write_text(f"def short():\n    return 1\n\n\nclass C:\n    def long(self):\n{body}\n")
    assert long_functions(planted) == ["long:61"]


def test_bench_scripts_import_each_other_without_a_cycle():
    """bench/ modules import their siblings by name (the scripts put bench/ on sys.path): those edges, at any depth,
    form no cycle either (gpu_scale <-> gpu_scale_phases was one)."""
    bench = {p.stem: p for p in (REPO / "bench").glob("*.py")}
    graph = {
        name: {i.split(".")[0] for i in imports(p, module_level_only=False)} & set(bench) for name, p in bench.items()
    }
    assert "gpu_scale_config" in graph["gpu_scale_phases"], "the parser found no bench edges"
    cycle = find_cycle(graph)
    assert cycle is None, "bench import cycle: " + " -> ".join(cycle or [])


def test_only_the_model_package_imports_a_weight_mapping():
    """The HF <-> megatron mapping is reached through `spec_of(arch).mapping()`, so that a second model family is one
    spec and one mapping module in vime_core/models/, not edits wherever weights are handled."""
    roots = [CORE, REPO / "flows", REPO / "tasks", REPO / "bench"]
    users = {
        str(p.relative_to(REPO))
        for root in roots
        for p in root.rglob("*.py")
        if p.parent != CORE / "models" and any("qwen3_mapping" in i for i in imports(p, module_level_only=False))
    }
    assert not users, users


ACTORS = {"trainer/rank.py": "Trainer", "rollout.py": "VLLMEngine", "sync/worker.py": "VLLMWorkerExtension"}
TRANSPORT_WORDS = ("cpu", "cuda", "ipc", "nccl")  # the words of sync.TRANSPORTS' names


def class_methods(source: str) -> dict[str, list[str]]:
    return {
        c.name: [f.name for f in c.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for c in ast.walk(ast.parse(source))
        if isinstance(c, ast.ClassDef)
    }


def weights_door_problems(files: dict[str, str], actors: dict[str, str]) -> list[str]:
    """Every way the weight seam leaks: an actor class with other than one public (Ray-callable) method about weights,
    or a method outside
    sync/ named after a transport (that logic belongs in the transport's module, reached through the one door)."""
    problems = []
    for rel, source in files.items():
        methods = class_methods(source)
        if rel in actors:
            doors = [m for m in methods.get(actors[rel], []) if "weight" in m and not m.startswith("_")]
            if len(doors) != 1:
                problems.append(f"{actors[rel]} has weights methods {doors}: exactly one door")
        if not rel.startswith("sync/"):
            problems += [
                f"{rel}: {cls}.{m} is named after a transport"
                for cls, ms in methods.items()
                for m in ms
                if set(m.lower().split("_")) & set(TRANSPORT_WORDS)
            ]
    return problems


def test_each_actor_has_one_weights_door_and_no_transport_named_method():
    files = {str(p.relative_to(CORE)): p.read_text() for p in CORE.rglob("*.py")}
    assert weights_door_problems(files, ACTORS) == []


def test_the_weights_door_rule_catches_a_planted_violation():
    planted = "class Trainer:\n    def weights(self, op): ...\n    def next_ipc_bucket(self): ...\n"
    assert weights_door_problems({"trainer/rank.py": planted}, ACTORS) == [
        "trainer/rank.py: Trainer.next_ipc_bucket is named after a transport"
    ]
    two_doors = "class VLLMEngine:\n    def weights(self): ...\n    def load_weights(self): ...\n"
    assert weights_door_problems({"rollout.py": two_doors}, ACTORS) == [
        "VLLMEngine has weights methods ['weights', 'load_weights']: exactly one door"
    ]
