"""The layout's promises: the agent and the server never load torch; the two worker programs never
import each other (each is started as its own process, and the agent must start fast on a machine
where importing torch takes seconds)."""
import subprocess
import sys

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
