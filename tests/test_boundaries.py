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
