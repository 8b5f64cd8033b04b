"""Checkpoint when asked, and failure-aware retries (issue 21, parts 3 and 4), on real processes (one
server and one agent for the module; the builtin tiny model on CPU, fp32):

- a SIGTERM from outside (`kill -TERM <training pid>`: a scheduler's preemption, a node drain) makes
  the training process save at the next step boundary and the job come back from that checkpoint,
  every step stored once, no retry spent; the agent's own cancel (announced in the control file
  before its SIGTERM) still cancels;
- out of memory (an address-space cap on the process: tests/test_memory.py) is retried with half the
  micro-batch and twice the accumulation, and gives up naming the peak memory when the budget is spent;
- a hang the agent kills (stall.kill_after_s) is retried once, and not again when it hangs at the
  same step in the same frame (deterministic);
- a data error naming its row is not retried;
- the Attempts table's class, change and decision, over REST and in the browser."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, is_training, make_server, wait_for
from test_instrument import SCRIPTS, tiny_model  # noqa: F401  (the module-scoped model fixture)

from worker.training.controls import BOUND_ENV
from worker.training.memory import HEADROOM_ENV

SPEC = dict(batch_size=2, grad_accum=1, max_seq_length=64, precision="fp32", torch_compile="off", device="cpu", seed=3,
            log_every=1)
DONE: dict[str, int] = {}  # jobs of this module that a later test looks at again (the browser's)
BIG = {"padding": "max_length", "max_seq_length": 1024, "max_steps": 2, "precision": "fp32", "device": "cpu"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """One server and one agent for the module. The agent's training processes get the tests'
    address-space cap (700 MiB over what they have mapped when they set up their batches): a
    micro-batch of 8 rows of 1,024 tokens fails in the CPU allocator, the small jobs here fit."""
    s = make_server(tmp_path_factory.mktemp("retries")).start()
    # a requested checkpoint not reached within 5 s falls back to the newest saved one (controls.py)
    agent = s.start_agent("a1", "--allow-commands", env={HEADROOM_ENV: "700", BOUND_ENV: "5"})
    yield s
    agent.send_signal(signal.SIGTERM)
    try:
        agent.wait(30)
    except Exception:  # noqa: BLE001
        agent.kill()
    s.kill()


def job(c, jid: int) -> dict:
    r = c.get(f"/api/jobs/{jid}")
    r.raise_for_status()
    return r.json()


def why(j: dict) -> str:
    return f"job {j['id']} {j['state']}: {j.get('reason')!r}; attempts: " + "; ".join(
        f"#{a['attempt']} {a['outcome']} {a.get('failure_class')} {a.get('decision')!r} {str(a.get('reason'))[:300]!r}"
        for a in j.get("attempts", []))


def training_pid(agent_pid: int) -> int:
    def find():
        try:
            kids = psutil.Process(agent_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return None
        pids = [p.pid for p in kids if is_training(p.cmdline())]
        return pids[0] if len(pids) == 1 else None
    return wait_for(find, 60, "the training process")


def script_pid(srv):
    """The Trainer script's process (not its keeper)."""
    for p in psutil.Process(srv.agents[0].pid).children(recursive=True):
        line = " ".join(p.cmdline())
        if "hf_trainer.py" in line and "keeper" not in line:
            return p.pid
    return None


def stored_losses(srv, jid: int) -> list[int]:
    """The loss's steps as the job's current attempt ran it (a resume: after the steps it resumed
    from; each attempt keeps its own points), as the API serves them."""
    with srv.client() as c:
        r = c.get(f"/api/jobs/{jid}/metrics", params={"keys": "loss", "max_points": 1_000_000})
    return r.json()["series"].get("loss", {}).get("step", [])


def log_lines(c, jid: int) -> str:
    return c.get(f"/api/jobs/{jid}/logs.txt").text


# ---- checkpoint when asked ------------------------------------------------------------------------

