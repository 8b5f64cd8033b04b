"""The lint and type gate, run with the tests: ruff over the whole tree (its rules and exceptions in
pyproject.toml), mypy over the files that are typed through (a list that only grows)."""
import subprocess
import sys

from conftest import ROOT

# Checked by mypy; add a module (or a package, every module of it) here once it passes.
TYPED = ["tokenpulse/protocol.py", "server/store.py", "server/attempt_outcomes.py", "tokenpulse/diagnosis",
         "worker/agent"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_finds_nothing():
    r = run("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_finds_nothing_in_the_typed_modules():
    r = run("mypy", "--no-incremental", *TYPED)
    assert r.returncode == 0, r.stdout + r.stderr
