"""From verdict to a faster run, on real processes (one server and agent for the module; the builtin
tiny model on CPU): a verdict carries its fix as a change (alerts.data["fixes"]); applying it saves a
checkpoint, stops the attempt and relaunches the job with the change at once; the new attempt is
compared with the old (GET /api/jobs/{id}/changes); revert; the CLI; the browser.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, command_agent_server, wait_for
from test_instrument import tiny_model  # noqa: F401  (the module-scoped model fixture)

# steps slowed by a sleep (a fault), so a step's time is the sleep, whatever its tokens: what a fix
# that puts more real tokens in each step makes faster
SPEC = dict(max_steps=400, batch_size=2, grad_accum=1, precision="fp32", device="cpu", seed=3, log_every=1,
            checkpoint_every=5, torch_compile="off")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    yield from command_agent_server(tmp_path_factory, "fixes")


@pytest.fixture(scope="module")
def c(srv):
    with srv.client() as client:
        yield client


def job(c, jid: int) -> dict:
    r = c.get(f"/api/jobs/{jid}")
    r.raise_for_status()
    return r.json()


def alerts(c, jid: int) -> list[dict]:
    return c.get("/api/alerts", params={"job_id": jid}).json()


def with_fix(c, jid: int, kind: str):
    for a in alerts(c, jid):
        if a["state"] != "cleared" and a.get("data") and any(f["kind"] == kind for f in a["data"].get("fixes", [])):
            return a
    return None


def changes(c, jid: int) -> list[dict]:
    r = c.get(f"/api/jobs/{jid}/changes")
    r.raise_for_status()
    return r.json()


def stored_steps(srv, jid: int, metric: str = "loss") -> list[int]:
    """The metric's steps as the job's current attempt ran it (each attempt keeps its own points: a
    fresh start's alone, a resume's after the steps it resumed from), as the API serves them."""
    with srv.client() as c:
        r = c.get(f"/api/jobs/{jid}/metrics", params={"keys": metric, "max_points": 1_000_000})
    return r.json()["series"].get(metric, {}).get("step", [])


def submit(c, srv, name: str, sleep_s: float = 0.15, **spec) -> int:
    srv.plan_fault(name, step_sleep_s=sleep_s)
    r = c.post("/api/jobs", json={**SPEC, "name": name, **spec})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def running_at(c, jid: int, step: int, timeout: float = 180) -> dict:
    return wait_for(lambda: (j := job(c, jid))["state"] == "running" and (j["step"] or 0) >= step and j,
                    timeout, f"job {jid} running past step {step}", show=lambda: job(c, jid))


def verdict(c, jid: int, timeout: float = 180) -> dict:
    def done():
        ch = [x for x in changes(c, jid) if x["state"] == "applied"]
        return ch and ch[-1]["comparison"] and ch[-1]["comparison"]["verdict"] and ch[-1]
    return wait_for(done, timeout, f"job {jid}'s before/after verdict", show=lambda: changes(c, jid))


# ---- padding -> packing and the data's length: a fresh start ------------------------------------

def test_padding_fix_relaunches_packed_and_is_verified_faster(c, srv):
    jid = submit(c, srv, "padded", padding="max_length", max_seq_length=256)
    a = wait_for(lambda: with_fix(c, jid, "padding"), 120, "the padding verdict with its fix")
    fix = a["data"]["fixes"][0]
    assert fix["changes"]["padding"] == ["max_length", "auto"]
    old, new = fix["changes"]["max_seq_length"]
    assert old == 256 and new < 256, fix
    assert fix["resume"] == "fresh" and "data position" in fix["why_fresh"]
    assert "x real tokens/s" in fix["effect"]
    running_at(c, jid, 8)
    t0 = time.time()
    r = c.post(f"/api/jobs/{jid}/fix", json={"alert_id": a["id"]})
    assert r.status_code == 200, r.text
    assert r.json()["change"]["state"] == "pending" and r.json()["job"]["requested_action"] == "pause"
    # a second fix while this one waits for its checkpoint: refused
    assert c.post(f"/api/jobs/{jid}/fix", json={"alert_id": a["id"]}).status_code == 409
    j = wait_for(lambda: (j := job(c, jid))["attempt"] == 2 and j["state"] == "running" and (j["step"] or 0) >= 1 and j,
                 120, "the relaunched attempt's first step", show=lambda: job(c, jid))
    started = j["attempts"][1]["started_at"]
    first = wait_for(lambda: srv.query("SELECT min(m.t) FROM metrics m JOIN metric_keys k ON k.id = m.key_id "
                                       "WHERE m.job_id = ? AND k.name = 'loss' AND m.t >= ?", (jid, started))[0][0],
                     60, "the new attempt's first step")
    relaunch_s = first - t0  # from "apply" to the relaunched attempt's first step (same machine's clock)
    assert relaunch_s < 30, relaunch_s
    spec = j["spec"]
    assert spec["padding"] == "auto" and spec["max_seq_length"] == new
    assert j["attempts"][0]["outcome"] == "changed", j["attempts"]
    assert j["attempts"][1]["resumed_from"] is None  # fresh: the layout changed
    v = verdict(c, jid)
    cmp = v["comparison"]
    assert v["kind"] == "padding" and v["resume"] == "fresh" and v["resume_step"] == 0
    assert cmp["before"]["tokens_per_s"] and cmp["after"]["tokens_per_s"]
    assert cmp["speedup"] > 1.5 and cmp["verdict"].startswith("verified: "), cmp
    assert "loss_equal_steps" in cmp and cmp["before"]["step_time_s"] and cmp["after"]["step_time_s"]
    steps = stored_steps(srv, jid)
    assert steps == sorted(set(steps))  # every step stored once
    print(f"FIX padding: apply -> claimed {started - t0:.1f} s, -> first step {relaunch_s:.1f} s; {cmp['verdict']}")
    c.post(f"/api/jobs/{jid}/cancel")


# ---- a crawling step -> a smaller micro-batch, more accumulation: fresh; no better -> revert ------

def test_micro_batch_fix_then_revert(c, srv):
    # every optimizer step sleeps 0.5 s whatever its micro-batches: the smaller micro-batch's pace is
    # about the old one, and the comparison says so with its number
    jid = submit(c, srv, "crawling", sleep_s=0.5, batch_size=4, grad_accum=1, max_seq_length=64, padding="dynamic",
                 stall={"slow_step_s": 0.1, "alert_open_s": 1, "floor_s": 30, "first_step_s": 60})
    a = wait_for(lambda: with_fix(c, jid, "micro_batch"), 120, "the slow verdict's micro-batch fix",
                 show=lambda: alerts(c, jid))
    fix = next(f for f in a["data"]["fixes"] if f["kind"] == "micro_batch")
    assert fix["changes"] == {"batch_size": [4, 1], "grad_accum": [1, 4]}, fix
    assert fix["resume"] == "fresh" and "same effective batch" in fix["effect"]
    running_at(c, jid, 10)
    r = c.post(f"/api/jobs/{jid}/fix", json={"kind": "micro_batch"})
    assert r.status_code == 200, r.text
    v = verdict(c, jid)
    j = job(c, jid)
    assert j["spec"]["batch_size"] == 1 and j["spec"]["grad_accum"] == 4
    cmp = v["comparison"]
    # the step is mostly its sleep: the smaller micro-batch's pace is near the old one, whichever side
    if cmp["speedup"] >= 1.1:
        assert cmp["verdict"].startswith("verified: "), cmp
    else:
        assert cmp["verdict"].startswith("no better: ") and cmp["verdict"].endswith("revert?"), cmp
    assert 0.6 < cmp["speedup"] < 1.6, cmp
    # revert: back to 4 x 1, relaunched (fresh: the checkpoint holds the 1 x 4 layout)
    r = c.post(f"/api/jobs/{jid}/fix", json={"revert": True})
    assert r.status_code == 200, r.text
    ch = r.json()["change"]
    assert ch["kind"] == "revert" and ch["changes"] == {"batch_size": [1, 4], "grad_accum": [4, 1]}
    wait_for(lambda: (j := job(c, jid))["attempt"] == 3 and j["state"] == "running" and j, 120,
             "the reverted attempt running", show=lambda: job(c, jid))
    j = job(c, jid)
    assert j["spec"]["batch_size"] == 4 and j["spec"]["grad_accum"] == 1
    hist = changes(c, jid)
    assert [x["kind"] for x in hist] == ["micro_batch", "revert"] and hist[1]["reverts"] == hist[0]["id"]
    # kept in the row when the revert was asked (the fresh revert overwrites the steps it measured)
    assert hist[0]["comparison"]["verdict"].startswith(("verified: ", "no better: "))
    assert all(x["by"] is not None and x["created_at"] for x in hist)
    # nothing left to revert
    assert c.post(f"/api/jobs/{jid}/fix", json={"revert": True}).status_code == 409
    c.post(f"/api/jobs/{jid}/cancel")
    srv.wait_job(jid, ("cancelled",))
    # a finished job takes no fix
    r = c.post(f"/api/jobs/{jid}/fix", json={"kind": "micro_batch"})
    assert r.status_code in (409, 422), r.text


# ---- periodic evaluations -> evaluate less often: resumed from the pause's checkpoint ------------

def test_eval_fix_resumes_from_checkpoint_every_step_once(c, srv):
    jid = submit(c, srv, "evaluating", sleep_s=0.1, max_seq_length=64, padding="dynamic", checkpoint_every=None,
                 eval_every=4, eval_fraction=0.4, eval_max_examples=100000,
                 stall={"slow_periodic_frac": 0.1, "alert_open_s": 1, "floor_s": 60, "first_step_s": 60})
    a = wait_for(lambda: with_fix(c, jid, "eval"), 180, "the periodic-stalls verdict's eval fix",
                 show=lambda: alerts(c, jid))
    fix = next(f for f in a["data"]["fixes"] if f["kind"] == "eval")
    assert fix["changes"] == {"eval_every": [4, 16]} and fix["resume"] == "checkpoint", fix
    cost = next(x for x in a["data"]["costs"] if x["cause"] == "periodic stalls")
    assert 0 < cost["frac"] < 1 and "of each step" in cost["text"]
    assert "periodic stalls cost" in a["message"]
    r = c.get("/api/costs").json()  # the jobs page's hours being lost, by cause
    assert any(x["job_id"] == jid and x["cause"] == "periodic stalls" for x in r["jobs"]), r
    assert r["by_cause"].get("periodic stalls", 0) > 0 and r["total_hours"] > 0
    r = c.post(f"/api/jobs/{jid}/fix", json={"alert_id": a["id"], "n": 1 + a["data"]["fixes"].index(fix)})
    assert r.status_code == 200, r.text
    v = verdict(c, jid)
    j = job(c, jid)
    assert j["spec"]["eval_every"] == 16
    ck = j["attempts"][1]["resumed_from"]
    assert ck and v["resume"] == "checkpoint" and v["resume_step"] > 0, (v, j["attempts"])
    steps = stored_steps(srv, jid)
    assert steps == list(range(1, steps[-1] + 1)), steps  # every step once, the new attempt after the old
    assert v["comparison"]["after"]["steps"][0] > v["resume_step"]
    c.post(f"/api/jobs/{jid}/cancel")


# ---- REST: the body checked, the refusals named ------------------------------------------------

def test_fix_requests_are_checked(c, srv):
    jid = submit(c, srv, "checked", padding="max_length", max_seq_length=128)
    a = wait_for(lambda: with_fix(c, jid, "padding"), 120, "the padding verdict")

    def field(r):
        assert r.status_code == 422, r.text
        return r.json()["detail"]["field"]
    assert field(c.post(f"/api/jobs/{jid}/fix", json={"alert_id": a["id"], "n": 5})) == "n"
    assert field(c.post(f"/api/jobs/{jid}/fix", json={"alert_id": 999999})) == "alert_id"
    assert field(c.post(f"/api/jobs/{jid}/fix", json={"kind": "precision"})) == "kind"
    assert field(c.post(f"/api/jobs/{jid}/fix", json={"n": 0})) == "n"
    assert field(c.post(f"/api/jobs/{jid}/fix", json={"bogus": 1})) == "bogus"
    assert c.post("/api/jobs/999999/fix", json={}).status_code == 404
    # another user's job: 403 naming the owner
    tok = c.post("/api/tokens", json={"name": "someone", "role": "user"}).json()["token"]
    with srv.client(tok) as other:
        r = other.post(f"/api/jobs/{jid}/fix", json={"alert_id": a["id"]})
        assert r.status_code == 403, r.text
    c.post(f"/api/jobs/{jid}/cancel")
    srv.wait_job(jid, ("cancelled",))
    r = c.post(f"/api/jobs/{jid}/fix", json={"alert_id": a["id"]})
    assert r.status_code == 409 and "cancelled" in r.json()["detail"], r.text


# ---- the CLI ------------------------------------------------------------------------------------

def cli(srv, *args: str) -> subprocess.CompletedProcess:
    env = {**srv.env, "TOKENPULSE_URL": srv.url, "TOKENPULSE_TOKEN": srv.token, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "tokenpulse.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_fix_list_and_revert(c, srv):
    jid = submit(c, srv, "by-cli", padding="max_length", max_seq_length=128)
    wait_for(lambda: with_fix(c, jid, "padding"), 120, "the padding verdict")
    running_at(c, jid, 6)
    r = cli(srv, "fix", str(jid), "--list")
    assert r.returncode == 0 and "1. [padding] pack examples" in r.stdout, r.stdout + r.stderr
    r = cli(srv, "fix", str(jid), "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pausing at the next step" in r.stdout and "relaunch from step 0" in r.stdout, r.stdout
    wait_for(lambda: (j := job(c, jid))["attempt"] == 2 and j["state"] == "running" and j, 120, "relaunched")
    verdict(c, jid)
    r = cli(srv, "fix", str(jid), "--list")
    assert "tokens/s" in r.stdout and ("verified: " in r.stdout or "no better: " in r.stdout), r.stdout
    r = cli(srv, "fix", str(jid), "--revert")
    assert r.returncode == 0 and "revert" in r.stdout, r.stdout + r.stderr
    wait_for(lambda: job(c, jid)["spec"]["padding"] == "max_length", 120, "reverted spec")
    r = cli(srv, "fix", "999999")
    assert r.returncode != 0
    c.post(f"/api/jobs/{jid}/cancel")


# ---- the builders: verdicts whose conditions need a GPU or a Trainer script ---------------------

def test_padding_judged_by_the_training_process_is_not_a_second_verdict():
    """Issue 33 #3: padding=max_length raises the training process's own padding alert (its fix, the
    data's recommended length); the slow alert then names neither the padding nor a second fix."""
    from tokenpulse.diagnosis.stall import StallConfig
    from worker.agent import fixes
    from worker.agent.slow import SlowDetector

    det = SlowDetector(StallConfig(slow_min_samples=1))
    det.observe("info", {"device": "cpu", "padding": "max_length", "max_seq_length": 512,
                         "recommended_max_seq_length": 224}, 0.0)
    det.observe("alert", {"kind": "padding", "severity": "warning", "message": "padding every example ...",
                          "data": {"fixes": [{"kind": "padding", "changes": {"max_seq_length": [512, 240]}}]}}, 0.5)
    for i in range(1, 6):
        det.observe("metrics", {"step": i, "values": {"step_time_s": 1.0, "tokens_per_s": 100.0,
                                                      "padding_frac": 0.9, "eta_s": 3600.0}}, float(i))
    reasons = det.reasons()
    assert "padding" not in {k for k, _ in reasons}, reasons
    assert not [f for f in fixes.for_slow(reasons, det, {"eval_every": None})["fixes"] if f["kind"] == "padding"]


