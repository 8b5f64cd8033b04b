"""Scripts in the styles people write, run unchanged as command jobs (issue 35, items 1-4, 6, 8):
a GPT loop (get_batch, model(X, Y), GradScaler, accumulation, evaluation at iteration 0), an LSTM
with a hand-written update and no optimizer object that saves its model whole, and a LightningModule
under its Trainer (one optimizer with a closure, and two). For each: the job's final step is the
script's optimizer steps exactly, however it ends (normal end, sys.exit, an exception, SIGTERM); the
loss series equals the numbers the script prints at the same steps; tokens/s is there. Then, in a
process under the hook: a model saved whole, copied and printed as without tokenpulse; the loss and
token capture adds no per-step device synchronisation. One server and agent for the module."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, command_agent_server

from tokenpulse.instrument import hook_dir

PY = sys.executable
SCRIPTS = Path(__file__).parent / "scripts"
GPT, LSTM, LIGHTNING = SCRIPTS / "gpt_style.py", SCRIPTS / "lstm_by_hand.py", SCRIPTS / "lightning_module.py"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    yield from command_agent_server(tmp_path_factory, "real")


@pytest.fixture(scope="module")
def c(srv):
    with srv.client() as client:
        yield client


def submit(c, cwd: Path, argv: list, **spec) -> int:
    r = c.post("/api/jobs/command", json={"command": [PY, *map(str, argv)], "cwd": str(cwd), "max_retries": 0,
                                          "env": {"OMP_NUM_THREADS": "1"}, **spec})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def events(c, jid: int, kind: str) -> list[dict]:
    got = c.get(f"/api/jobs/{jid}/events", params={"kinds": kind, "limit": 10000}).json()
    return [e["data"] for e in got["events"]]


def series(c, jid: int, key: str) -> dict[int, float]:
    s = c.get(f"/api/jobs/{jid}/metrics", params={"keys": [key]}).json()["series"].get(key) or {"step": [], "value": []}
    return dict(zip(s["step"], s["value"]))


def printed(c, jid: int, pattern: str, offset: int) -> dict[int, float]:
    """{step: loss} from the script's own lines; offset: its step number -> optimizer steps done."""
    out = {}
    for d in events(c, jid, "log"):
        m = re.search(pattern, d["line"])
        if m:
            out[int(m.group(1)) + offset] = float(m.group(2))
    return out


def assert_same_loss(c, jid: int, pattern: str, offset: int, places: int) -> None:
    says, ours = printed(c, jid, pattern, offset), series(c, jid, "loss")
    assert len(says) >= 2, events(c, jid, "log")
    for step, v in says.items():
        assert step in ours, (step, sorted(ours))
        assert abs(ours[step] - v) <= 0.5 * 10 ** -places + 1e-6, (step, ours[step], v)


def phases(c, jid: int) -> list[str]:
    return [d["name"] for d in events(c, jid, "phase")]


def test_a_gpt_loop_ends_at_its_exact_step_however_it_ends_with_its_printed_loss_and_tokens(srv, c, tmp_path):
    endings = {"normal": ("completed", 30), "exit": ("failed", 23), "raise": ("failed", 23), "term": ("failed", 23)}
    jobs = {end: submit(c, tmp_path, [GPT, "--max_iters", 30, "--accum", 3, "--end", end, "--end_at", 23])
            for end in endings}
    off = submit(c, tmp_path, [GPT, "--max_iters", 12], capture={"backward": False, "printed": False})
    for end, jid in jobs.items():
        job = srv.wait_job(jid, timeout=180)
        state, steps = endings[end]
        assert (job["state"], job["step"]) == (state, steps), (end, job)
        assert_same_loss(c, jid, r"^iter (\d+): loss ([\d.]+)", 1, 4)  # iter 0 is printed after the first step
        assert max(series(c, jid, "loss")) == steps, end  # the last step's loss too
        assert series(c, jid, "tokens_per_s"), end  # from model(X, Y): positional ids
        assert job["info"]["metric_sources"]["loss"] == "backward", job["info"]  # where the loss came from
    # how it ended is the script's own: its exit code, its signal
    assert srv.wait_job(jobs["exit"])["exit_code"] == 3
    assert srv.wait_job(jobs["term"])["signal"] == "SIGTERM"
    # the evaluation at iteration 0 runs before any optimizer step: an evaluation, not loading
    names = phases(c, jobs["normal"])
    assert "evaluating" in names and names.index("evaluating") < names.index("training"), names
    # the sources switched off for the job: no loss from its backward calls nor its prints, steps as before
    job = srv.wait_job(off, timeout=180)
    assert (job["state"], job["step"]) == ("completed", 12) and not series(c, off, "loss"), job
    r = c.post("/api/jobs/command", json={"command": ["python", "x.py"], "capture": {"stdout": False}})
    assert r.status_code == 422 and "capture" in r.text and "unknown source stdout" in r.text, r.text


