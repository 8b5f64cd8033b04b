"""Real training programs run unchanged (issue 35, items 2 and 5): loss and metrics from the logging
calls they already make (wandb offline and disabled, TensorBoard, MLflow, trackio, Lightning's
self.log, a Trainer's report_to) and from their printed lines as the last resort, each stored under
its own name at its own step, equal to the script's own numbers, with where it came from on the job.

The corpus (bench/realworld/corpus.py, shared with bench/realworld.py, which also times the faults)
runs as command jobs on one server and agent for the module; the bad inputs (NaN, thousands of
names, a script that monkeypatches wandb) run on the event pipe alone, as test_instrument.py does."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from conftest import ROOT, make_server, stop_agents, wait_for
from test_instrument import PipeJob, tiny_model  # noqa: F401  (the module-scoped model fixture)
from test_ui import browser, pytestmark as needs_chromium, text, until  # noqa: F401  (browser: a fixture)
from test_ui_job import FakeRun

from worker.agent.printed_metrics import JobMetrics, parse

sys.path.insert(0, str(ROOT / "bench" / "realworld"))
from corpus import PROGRAMS, Program, matches, said_source  # noqa: E402

PY = sys.executable
STYLES = ROOT / "bench" / "realworld" / "styles_loop.py"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = make_server(tmp_path_factory.mktemp("realworld")).start()
    s.start_agent("a1", "--allow-commands", "--capacity", "2")
    yield s
    stop_agents(s)
    s.kill()


@pytest.fixture(scope="module")
def c(srv):
    with srv.client() as client:
        yield client


def submit(c, prog: Program, tmp: Path, model: Path, *args: str, env: dict | None = None) -> int:
    r = c.post("/api/jobs/command", json={"name": prog.name, "command": prog.argv(tmp, model) + list(args),
                                          "cwd": str(tmp), "max_retries": 0, "env": {**prog.env(tmp), **(env or {})}})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def series(c, jid: int, key: str) -> dict[int, float]:
    s = c.get(f"/api/jobs/{jid}/metrics", params={"keys": [key]}).json()["series"].get(key)
    return dict(zip(s["step"], s["value"])) if s else {}


def finished(srv, jid: int) -> dict:
    job = srv.wait_job(jid, timeout=300)
    assert job["state"] == "completed", job
    return job


@pytest.mark.parametrize("name", ["tensorboard loop", "wandb loop (offline)", "mlflow loop", "trackio loop",
                                  "print loop (GradScaler, accumulation)", "Lightning self.log"])
def test_a_programs_loss_is_its_own_numbers_from_its_own_logging(srv, c, tmp_path, tiny_model, name):  # noqa: F811
    prog = PROGRAMS[name]
    # the loss each program gives through its own logging, or its print: the backward source (better
    # than print, worse than a logger) is the subject of tests/test_real_loops.py
    jid = submit(c, prog, tmp_path, tiny_model, env={"TOKENPULSE_CAPTURE_OFF": "backward"})
    job = finished(srv, jid)
    own = prog.own_numbers(tmp_path)
    got = series(c, jid, prog.loss)
    assert own and matches(got, own), (got, own)  # every logged step, equal to print precision
    assert said_source(job["info"], prog.loss) == prog.source, job["info"]
    if prog.eval_loss:
        assert series(c, jid, prog.eval_loss), "the evaluation's loss, at its steps"
        assert said_source(job["info"], prog.eval_loss) == prog.source
    bad = [a for a in c.get("/api/alerts", params={"job_id": jid}).json() if a["severity"] != "info"]
    assert not bad, bad  # a healthy run: no false alert


@pytest.mark.parametrize("name", ["tensorboard loop", "wandb loop (offline)"])
def test_printed_decoys_and_a_nan_never_override_the_logger(srv, c, tmp_path, name):
    """The script logs to TensorBoard or wandb and also prints a different 'loss' and lines that only
    look like one; its logged NaN is stored at its step and said (an alert naming the metric), the
    finite neighbours intact, the run goes on."""
    prog = PROGRAMS[name]
    jid = submit(c, prog, tmp_path, Path("."), "--print-decoys", "--nan-at", "10")
    job = finished(srv, jid)
    own = prog.own_numbers(tmp_path)
    raw = c.get(f"/api/jobs/{jid}/metrics", params={"keys": ["loss"]}).json()["series"]["loss"]
    got = dict(zip(raw["step"], raw["value"]))
    finite = {s: v for s, v in got.items() if v is not None}
    assert matches(finite, {s: v for s, v in own.items() if math.isfinite(v)}), (got, own)
    assert got[10] is None and raw["nonfinite"] == {"10": "nan"}, raw  # stored as non-finite, not dropped
    assert job["info"]["metric_sources"] == {"loss": "logger", "val_loss": "logger"}, job["info"]
    assert said_source(job["info"], "loss") == prog.source, job["info"]
    assert not series(c, jid, "lossless")
    nan = [a for a in c.get("/api/alerts", params={"job_id": jid}).json() if a["kind"] == "non_finite:loss"]
    assert nan and "nan at step 10" in nan[0]["message"], nan


@pytest.mark.parametrize("mode", ["log", "backward"])
def test_a_nan_or_inf_from_tokenpulse_log_or_backward_is_stored_at_its_step(srv, c, tmp_path, mode):
    """Non-finite values from tokenpulse.log and from the loss .backward() is called on: stored at
    their steps and read back as such, the finite neighbours intact, the alert raised, the job's
    latest value saying NaN."""
    r = c.post("/api/jobs/command", json={"name": f"nonfinite {mode}", "cwd": str(tmp_path), "max_retries": 0,
                                          "command": [PY, str(ROOT / "tests" / "scripts" / "nonfinite_loop.py"), mode]})
    assert r.status_code == 201, r.text
    jid = r.json()["id"]
    job = finished(srv, jid)
    key, bad, n = ("score", {"3": "nan", "4": "-inf", "12": "nan"}, 13) if mode == "log" else ("loss", {"7": "inf"}, 12)
    raw = c.get(f"/api/jobs/{jid}/metrics", params={"keys": [key]}).json()["series"][key]
    assert raw["nonfinite"] == bad, raw
    got = dict(zip(raw["step"], raw["value"]))
    assert len(got) == n and all((v is None) == (str(st) in bad) for st, v in got.items()), got
    if mode == "log":
        assert got[2] == 2.0 and got[5] == 5.0 and job["last"]["score"] == "nan"
    else:
        assert got[6] == pytest.approx(3.8) and got[8] == pytest.approx(3.76)
    alerts = [a for a in c.get("/api/alerts", params={"job_id": jid}).json() if a["kind"] == f"non_finite:{key}"]
    assert alerts and f"{key} is {bad[min(bad, key=int)]}" in " ".join(a["message"] for a in alerts), alerts


def test_printed_loss_switched_off_for_a_job(srv, c, tmp_path):
    jid = submit(c, PROGRAMS["print loop (GradScaler, accumulation)"], tmp_path, Path("."),
                 env={"TOKENPULSE_CAPTURE_OFF": "printed,backward"})
    job = finished(srv, jid)
    assert not series(c, jid, "loss") and not said_source(job["info"], "loss")


@pytest.mark.parametrize("report_to,source", [("tensorboard", "SummaryWriter.add_scalar"), ("wandb", "wandb.log")])
def test_a_trainer_reporting_to_its_backend_is_read_under_the_backends_names(tiny_model, tmp_path, report_to,  # noqa: F811
                                                                             source):
    job = PipeJob([PY, str(ROOT / "tests" / "scripts" / "hf_trainer.py"), "--model", str(tiny_model),
                   "--data", str(ROOT / "tokenpulse" / "demo" / "demo.jsonl"), "--out", str(tmp_path / "out"),
                   "--max-steps", "4", "--examples", "64", "--report-to", report_to], tmp_path,
                  {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"})
    assert job.proc.wait(300) == 0, job.log()
    wait_for(lambda: job.metric("loss"), 10, "the Trainer's loss")
    logged = [d for d in job.of("metrics") if "train/loss" in d["values"]]
    assert logged and all(d["sources"]["train/loss"] == "logger" for d in logged), job.of("metrics")
    # the backend got the Trainer's own numbers: the same as its callback's, at the same steps
    assert {d["step"]: round(d["values"]["train/loss"], 4) for d in logged} == \
        {s: round(v, 4) for s, v in job.metric("loss")}
    assert any(d.get("metric_via", {}).get("train/loss") == source for d in job.of("info")), job.of("info")


def run_inline(tmp: Path, code: str) -> PipeJob:
    script = tmp / "script.py"
    script.write_text(code)
    job = PipeJob([PY, str(script)], tmp, {"WANDB_MODE": "disabled"})
    assert job.proc.wait(120) == 0, job.log()
    return job


def test_a_script_that_monkeypatches_wandb_and_logs_thousands_of_names(tmp_path):
    job = run_inline(tmp_path, (
        "import wandb\n"
        "wandb.init(mode='disabled')\n"
        "orig, seen = wandb.log, []\n"
        "def mine(d, *a, **k):  # the script's own wrapper\n"
        "    seen.append(d)\n"
        "    return orig(d, *a, **k)\n"
        "wandb.log = mine\n"
        "wandb.log({f'm{i}': float(i) for i in range(2500)})\n"
        "for i in range(3):\n"
        "    wandb.log({'loss': [1.0, float('inf'), 3.0][i], 'note': 'text', 'flag': True})\n"
        "print('seen', len(seen))\n"))
    assert "seen 4" in job.log()
    names = {k for d in job.of("metrics") if d.get("sources") for k in d["values"]}
    assert len(names) == 2000 and "loss" not in names  # the cap: the first 2000 names, then none new
    warnings = [d for d in job.of("log") if "more than 2000 metric names" in d["line"]]
    assert len(warnings) == 1, job.of("log")


def test_accelerator_log_add_scalars_and_mlflow_log_metric(tmp_path):
    """Accelerate's log reaches its TensorBoard tracker: read once, as accelerator.log (the tracker's
    own add_scalar inside it is not read again); add_scalars under main_tag/tag; mlflow's one metric."""
    job = run_inline(tmp_path, (
        "import os\n"
        "from accelerate import Accelerator\n"
        "from torch.utils.tensorboard import SummaryWriter\n"
        "import mlflow\n"
        "acc = Accelerator(cpu=True, log_with='tensorboard', project_dir=os.getcwd())\n"
        "acc.init_trackers('run')\n"
        "acc.log({'loss': 1.5, 'lr': 0.1}, step=3)\n"
        "SummaryWriter(os.path.join(os.getcwd(), 'tb')).add_scalars('pair', {'a': 1.0, 'b': 2.0}, 4)\n"
        "os.environ['MLFLOW_ALLOW_FILE_STORE'] = 'true'\n"
        "mlflow.set_tracking_uri('file://' + os.path.join(os.getcwd(), 'mlruns'))\n"
        "with mlflow.start_run():\n"
        "    mlflow.log_metric('acc', 0.9, step=5)\n"
        "acc.end_training()\n"))
    got = [(d["step"], d["values"]) for d in job.of("metrics") if d.get("sources")]
    assert got == [(3, {"loss": 1.5, "lr": 0.1}), (4, {"pair/a": 1.0, "pair/b": 2.0}), (5, {"acc": 0.9})], got
    via = {k: v for d in job.of("info") for k, v in d.get("metric_via", {}).items()}
    assert via == {"loss": "accelerator.log", "lr": "accelerator.log", "pair/a": "SummaryWriter.add_scalars",
                   "pair/b": "SummaryWriter.add_scalars", "acc": "mlflow.log_metric"}, via