def test_fix_builders_precision_device_and_command_flags():
    from tokenpulse.diagnosis.stall import StallConfig
    from worker.agent import fixes
    from worker.agent.advice import Advisor
    from worker.agent.slow import SlowDetector

    det = SlowDetector(StallConfig(slow_min_samples=1), gpu="H100", gpu_bf16=True)
    det.observe("info", {"device": "cuda:0", "precision": "fp32", "padding": "max_length", "max_seq_length": 1024,
                         "batch_size": 32, "grad_accum": 1, "recommended_max_seq_length": 96}, 0.0)
    for i in range(1, 6):
        det.observe("metrics", {"step": i, "values": {"step_time_s": 1.0, "tokens_per_s": 100.0,
                                                      "padding_frac": 0.9, "eta_s": 36000.0}}, float(i))
    reasons = det.reasons()
    keys = {k for k, _ in reasons}
    assert {"padding", "precision"} <= keys, reasons
    data = fixes.for_slow(reasons, det, {"eval_every": None})
    by = {f["kind"]: f for f in data["fixes"]}
    assert by["precision"]["changes"] == {"precision": ["fp32", "bf16"]} and by["precision"]["resume"] == "checkpoint"
    assert by["padding"]["changes"] == {"padding": ["max_length", "auto"], "max_seq_length": [1024, 96]}
    assert by["padding"]["ratio"] == 10.0 and by["padding"]["resume"] == "fresh"
    assert "ETA 10.0 h -> about 1.0 h" in by["padding"]["effect"]
    cost = data["costs"][0]
    assert cost["cause"] == "padding" and "90% of each step = 9.0 h of the remaining ETA" in cost["text"]
    mb = fixes.micro_batch_fix({"batch_size": 32, "grad_accum": 2}, 200.0)
    assert mb["changes"] == {"batch_size": [32, 8], "grad_accum": [2, 8]} and mb["resume"] == "fresh"
    assert fixes.device_fix("H100")["changes"] == {"device": ["cpu", "auto"]}
    # a command job: only where its command line already passes TrainingArguments as flags
    adv = Advisor(StallConfig(), gpu="H100", gpu_bf16=True)
    adv.script = {"args": {"dataloader_num_workers": 0, "cores": 8, "per_device_train_batch_size": 16,
                           "bf16": False, "device": "cuda:0", "dtype": "float32"}}
    adv.data_shares = [0.5]
    argv = ["python", "train.py", "--per_device_train_batch_size", "16", "--bf16=False"]
    w = fixes.for_advice("dataloader", adv, argv)
    assert w["argv"][1] == argv + ["--dataloader_num_workers", "4"] and w["resume"] == "checkpoint"
    assert "50% of each step waits for data" in w["effect"]
    p = fixes.for_advice("precision", adv, argv)
    assert p["argv"][1][-1] == "--bf16=True"
    b = fixes.for_advice("batch", adv, argv)
    assert b["argv"][1][3] == "4" and b["argv"][1][-2:] == ["--gradient_accumulation_steps", "4"]
    assert b["resume"] == "fresh"
    assert fixes.for_advice("dataloader", adv, ["python", "train.py"]) is None  # no saying how it takes it