def test_sigterm_from_outside_checkpoints_and_the_job_resumes_from_it(srv):
    """No retry is spent (max_retries=0): a preemption is not the job's fault."""
    spec = {**SPEC, "max_steps": 14, "max_retries": 0, "name": srv.plan_fault("preempted", step_sleep_s=0.25)}
    with srv.client() as c:
        jid = c.post("/api/jobs", json=spec).json()["id"]
        wait_for(lambda: (job(c, jid)["step"] or 0) >= 4, 120, "4 steps")
        pid = training_pid(srv.agents[0].pid)
        sent = time.time()
        os.kill(pid, signal.SIGTERM)  # a scheduler's preemption: the agent did not send it
        j = srv.wait_job(jid, states=("completed", "failed", "cancelled"), timeout=180)
        assert j["state"] == "completed", why(j)
        first, second = j["attempts"]
        assert first["outcome"] == "preempted" and first["failure_class"] == "preempted", why(j)
        assert "no retry spent" in first["decision"], first
        assert first["checkpoint_s"] is not None and first["checkpoint_s"] < 10, first
        assert first["checkpoint_s"] <= time.time() - sent
        ckpt = second["resumed_from"]
        assert ckpt and ckpt.rsplit("step-", 1)[1].lstrip("0"), second
        saved_at = int(Path(ckpt).name.removeprefix("step-"))
        assert saved_at >= 4, (saved_at, first)
        assert "preempted: SIGTERM not sent by its agent" in first["reason"], first
        text = log_lines(c, jid)
        said = f"agent: checkpoint at step {saved_at} on a SIGTERM from outside (preemption): saved"
        assert said in text, text[-3000:]
    assert stored_losses(srv, jid) == list(range(1, 15))  # every step once: no gap, no step twice
    print(f"\nMEASURED | SIGTERM from outside -> checkpoint saved: {first['checkpoint_s']:.2f} s "
          f"(step {saved_at}, steps of ~0.25 s)")


def test_sigterm_to_torchrun_from_outside_checkpoints_every_rank_and_resumes(srv):
    """torchrun forwards the SIGTERM to its ranks; each reads the control file (no "cancel" there),
    the ranks agree on the stop at one step, rank 0 saves, the job comes back from that checkpoint."""
    spec = {**SPEC, "max_steps": 16, "max_retries": 0, "nproc_per_node": 2,
            "name": srv.plan_fault("preempted gang", step_sleep_s=0.2)}
    with srv.client() as c:
        jid = c.post("/api/jobs", json=spec).json()["id"]
        wait_for(lambda: (job(c, jid)["step"] or 0) >= 3, 180, "3 steps")

        def launcher():
            for p in psutil.Process(srv.agents[0].pid).children(recursive=True):
                line = " ".join(p.cmdline())
                if "torch.distributed.run" in line and "keeper" not in line:
                    return p.pid
            return None
        os.kill(wait_for(launcher, 30, "torchrun"), signal.SIGTERM)
        j = srv.wait_job(jid, states=("completed", "failed", "cancelled"), timeout=240)
        assert j["state"] == "completed", why(j)
        first, second = j["attempts"]
        assert first["outcome"] == "preempted" and first["checkpoint_s"] is not None, why(j)
        assert second["resumed_from"] and "step-" in second["resumed_from"], second
    assert stored_losses(srv, jid) == list(range(1, 17))
    print(f"\nMEASURED | torchrun, 2 ranks: SIGTERM from outside -> checkpoint saved: {first['checkpoint_s']:.2f} s")


def test_sigterm_from_outside_checkpoints_an_instrumented_trainer_script_and_it_resumes(srv, tiny_model, tmp_path):  # noqa: F811
    """The same for an unchanged Hugging Face Trainer script run as a command job: the startup hook's
    callback saves at the next step end, the job is requeued and the script resumes from that
    checkpoint (TOKENPULSE_RESUME_FROM)."""
    command = [sys.executable, str(SCRIPTS / "hf_trainer.py"), "--model", str(tiny_model), "--data",
               str(ROOT / "tokenpulse" / "demo" / "demo.jsonl"), "--out", str(tmp_path / "out"),
               "--max-steps", "14", "--step-sleep", "0.3"]
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets"), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(ROOT)}
    with srv.client() as c:
        r = c.post("/api/jobs/command", json={"command": command, "cwd": str(tmp_path), "env": env, "max_retries": 0})
        assert r.status_code == 201, r.text
        jid = r.json()["id"]
        wait_for(lambda: (lambda j: j["info"].get("pausable") and (j["step"] or 0) >= 3)(job(c, jid)), 240,
                 "3 Trainer steps", show=lambda: job(c, jid))
        os.kill(wait_for(lambda: script_pid(srv), 30, "the script's process"), signal.SIGTERM)
        j = srv.wait_job(jid, states=("completed", "failed", "cancelled"), timeout=300)
        assert j["state"] == "completed", why(j)
        first, second = j["attempts"]
        assert first["outcome"] == "preempted" and first["failure_class"] == "preempted", why(j)
        assert first["checkpoint_s"] is not None and first["checkpoint_s"] < 10, first
        assert second["resumed_from"] and "checkpoint-" in second["resumed_from"], second
        at = int(second["resumed_from"].rsplit("-", 1)[1])
        steps = c.get(f"/api/jobs/{jid}/metrics", params={"keys": ["loss"]}).json()["series"]["loss"]["step"]
    assert sorted(steps) == list(range(1, 15)), steps  # every step once, the resumed ones after `at`
    print(f"\nMEASURED | Trainer script: SIGTERM from outside -> checkpoint-{at} saved: {first['checkpoint_s']:.2f} s")