def test_an_lstm_with_a_hand_written_update_counts_backward_steps_and_its_saved_model_loads_anywhere(srv, c, tmp_path):
    jid = submit(c, tmp_path, [LSTM, "--batches", 30, "--save", tmp_path / "model.pt"])
    job = srv.wait_job(jid, timeout=180)
    lines = [d["line"] for d in events(c, jid, "log")]
    # the script's own last line: torch.load(weights_only=True) with its safe globals took the file
    assert (job["state"], job["step"]) == ("completed", 30) and "loaded RNNModel" in lines, (job, lines[-5:])
    assert_same_loss(c, jid, r"\|\s+(\d+)/\s*\d+ batches .*\| loss\s+([\d.]+)", 0, 2)
    assert series(c, jid, "tokens_per_s")
    # the file names only torch and the script's own class, and loads where tokenpulse cannot be imported
    code = ("import sys; sys.modules['tokenpulse'] = None\n"
            "import torch\n"
            "class RNNModel(torch.nn.Module): pass\n"
            f"print(sorted(torch.serialization.get_unsafe_globals_in_checkpoint({str(tmp_path / 'model.pt')!r})))\n"
            "nn = torch.nn\n"
            "with torch.serialization.safe_globals([RNNModel, nn.Embedding, nn.LSTM, nn.Linear]):\n"
            f"    m = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=True)\n"
            "print(sorted(m.state_dict()), m._forward_pre_hooks, m._forward_hooks)\n")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr
    assert "tokenpulse" not in out.stdout and "__main__.RNNModel" in out.stdout, out.stdout
    assert "OrderedDict() OrderedDict()" in out.stdout, out.stdout


def test_a_lightning_module_counts_closure_steps_and_iterations_of_two_optimizers(srv, c, tmp_path):
    one = submit(c, tmp_path, [LIGHTNING, "--max_steps", 30])
    two = submit(c, tmp_path, [LIGHTNING, "--max_steps", 30, "--optimizers", 2])
    job = srv.wait_job(one, timeout=240)
    assert (job["state"], job["step"]) == ("completed", 30), job
    assert_same_loss(c, one, r"^step (\d+): loss ([\d.]+)", 1, 4)
    assert series(c, one, "tokens_per_s")
    names = phases(c, one)  # Lightning's sanity check validates before the first step
    assert "evaluating" in names and names.index("evaluating") < names.index("training"), names
    job = srv.wait_job(two, timeout=240)
    # Lightning's max_steps counts each optimizer's step: 15 iterations of two optimizers
    assert (job["state"], job["step"]) == ("completed", 15), job
    assert_same_loss(c, two, r"^step (\d+): loss ([\d.]+)", 1, 4)


# ---- in a process under the hook, no server ---------------------------------------------------------