# ---- the browser: apply from the alert, the before/after panel ------------------------------------

def test_browser_apply_fix_and_before_after_panel(c, srv):
    from test_ui import CHROMEDRIVER, CHROMIUM, console_errors, login, make_driver, shot, text, until
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("needs Debian's chromium and chromedriver")
    from selenium.webdriver.common.by import By
    jid = submit(c, srv, "in-browser", padding="max_length", max_seq_length=256)
    wait_for(lambda: with_fix(c, jid, "padding"), 120, "the padding verdict")
    running_at(c, jid, 6)
    d = make_driver()
    try:
        login(d, srv)
        # the jobs page: what the open verdicts cost now, by cause (the padding share x the job's ETA)
        until(d, 30, lambda d: "padding" in text(d, "#costs") and "Being lost now" in text(d, "#costs"),
              "the hours being lost, by cause")
        d.set_window_size(1280, 400)
        shot(d, "fix-costs")
        d.get(f"{srv.url}/jobs/{jid}")
        until(d, 30, lambda d: d.find_elements(By.CSS_SELECTOR, "#alerts .apply-fix:not([hidden])"),
              "the Apply fix button on the padding alert")
        assert "pack examples into rows" in text(d, "#alerts") and "restarts from step 0" in text(d, "#alerts")
        d.set_window_size(1280, 560)
        shot(d, "fix-alert")  # docs/screenshots/fix-alert.png
        d.find_element(By.CSS_SELECTOR, "#alerts .apply-fix").click()
        # it restarts from step 0: asked first, saying how many steps would be run again (issue 33 #4)
        until(d, 10, lambda d: "Restart from step 0?" in text(d, "#alerts .fix-confirm"), "the confirmation")
        d.find_element(By.CSS_SELECTOR, "#alerts .fix-confirm-yes").click()
        until(d, 30, lambda d: "#" in text(d, "#changes-list"), "the change listed")
        until(d, 240, lambda d: "verified: " in text(d, "#changes-list") or "no better: " in text(d, "#changes-list"),
              "the before/after verdict")
        panel = text(d, "#changes")
        for row in ("Real tokens/s", "Step time", "Memory", "Loss at equal steps", "ETA", "Before (attempt 1)",
                    "After (attempt 2"):
            assert row in panel, panel
        assert d.find_elements(By.CSS_SELECTOR, "#changes .revert-fix")
        d.set_window_size(1280, 600)
        d.execute_script("document.getElementById('changes').scrollIntoView(); window.scrollBy(0, -110)")
        shot(d, "fix-before-after")  # docs/screenshots/fix-before-after.png
        errors = console_errors(d)
        assert not errors, errors
    finally:
        d.quit()
    c.post(f"/api/jobs/{jid}/cancel")


