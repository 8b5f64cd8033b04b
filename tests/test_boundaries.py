"""The layout's promises: the agent and the server never load torch; the two worker programs never
import each other (each is started as its own process, and the agent must start fast on a machine
where importing torch takes seconds); `tokenpulse/` is the ground floor: it imports nothing from
`worker/` or `server/`, except the CLI, which starts them."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest


def modules_after(import_line: str) -> set[str]:
    code = f"import sys; {import_line}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


@pytest.mark.parametrize("import_line, forbidden", [
    ("import worker.agent; import worker.agent.agent", {"torch", "transformers", "worker.training"}),
    ("import worker.checkpoint_layout", {"torch", "worker.agent", "worker.training"}),
    ("import server.app", {"torch", "transformers", "worker.training"}),
    ("import tokenpulse.cli, tokenpulse.client, tokenpulse.protocol", {"torch", "transformers"}),
    # the watchdog runs beside a user's script: the diagnosis it shares with the agent is torch-free
    ("import tokenpulse.watchdog, tokenpulse.diagnosis.capture", {"torch", "transformers", "worker", "server"}),
    # loaded into every Python process of a command job, and by `import tokenpulse` in user scripts
    ("import tokenpulse, tokenpulse.events, tokenpulse.instrument.boot", {"torch", "transformers", "pydantic"}),
])
def test_import_loads_nothing_heavy(import_line, forbidden):
    loaded = modules_after(import_line)
    assert not forbidden & loaded, f"{import_line!r} loaded {sorted(forbidden & loaded)}"


def test_training_process_does_not_import_the_agent():
    loaded = modules_after("import worker.training.train, worker.training.session")
    assert "torch" in loaded  # the check can fail: the training side really is loaded
    assert not {m for m in loaded if m.startswith("worker.agent")}


PACKAGES = ("server", "worker", "tokenpulse")


def import_graph(root) -> dict[str, set[str]]:
    """Module -> the project modules it imports, from the source: every import statement, the ones
    inside functions too (a lazy import hides a circle from Python, not from this graph)."""
    import ast
    modules = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = (path, parts[-1] == "__init__")
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import mod` imports the module pkg.mod when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                # `import a.b.c` runs a, a.b and a.b.c: the deepest project module named is the edge
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.add(target)
        graph[name] = found
    return graph


# Circles still open, each to be broken where it is (the list only shrinks).
KNOWN_CIRCLES: list[set[str]] = []


def find_cycle(graph: dict[str, set[str]]):
    """One import circle as a list of modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_import_graph_has_no_cycles():
    from pathlib import Path
    graph = import_graph(Path(__file__).resolve().parent.parent)
    assert "server.hub" in graph and graph["server.app"]  # the graph really is built
    for circle in KNOWN_CIRCLES:
        assert find_cycle({m: graph[m] & circle for m in circle}), f"{sorted(circle)} is no circle now: drop it"
        a, b = sorted(circle)
        graph = {m: deps - {b} if m == a else deps for m, deps in graph.items()}  # one edge cut opens it
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_cycle_finder_sees_a_lazy_import(tmp_path):
    """The graph counts an import inside a function: the lazy import that hid each circle until now."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "server" / "a.py").write_text("from server.b import f\n")
    (tmp_path / "server" / "b.py").write_text("def f():\n    from . import a\n    return a\n")
    graph = import_graph(tmp_path)
    assert graph["server.a"] == {"server.b"} and graph["server.b"] == {"server.a"}
    assert find_cycle(graph) in (["server.a", "server.b", "server.a"], ["server.b", "server.a", "server.b"])


ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at its top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_the_ground_floor_imports_neither_worker_nor_server():
    files = [p for p in (ROOT / "tokenpulse").rglob("*.py") if p != ROOT / "tokenpulse" / "cli.py"]
    assert len(files) > 10  # the check can fail: it reads the package
    wrong = {f"{p.relative_to(ROOT)}: {m}" for p in files for m in imported_modules(p)
             if m.split(".")[0] in ("worker", "server")}
    assert not wrong, sorted(wrong)


def test_rooms_stay_small():
    """Issue 31's rooms: worker/agent/job_run.py under 400 lines and no class in worker/ over 250, each
    split along a seam that docs/ARCHITECTURE.md names (a class that grows past it is split again)."""
    root = Path(__file__).resolve().parent.parent
    assert len((root / "worker/agent/job_run.py").read_text().splitlines()) < 400
    big = []
    for path in sorted((root / "worker").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 250:
                big.append(f"{path.relative_to(root)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not big, big