def under_hook(code: str, tmp_path: Path, instrument: bool = True) -> tuple[str, list[dict]]:
    """Run code as a command job's Python process would run (the hook on PYTHONPATH, an event pipe):
    its output (stdout, then stderr) and its events."""
    r, w = os.pipe()
    env = {**os.environ, "TOKENPULSE_EVENT_FD": str(w), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([hook_dir(), str(ROOT)]), "TOKENPULSE_INSTRUMENT": "1" if instrument else "0"}
    p = subprocess.Popen([PY, "-c", code], env=env, pass_fds=(w,), cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    os.close(w)
    with os.fdopen(r) as f:
        evs = [json.loads(line) for line in f]
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, out + err
    return out + err, evs


SAVE_UNDER_HOOK = """
import copy, io, pickletools, torch, torch.nn as nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(20, 8), nn.Linear(8, 20)
    def forward(self, ids, targets):
        return nn.functional.cross_entropy(self.out(self.emb(ids)).view(-1, 20), targets.view(-1))

class Wrapper(nn.Module):  # a wrapper that trains through its inner module (as DDP does)
    def __init__(self, module):
        super().__init__()
        self.module = module
    def forward(self, *a):
        return self.module(*a)

torch.manual_seed(0)
net = Net()
fresh = Net()
model = Wrapper(net)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    ids = torch.randint(0, 20, (2, 6))
    model(ids, ids).backward()
    opt.step(); opt.zero_grad()
with torch.no_grad():
    net(ids, ids)  # the inner model evaluated directly
for m, f in ((net, fresh), (model, Wrapper(fresh))):
    assert vars(m).keys() == vars(f).keys(), set(vars(m)) ^ set(vars(f))
    assert repr(m) == repr(f) and list(m.state_dict()) == list(f.state_dict())
    for sub in m.modules():
        assert not (sub._forward_pre_hooks or sub._forward_hooks), sub
    copy.deepcopy(m)
    buf = io.BytesIO(); torch.save(m, buf)
    assert b"tokenpulse" not in buf.getvalue()
    buf.seek(0)
    with torch.serialization.safe_globals([Net, Wrapper, nn.Embedding, nn.Linear]):
        back = torch.load(buf, weights_only=True)
    assert repr(back) == repr(f)
print("saved and loaded", flush=True)
"""


def test_a_model_saved_copied_and_printed_under_the_hook_is_as_without_it(tmp_path):
    out, evs = under_hook(SAVE_UNDER_HOOK, tmp_path)
    assert "saved and loaded" in out
    steps = [e["data"]["step"] for e in evs if e["kind"] == "metrics"]
    assert steps and max(steps) == 5, evs  # it was watched all along: its steps and tokens were counted
    assert any("tokens_per_s" in e["data"]["values"] for e in evs if e["kind"] == "metrics"), evs


COUNT_SYNCS = """
import time, torch
n = {"syncs": 0}
def counting(name):
    orig = getattr(torch.Tensor, name)
    def f(self, *a, **k):
        n["syncs"] += 1
        return orig(self, *a, **k)
    setattr(torch.Tensor, name, f)
for name in ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__"):
    counting(name)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Flatten(), torch.nn.Linear(16 * 8, 50))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
ids, mask = torch.randint(0, 50, (4, 8)), torch.ones(4, 8, dtype=torch.long)
t0 = time.perf_counter()
for step in range(STEPS):
    for micro in range(2):
        loss = torch.nn.functional.cross_entropy(model(ids), ids[:, 0]) / 2
        loss.backward()
    opt.step(); opt.zero_grad()
print(n["syncs"], time.perf_counter() - t0, flush=True)
"""


def test_loss_and_token_capture_add_no_device_synchronisation_per_step(tmp_path):
    steps = 100  # a read a step would be 100 more, ten times the bound below; the hook adds one or two
    code = COUNT_SYNCS.replace("STEPS", str(steps))
    base = int(under_hook(code, tmp_path, instrument=False)[0].split()[0])
    out, evs = under_hook(code, tmp_path)
    syncs, took = int(out.split()[0]), float(out.split()[1])
    assert any(e["data"].get("sources") == {"loss": "backward"} for e in evs if e["kind"] == "metrics"), evs
    # a read a report (at most once a second) and one per step-anatomy window, never one a step
    assert syncs - base <= 2 * (took + 2), (syncs, base, took)
    assert syncs - base < steps / 10, (syncs, base)


COMPILED = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(30, 16), nn.Linear(16, 30)
    def forward(self, x, y):
        return F.cross_entropy(self.head(self.emb(x)).view(-1, 30), y.view(-1))
model = torch.compile(LM(), backend="eager")
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for i in range(1, 21):
    x = torch.randint(0, 30, (4, 8))
    loss = model(x, x)
    loss.backward()
    opt.step(); opt.zero_grad()
    if i % 5 == 0:
        print(f"step {i}: loss {loss.item():.4f}", flush=True)
"""


def test_a_compiled_model_counts_its_steps_loss_and_tokens_and_prints_nothing_more(tmp_path):
    out, evs = under_hook(COMPILED, tmp_path)
    metrics = [e["data"] for e in evs if e["kind"] == "metrics"]
    assert max(m["step"] for m in metrics) == 20 and any("tokens_per_s" in m["values"] for m in metrics), metrics
    ours = {m["step"]: m["values"]["loss"] for m in metrics if "loss" in m["values"]}
    says = {int(a): float(b) for a, b in re.findall(r"step (\d+): loss ([\d.]+)", out)}
    assert len(says) == 4 and all(abs(ours[k] - v) <= 0.5e-4 + 1e-6 for k, v in says.items()), (ours, says)
    assert "Warning" not in out, out  # torch.compile's warning about global forward hooks is not the script's


def test_a_metric_comes_from_the_best_source_that_gave_it():
    from tokenpulse.instrument.sources import Claims, off_env_value
    claims = Claims()
    assert claims.allow("loss", "printed") and claims.allow("loss", "backward")  # a better one takes over
    assert claims.allow("train/loss", "logger") and not claims.allow("loss", "backward")  # one training loss
    assert not claims.allow("loss", "printed") and claims.allow("loss", "api")
    assert claims.allow("val_loss", "printed") and claims.source_of("val_loss") == "printed"  # not the training loss
    assert claims.names() == ["loss", "val_loss"] and claims.source_of("train_loss") == "api"
    assert off_env_value({"loggers": False, "backward": True, "printed": False}) == "logger,printed"