def test_a_process_stuck_past_the_bound_says_so_and_falls_back_to_the_newest_checkpoint(srv):
    """SIGTERM from outside while the step never ends: no step boundary within the bound (5 s here),
    so the process says so and goes back to the queue; the next attempt resumes from the newest
    checkpoint saved before."""
    spec = {**SPEC, "max_steps": 10, "checkpoint_every": 2, "stall": {"kill_after_s": 0},
            "name": srv.plan_fault("stuck", hang_at_step=4)}
    with srv.client() as c:
        jid = c.post("/api/jobs", json=spec).json()["id"]
        j = wait_for(lambda: (lambda x: x if (x["step"] or 0) >= 4 and (x["checkpoint"] or "").endswith("4")
                              else None)(job(c, jid)), 120, "step 4 and its checkpoint")
        newest = j["checkpoint"]
        os.kill(training_pid(srv.agents[0].pid), signal.SIGTERM)
        j = wait_for(lambda: (lambda x: x if len(x["attempts"]) >= 2 else None)(job(c, jid)), 90, "a second attempt")
        first, second = j["attempts"][:2]
        assert first["outcome"] == "preempted", why(j)
        assert "no step boundary was reached within 5 s (stuck at step 4)" in first["reason"], first["reason"]
        assert f"resumes from the newest saved checkpoint {newest}" in first["reason"], first["reason"]
        assert first["checkpoint_s"] is None, first  # nothing was saved on request
        assert second["resumed_from"] == newest, second
        assert c.post(f"/api/jobs/{jid}/cancel").status_code == 200
        assert srv.wait_job(jid, states=("completed", "failed", "cancelled"), timeout=60)["state"] == "cancelled"


def test_a_trainer_step_that_never_ends_says_so_past_the_bound(srv, tiny_model, tmp_path):  # noqa: F811
    """A Trainer script blocked inside a step gets a SIGTERM from outside: no step end within the bound
    (the job's TOKENPULSE_CHECKPOINT_BOUND_S), so its hook says so and ends it; the job is requeued."""
    command = [sys.executable, str(SCRIPTS / "hf_trainer.py"), "--model", str(tiny_model), "--data",
               str(ROOT / "tokenpulse" / "demo" / "demo.jsonl"), "--out", str(tmp_path / "out"),
               "--max-steps", "14", "--block-at-step", "3"]
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets"), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(ROOT), BOUND_ENV: "4"}
    with srv.client() as c:
        r = c.post("/api/jobs/command", json={"command": command, "cwd": str(tmp_path), "env": env, "max_retries": 0})
        assert r.status_code == 201, r.text
        jid = r.json()["id"]
        # the script's own callback blocks at the end of step 3, before tokenpulse's callback sees it
        wait_for(lambda: (job(c, jid)["step"] or 0) >= 2, 240, "2 Trainer steps", show=lambda: job(c, jid))
        os.kill(wait_for(lambda: script_pid(srv), 30, "the script's process"), signal.SIGTERM)
        j = wait_for(lambda: (lambda x: x if x["attempts"] and x["attempts"][0]["ended_at"] else None)(job(c, jid)),
                     90, "the first attempt's end")
        first = j["attempts"][0]
        assert first["outcome"] == "preempted", why(j)
        assert "no step end was reached within 4 s (stuck after step" in first["reason"], first["reason"]
        c.post(f"/api/jobs/{jid}/cancel")
        assert srv.wait_job(jid, states=("completed", "failed", "cancelled"), timeout=90)["state"] == "cancelled"


def test_the_agents_own_sigterm_is_a_cancel(srv):
    spec = {**SPEC, "max_steps": 200, "name": srv.plan_fault("cancelled", step_sleep_s=0.2)}
    with srv.client() as c:
        jid = c.post("/api/jobs", json=spec).json()["id"]
        wait_for(lambda: (job(c, jid)["step"] or 0) >= 2, 120, "2 steps")
        assert c.post(f"/api/jobs/{jid}/cancel").status_code == 200
        j = srv.wait_job(jid, states=("completed", "failed", "cancelled", "queued"), timeout=60)
        assert j["state"] == "cancelled" and len(j["attempts"]) == 1, why(j)
        assert j["attempts"][0]["failure_class"] != "preempted", why(j)