# ---- a command's own alert cannot plant a fix: fixes are the agent's word -------------------------

def test_a_commands_own_alert_carries_no_fix(c, srv):
    script = ("import json, os, time\n"
              "fd = int(os.environ['TOKENPULSE_EVENT_FD'])\n"
              "fix = {'kind': 'workers', 'title': 'evil', 'changes': {'--x': [0, 1]}, 'argv': [[], ['false']]}\n"
              "ev = {'kind': 'alert', 't': time.time(), 'data': {'kind': 'mine', 'message': 'planted',\n"
              "      'data': {'fixes': [fix], 'costs': [{'cause': 'x', 'frac': 0.9}]}}}\n"
              "os.write(fd, (json.dumps(ev) + '\\n').encode())\n"
              "time.sleep(1)\n")
    r = c.post("/api/jobs/command", json={"command": [sys.executable, "-c", script], "name": "planter"})
    assert r.status_code == 201, r.text
    jid = r.json()["id"]
    srv.wait_job(jid, ("completed", "failed"))
    a = wait_for(lambda: [x for x in alerts(c, jid) if x["kind"] == "mine"], 30, "the script's alert")[0]
    assert a["message"] == "planted" and a["data"] is None, a


# ---- the precision fix resumes from the checkpoint: the training process takes the spec's bf16 ----

