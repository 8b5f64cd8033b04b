"""Real parts for tests: a uvicorn server process on a free 127.0.0.1 port with its own SQLite file
(or, with TOKENPULSE_TEST_DB=postgresql, its own database on a PostgreSQL the run starts: tests/pg.py),
real agent processes, a websocket client. Nothing is mocked."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx
import pytest

from tests import pg

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"

# Four test files run side by side on two cores (Makefile XDIST), each starting servers, agents and
# training processes: OpenMP threads wait without spinning and tokenizers start no thread pool, so
# they do not fight for the two cores. (OMP_NUM_THREADS=1 was tried: oneDNN then fails the memory
# measurement under the tests' address-space cap, test_memory.py.)
for _k, _v in {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)


def wait_for(pred, timeout: float, what: str, every: float = 0.2, show=None):
    """Poll pred() until it returns something truthy; fail naming what never happened."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}" + (f"; {show()}" if show else ""))


@pytest.fixture(autouse=True)
def _sigint_as_python_leaves_it():
    """Each test starts with Python's own SIGINT handler, unblocked: children inherit an ignored or
    blocked signal, and a CLI started after some earlier test in the same worker left SIGINT so
    ignored Ctrl+C (seen twice in whole runs: `watch` looping on after SIGINT)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    yield


def wait_exit(p: subprocess.Popen, timeout: float, what: str) -> int:
    """p's exit code; if it is still running after timeout, fail with its stacks (py-spy) so the
    failure says where it hangs, not only that it did."""
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        spy = Path(sys.executable).parent / "py-spy"
        dump = subprocess.run([str(spy), "dump", "--pid", str(p.pid)], capture_output=True, text=True, timeout=60)
        p.kill()
        raise AssertionError(f"{what}: still running {timeout} s on; its stacks:\n{dump.stdout}{dump.stderr}") from None


def is_training(cmdline: list[str]) -> bool:
    """The training process itself, not the keeper that starts it (worker/agent/keeper.py carries the
    training command line after its own)."""
    line = " ".join(cmdline)
    return "worker.training.train" in line and "keeper" not in line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    data_dir: Path
    env: dict
    port: int
    proc: Optional[subprocess.Popen] = None
    agents: list = field(default_factory=list)
    log_path: Optional[Path] = None

    @property
    def db_url(self) -> str:
        return self.env.get("TOKENPULSE_DATABASE_URL") or f"sqlite:///{self.data_dir / 'tokenpulse.db'}"

    @property
    def on_postgres(self) -> bool:
        return pg.is_postgres(self.db_url)

    def query(self, sql: str, params: tuple = (), write: bool = False) -> list[tuple]:
        """Run SQL (`?` placeholders) on this server's database, beside the server, as another
        program would; write=True commits."""
        with pg.connect(self.db_url) as con:
            cur = con.cursor()
            cur.execute(sql if not self.on_postgres else sql.replace("?", "%s"), params)
            rows = cur.fetchall() if cur.description else []
            if write:
                con.commit()
            return rows

    @property
    def token(self) -> str:
        return (self.data_dir / "token").read_text().strip()

    @property
    def agent_token(self) -> str:
        return (self.data_dir / "agent_token").read_text().strip()

    @property
    def fault_plan(self) -> Path:
        return Path(self.env["TOKENPULSE_FAULT_PLAN"])

    def plan_fault(self, job_name: str, **fault) -> str:
        """Test-only fault injection: the job named job_name gets these faults (read by its training
        process at start, through the agent's environment). Returns the name, for the spec."""
        plan = json.loads(self.fault_plan.read_text()) if self.fault_plan.exists() else {}
        plan[job_name] = fault
        tmp = self.fault_plan.with_suffix(".tmp")
        tmp.write_text(json.dumps(plan))
        tmp.replace(self.fault_plan)  # a training process starting now reads the old or the new plan, whole
        return job_name

    def journaled(self, agent: str, job_id: int) -> int:
        """Events an agent holds in its on-disk journal for a job, not yet acknowledged by the server."""
        path = self.data_dir.parent / f"work-{agent}" / "journal" / f"{job_id}.jsonl"
        try:
            return sum(1 for line in path.read_text().splitlines() if line.strip())
        except OSError:
            return 0

    def client(self, token: Optional[str] = None) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60,
                            headers={"Authorization": f"Bearer {token or self.token}"})

    def start(self) -> "Server":
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = self.data_dir.parent / f"server-{self.port}.log"
        log = self.log_path.open("a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenpulse.cli", "server", "--data-dir", str(self.data_dir),
             "--port", str(self.port)], env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.time() + 120  # a loaded 2-core machine has taken over 60 s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                if "address already in use" in self.log_path.read_text()[-3000:].lower():
                    # another test process (pytest-xdist) took the free port first: take another
                    self.port = free_port()
                    self.url = f"http://127.0.0.1:{self.port}"
                    return self.start()
                raise RuntimeError(f"server exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/api/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server did not start in 120 s")

    def kill(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def start_agent(self, name: str = "agent", *extra: str, env: Optional[dict] = None) -> subprocess.Popen:
        work = self.data_dir.parent / f"work-{name}"
        log = (self.data_dir.parent / f"agent-{name}.log").open("a")
        p = subprocess.Popen(
            [sys.executable, "-m", "tokenpulse.cli", "agent", "--server", self.url, "--token", self.agent_token,
             "--work-dir", str(work), "--name", name, "--heartbeat", "1", "--grace", "5", *extra],
            env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.agents.append(p)
        return p

    def wait_job(self, job_id: int, states=("completed", "failed", "cancelled", "paused"),
                 timeout: float = 120) -> dict:
        with self.client() as c:
            deadline = time.time() + timeout
            while time.time() < deadline:
                job = c.get(f"/api/jobs/{job_id}").json()
                if job["state"] in states:
                    return job
                time.sleep(0.2)
        raise AssertionError(f"job {job_id} still {job['state']} after {timeout} s: {job}")

    def ws(self, topics: str, token: Optional[str] = None):
        from websockets.sync.client import connect
        return connect(f"ws://127.0.0.1:{self.port}/ws?topics={topics}",
                       additional_headers={"Authorization": f"Bearer {token or self.token}"})


def make_server(tmp_path: Path, **settings) -> Server:
    port = free_port()
    data_dir = tmp_path / "data"
    # Agents started from this server's env (and their training processes) read the fault plan.
    env = {**os.environ, "TOKENPULSE_FAULT_PLAN": str(tmp_path / "fault-plan.json"), "PYTHONUNBUFFERED": "1",
           # A submit's data analysis (a child loading transformers, ~3 CPU-s) only where a test asks
           # for it (server_factory(preflight_wait_s=...)): the suite shares two cores.
           "TOKENPULSE_PREFLIGHT_WAIT_S": "0"}
    # Training processes forked from each agent's zygote (worker/agent/warm.py), started on the first
    # training job it could serve: an agent's later jobs and relaunches skip the imports (seconds of
    # CPU each); an agent that runs only commands imports nothing.
    env.setdefault("TOKENPULSE_WARM_START", "lazy")
    if pg.enabled() and "database_url" not in settings:
        env["TOKENPULSE_DATABASE_URL"] = pg.cluster().create_database("s")  # one database per server
    env.update({f"TOKENPULSE_{k.upper()}": (json.dumps(v) if isinstance(v, (list, dict)) else str(v))
                for k, v in settings.items()})
    return Server(url=f"http://127.0.0.1:{port}", data_dir=data_dir, env=env, port=port)


@pytest.fixture
def server_factory(tmp_path):
    made: list[Server] = []

    def factory(**settings) -> Server:
        s = make_server(tmp_path / f"s{len(made)}", **settings)
        made.append(s)
        return s.start()
    yield factory
    for s in made:
        stop_agents(s)
        s.kill()


def stop_agents(s: Server) -> None:
    """SIGTERM to every agent of the server still running (each checkpoints and requeues its jobs), then
    20 s for each to exit before SIGKILL."""
    for a in s.agents:
        if a.poll() is None:
            a.send_signal(signal.SIGTERM)
    for a in s.agents:
        try:
            a.wait(20)
        except subprocess.TimeoutExpired:
            a.kill()


def command_agent_server(tmp_path_factory, name: str):
    """For a module-scoped fixture: a server with one agent that runs command jobs, stopped after."""
    s = make_server(tmp_path_factory.mktemp(name)).start()
    s.start_agent("a1", "--allow-commands")
    yield s
    stop_agents(s)
    s.kill()


@pytest.fixture
def server(request, server_factory) -> Server:
    """A fresh server of its own; the run's shared one for a test marked `shared_server` (it only
    reads, or checks what it submitted itself: see shared_server)."""
    if request.node.get_closest_marker("shared_server"):
        return request.getfixturevalue("shared_server")
    return server_factory()


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory):
    """One server (no agent) for the whole run, for tests that only read it or check what they
    themselves submitted, by id or by a count taken before: a server start costs 1-3 CPU-seconds,
    paid once here instead of once per test. A test that needs an empty store, an agent, its own
    settings or to stop the server uses `server` / `server_factory`."""
    s = make_server(tmp_path_factory.mktemp("shared")).start()
    yield s
    for a in s.agents:  # none is expected; never left running
        a.kill()
    s.kill()


@pytest.fixture
def agent_server(server) -> Server:
    """A server with one agent running."""
    server.start_agent("a1")
    return server


# The longest files, measured (seconds of test time in a whole run, 2 cores, 4 workers, 2026-11-28).
# xdist hands out files in collection order (the Makefile turns off its own reordering by test count,
# which put these few-test files last): started first, the long ones overlap with many short ones
# instead of running alone at the end while the other workers sit idle (longest first, as in LPT).
LONG_FILES = {"test_gang_control.py": 287, "test_detection.py": 263, "test_spine.py": 250,
              "test_distributed.py": 244, "test_hf_hub.py": 217, "test_durability.py": 210, "test_slurm.py": 206,
              "test_command_instrument.py": 169, "test_retries.py": 168, "test_ui.py": 154, "test_cli.py": 150,
              "test_memory.py": 146, "test_fixes.py": 139, "test_ui_job.py": 134, "test_postmortems.py": 133,
              "test_disk_full.py": 130, "test_realworld.py": 125, "test_any_script.py": 113, "test_sweeps.py": 98,
              "test_training.py": 95, "test_secret_leaks.py": 89, "test_real_loops.py": 84, "test_warm_start.py": 78,
              "test_ui_pages.py": 70, "test_preflight.py": 70, "test_queue_resilience.py": 70,
              "test_external.py": 69, "test_command_jobs.py": 67}


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: -LONG_FILES.get(item.path.name, 0))  # stable: a file's own order is kept