def test_pause_checkpoint_time_is_measured(srv):
    spec = {**SPEC, "max_steps": 200, "name": srv.plan_fault("paused", step_sleep_s=0.2)}
    with srv.client() as c:
        jid = c.post("/api/jobs", json=spec).json()["id"]
        wait_for(lambda: (job(c, jid)["step"] or 0) >= 2, 120, "2 steps")
        assert c.post(f"/api/jobs/{jid}/pause").status_code == 200
        j = srv.wait_job(jid, states=("paused", "failed", "cancelled"), timeout=60)
        assert j["state"] == "paused", why(j)
        took = j["attempts"][0]["checkpoint_s"]
        assert took is not None and took < 10, j["attempts"]
        text = log_lines(c, jid)
        assert "asked for (pause or stop): saved" in text and "after this agent asked" in text, text[-2000:]
        c.post(f"/api/jobs/{jid}/cancel")
    print(f"\nMEASURED | pause -> checkpoint saved: {took:.2f} s")


# ---- failure-aware retries ------------------------------------------------------------------------

def test_out_of_memory_is_retried_smaller_and_completes(srv):
    with srv.client() as c:
        jid = c.post("/api/jobs", json={"name": "too big", "batch_size": 8, "grad_accum": 1, "max_retries": 1,
                                        **BIG}).json()["id"]
        j = srv.wait_job(jid, states=("completed", "failed", "cancelled"), timeout=400)
        assert j["state"] == "completed", why(j)
        first, second = j["attempts"]
        assert first["failure_class"] == "oom" and first["outcome"] == "retried", first
        assert first["change"] == {"batch_size": [8, 4], "grad_accum": [1, 2]}, first
        assert first["decision"].startswith("retry 1 of 1: out of memory, half the micro-batch"), first
        assert first["peak_mb"] and first["peak_mb"] > 100, first
        assert second["outcome"] == "completed" and second["decision"] is None, second
        DONE["oom"] = jid


def test_out_of_memory_gives_up_naming_the_peak_memory(srv):
    with srv.client() as c:
        jid = c.post("/api/jobs", json={"name": "too big, no retry", "batch_size": 8, "grad_accum": 1,
                                        "max_retries": 0, **BIG}).json()["id"]
        j = srv.wait_job(jid, states=("completed", "failed", "cancelled"), timeout=300)
        assert j["state"] == "failed" and len(j["attempts"]) == 1, why(j)
        (a,) = j["attempts"]
        assert a["failure_class"] == "oom" and a["peak_mb"], a
        assert a["decision"].startswith("not retried: gave up after 0 retries") and "peak memory" in a["decision"], a
        assert "peak memory" in j["reason"], j["reason"]


def test_a_hang_at_the_same_step_and_frame_is_not_retried_twice(srv):
    """Killed after stall.kill_after_s, retried once from the checkpoint before it, and named
    deterministic when the retry hangs at the same step in the same frame."""
    stall = {"floor_s": 2, "first_step_s": 6, "kill_after_s": 1}
    spec = {**SPEC, "max_steps": 8, "checkpoint_every": 2, "max_retries": 3, "stall": stall,
            "name": srv.plan_fault("hangs", hang_at_step=3)}
    with srv.client() as c:
        jid = c.post("/api/jobs", json=spec).json()["id"]
        j = srv.wait_job(jid, states=("completed", "failed", "cancelled"), timeout=240)
        assert j["state"] == "failed" and len(j["attempts"]) == 2, why(j)
        first, second = j["attempts"]
        for a in (first, second):
            assert a["failure_class"] == "hang" and a["hang_step"] == 3, why(j)
            assert "_fault_hang (faults.py:" in a["hang_frame"], a
        assert first["outcome"] == "retried" and first["decision"].startswith("retry 1 of 3: a hang"), first
        assert second["resumed_from"] and second["resumed_from"].endswith("step-0000002"), second
        assert second["outcome"] == "failed" and "deterministic hang" in second["decision"], second
        assert "attempt 1 hung at the same step 3" in j["reason"], j["reason"]
        assert "stall.kill_after_s" in log_lines(c, jid)
        DONE["hang"] = jid