def test_non_finite_and_printed_lines_the_agent_reads():
    assert parse("iter 10: loss 4.2031, time 33.1ms") == ({"loss": 4.2031}, 10)
    assert parse("step 7 | train_loss=2.31 | lr 3e-4") == ({"train_loss": 2.31}, 7)
    assert parse("{'loss': 2.31, 'grad_norm': 1.2}") == ({"loss": 2.31}, None)
    assert parse("  7/100 [00:01<00:09] loss: 1.5") == ({"loss": 1.5}, 7)
    assert parse("| epoch   2 |   200/ 2983 batches | lr 20.00 | loss  6.12 | ppl   455.20") == ({"loss": 6.12}, None)
    assert parse("step 3: train loss 2.1, val loss 2.3") == ({"train_loss": 2.1, "val_loss": 2.3}, 3)
    for decoy in ("lossless 3", "loss of signal 5", "no loss here 5", "closs 3", "Epoch 1/3"):
        assert parse(decoy) == ({}, None), decoy
    m = JobMetrics({})
    assert m.printed("step 1 loss nan") == [("metrics", {"step": 1, "values": {"loss": "nan"}}),
                                            ("alert", {"kind": "non_finite:loss", "severity": "critical",
                                                       "message": "loss is nan at step 1 (printed)"})]
    events = m.printed("step 2 loss 2.5")
    assert events[0] == ("metrics", {"step": 2, "values": {"loss": 2.5}}) and events[1][1]["clear"] is True
    # a better source for the name: print never overrides it (every train-loss name is one metric)
    m.observe("metrics", {"step": 3, "values": {"train/loss": 2.0}, "sources": {"train/loss": "logger"}})
    assert m.printed("step 4 loss 9.9") == []
    assert m.printed("step 4 val loss 3.0")[0][1]["values"] == {"val_loss": 3.0}
    assert m.sources_info() == {"metric_sources": {"loss": "printed", "train/loss": "logger", "val_loss": "printed"},
                                "metric_via": {}}
    assert m.observe("info", {"metric_via": {"train/loss": "wandb.log"}}) is None  # the agent's info says it
    assert m.sources_info()["metric_via"] == {"train/loss": "wandb.log"}
    # another process's worse source for a metric already given: dropped on the way
    worse = {"step": 5, "values": {"loss": 7.0, "lr": 0.1}, "sources": {"loss": "backward", "lr": "backward"}}
    assert m.observe("metrics", worse) == {"step": 5, "values": {"lr": 0.1}}
    assert JobMetrics({"TOKENPULSE_CAPTURE_OFF": "printed"}).printed("loss 2.0") == []
    # a Trainer's job: its callback gives what the Trainer prints (no second eval_loss beside eval/loss)
    hf = JobMetrics({})
    hf.observe("info", {"trainer": "Trainer", "pausable": True})
    assert hf.printed("{'eval_loss': 2.5, 'epoch': 1.0}") == []
    # printed before the Trainer's callback said the same name: the callback's from then on, and said so
    t = JobMetrics({})
    assert t.printed("{'loss': 2.31, 'grad_norm': 1.2}")[0][1]["values"] == {"loss": 2.31}
    t.observe("metrics", {"step": 1, "values": {"loss": 2.31}})
    assert t.printed("{'loss': 2.2}") == []
    assert t.sources_info() == {"metric_sources": {"loss": "api"}, "metric_via": {}}


@needs_chromium
def test_the_job_page_says_where_each_chart_came_from(server_factory, browser, tmp_path):  # noqa: F811
    run = FakeRun(server_factory, browser, tmp_path, "sources")
    run.post([("info", {"metric_sources": {"loss": "logger", "val_loss": "printed"},
                        "metric_via": {"loss": "wandb.log"}}, run.t0 + 81),
              ("metrics", {"step": 81, "values": {"loss": 2.0, "val_loss": 2.5}}, run.t0 + 81)])
    note = "return [...document.querySelectorAll('.source-note')].map((e) => e.textContent)"
    until(run.d, 20, lambda d: sorted(d.execute_script(note)) == ["from printed lines", "from wandb.log"],
          "a source note by the loss chart and by the val_loss chart")
    assert "metric sources" not in text(run.d, "#info")  # said by the charts, not again in the info list