def test_precision_change_resumes_from_a_checkpoint(tmp_path):
    # the verdict needs a GPU with bf16 (slow.py), the builder is tested above; what makes its
    # resume: "checkpoint" true is the training process taking the changed precision over the
    # checkpoint's (autocast keeps weights and optimizer state fp32)
    base = {"max_steps": 4, "batch_size": 2, "grad_accum": 1, "max_seq_length": 64, "precision": "fp32",
            "device": "cpu", "checkpoint_every": 2, "torch_compile": "off"}

    def train(spec: dict, out: str, *extra: str) -> str:
        (tmp_path / f"{out}.json").write_text(json.dumps(spec))
        r = subprocess.run([sys.executable, "-m", "worker.training.train", "--spec", str(tmp_path / f"{out}.json"),
                            "--out", str(tmp_path / out), "--cache-dir", str(tmp_path / "cache"), *extra],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r.stdout
    train(base, "a")
    out = train({**base, "precision": "bf16"}, "b", "--resume", str(tmp_path / "a" / "checkpoints" / "step-0000002"))
    assert "chose precision=bf16 (changed from fp32" in out, out[-3000:]
    assert "training from step 2 of 4" in out and "step 3/4" in out


# ---- a command job: its Trainer arguments on its command line, changed ---------------------------

def test_command_job_workers_fix_changes_its_command_line(c, srv, tiny_model, tmp_path):  # noqa: F811
    command = [sys.executable, str(ROOT / "tests" / "scripts" / "hf_args_trainer.py"), "--model", str(tiny_model),
               "--data", str(ROOT / "tokenpulse" / "demo" / "demo.jsonl"), "--collate_sleep", "0.3",
               "--output_dir", str(tmp_path / "out"), "--max_steps", "400", "--per_device_train_batch_size", "4",
               "--logging_steps", "1", "--report_to", "none", "--use_cpu", "True", "--save_strategy", "no",
               "--dataloader_num_workers", "0"]
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets"), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(ROOT)}
    r = c.post("/api/jobs/command", json={"command": command, "cwd": str(tmp_path), "env": env, "name": "slow-input"})
    assert r.status_code == 201, r.text
    jid = r.json()["id"]
    a = wait_for(lambda: with_fix(c, jid, "workers"), 240, "the dataloader verdict's fix",
                 show=lambda: (job(c, jid)["state"], alerts(c, jid)))
    fix = a["data"]["fixes"][0]
    old, new = fix["argv"]
    assert old == command and new[-2:] == ["--dataloader_num_workers", new[-1]] and int(new[-1]) >= 2, fix
    assert fix["resume"] == "checkpoint" and "waits for data" in fix["effect"]
    r = c.post(f"/api/jobs/{jid}/fix", json={"kind": "dataloader"})
    assert r.status_code == 200, r.text
    v = verdict(c, jid, timeout=240)
    j = job(c, jid)
    assert j["spec"]["command"] == new and j["attempts"][1]["resumed_from"], j["attempts"]
    assert v["resume_step"] > 0 and v["comparison"]["speedup"] > 1.3, v["comparison"]
    steps = stored_steps(srv, jid)
    assert steps == sorted(set(steps))
    print(f"FIX workers: {v['comparison']['verdict']}")
    c.post(f"/api/jobs/{jid}/cancel")