def test_a_data_error_naming_its_row_is_not_retried(srv):
    spec = {**SPEC, "max_steps": 6, "max_retries": 2, "name": srv.plan_fault("bad row", bad_row_at_step=2)}
    with srv.client() as c:
        jid = c.post("/api/jobs", json=spec).json()["id"]
        j = srv.wait_job(jid, states=("completed", "failed", "cancelled"), timeout=180)
        assert j["state"] == "failed" and len(j["attempts"]) == 1, why(j)
        (a,) = j["attempts"]
        assert a["failure_class"] == "data" and a["failure"] == "data", a
        assert a["decision"].startswith("not retried: a data error naming its row"), a
        assert "data error naming row 1002" in a["reason"], a["reason"]


def test_attempts_table_shows_class_change_and_decision(srv):
    """The job page's Attempts table, in headless Chromium, on the out-of-memory job above."""
    from selenium.webdriver.common.by import By
    from test_ui import console_errors, login, make_driver, shot, until
    if "oom" not in DONE:
        pytest.skip("needs the out-of-memory job of this module")
    jid = DONE["oom"]
    d = make_driver(1400, 900)
    try:
        login(d, srv)
        d.get(f"{srv.url}/jobs/{jid}")
        until(d, 30, lambda d: "oom" in (d.find_elements(By.CSS_SELECTOR, "#attempts .attempt-class") or [None])[0].text
              if d.find_elements(By.CSS_SELECTOR, "#attempts .attempt-class") else False, "the attempts' classes")
        rows = d.find_elements(By.CSS_SELECTOR, "#attempts tr")
        first = rows[0]
        assert first.find_element(By.CSS_SELECTOR, ".attempt-change").text == "batch_size 8 → 4, grad_accum 1 → 2"
        assert "retry 1 of 1" in first.find_element(By.CSS_SELECTOR, ".attempt-next").text
        assert "peak" in first.find_element(By.CSS_SELECTOR, ".attempt-class").text
        d.execute_script("document.getElementById('attempts').scrollIntoView()")
        shot(d, "attempts_classes")
        assert not console_errors(d)
        if "hang" in DONE:  # the deterministic hang: its step and frame, and why no third attempt
            d.get(f"{srv.url}/jobs/{DONE['hang']}")
            def two_rows(d):
                rows = d.find_elements(By.CSS_SELECTOR, "#attempts tr")
                return len(rows) >= 2 and "deterministic" in rows[-1].text
            until(d, 30, two_rows, "the hang's attempts")
            rows = d.find_elements(By.CSS_SELECTOR, "#attempts tr")
            cls = rows[0].find_element(By.CSS_SELECTOR, ".attempt-class").text
            assert "hang (step 3, _fault_hang (faults.py:" in cls, cls
            d.execute_script("document.getElementById('attempts').scrollIntoView()")
            shot(d, "attempts_hang")
    finally:
        d.quit()


# ---- the pure parts ---------------------------------------------------------------------------------

def test_a_data_error_is_told_by_the_exceptions_own_words():
    from worker.agent.exits import data_error, exception_line
    assert data_error("ValueError: cannot collate row 1002 of the dataset: column 'text' holds None") == "row 1002"
    assert data_error("pyarrow.lib.ArrowInvalid: JSON parse error: Missing a name for object member. in row 1200")
    assert data_error("KeyError: 'labels' missing in example #17 of the collated batch") == "example #17"
    assert data_error("json.decoder.JSONDecodeError: Expecting value: line 88 column 1 (char 4410)") == "line 88"
    # a code bug that happens to carry an index is not a data error; nor is a step number
    assert data_error("IndexError: index 5 is out of bounds for dimension 0 with size 3") is None
    assert data_error("RuntimeError: NCCL timeout at step 12") is None
    assert data_error(None) is None
    tail = ["Traceback (most recent call last):", '  File "train.py", line 9, in <module>', "    collate(b)",
            "ValueError: bad row 17 in data/train.jsonl", "some later output"]
    assert exception_line(tail) == "ValueError: bad row 17 in data/train.jsonl"


def test_only_the_agents_announced_sigterm_is_a_cancel(tmp_path):
    from tokenpulse.control import announced_cancel
    f = tmp_path / "control"
    assert announced_cancel(None)  # run alone: SIGTERM is a cancel, as ever
    f.write_text("")
    assert not announced_cancel(str(f))  # the agent said nothing: from outside, a preemption
    f.write_text("cancel")
    assert announced_cancel(str(f))
    assert not announced_cancel(str(tmp_path / "missing"))
