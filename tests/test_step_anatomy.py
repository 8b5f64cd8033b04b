"""Step anatomy where people read it (issue 19 leftovers): the straggler alert says why the rank is slow,
the 'your code:' line leaves out the startup hook's own wrappers, the advisor's data-wait share comes
from the one anatomy signal, and the CLI's `ranks` / `show` print each rank's data / compute / comm.

Pure logic for the rules; a real server (real migrations, uvicorn) fed through the real agent protocol
for the CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import httpx
from conftest import ROOT
from test_cli import cli, ok
from test_ui_job import post_events

from tokenpulse.diagnosis.stall import StallConfig
from worker.agent.advice import Advisor
from worker.agent.headline import folded, stall_headline
from worker.agent.ranks import RankBoard, _our_frames

HOOK = "/opt/tp/tokenpulse/instrument/patch_torch.py"


def dump(pid: int, *frames: str) -> str:
    return (f"Process {pid}: python train.py\nPython v3.11\n\nThread {pid} (idle): \"MainThread\"\n"
            + "".join(f"    {f}\n" for f in frames))


# ---- the straggler alert names its cause ------------------------------------------------------------

def test_the_straggler_alert_says_which_part_of_the_step_is_slow_and_what_the_others_wait_in():
    b = RankBoard(open_s=0, clear_s=0)
    for r in (0, 1):
        b.observe(r, "info", {"rank": r, "host": "h", "pid": 100 + r}, 0.0)
    for t in range(3):
        b.observe(0, "alive", {"step": t, "busy_s": 0.12, "data_s": 0.01, "compute_s": 0.11, "comm_s": 0.29}, t)
        b.observe(1, "alive", {"step": t, "busy_s": 0.41, "data_s": 0.01, "compute_s": 0.40, "comm_s": 0.01}, t)
    kind, msg = b.check_straggler(now=3.0)
    assert kind == "straggler" and msg.startswith("straggler: rank 1 (h, pid 101) works 0.41 s per step"), msg
    assert "it is 3.6x slower in forward+backward (0.4 s against 0.11 s per step)" in msg, msg
    assert msg.endswith("; the others wait 0.29 s per step in all_reduce"), msg
    slow_input = RankBoard(open_s=0, clear_s=0)
    for t in range(3):
        slow_input.observe(0, "alive", {"step": t, "busy_s": 0.1, "data_s": 0.0, "compute_s": 0.1, "comm_s": 0.5}, t)
        slow_input.observe(1, "alive", {"step": t, "busy_s": 0.6, "data_s": 0.5, "compute_s": 0.1, "comm_s": 0.0}, t)
    _, msg = slow_input.check_straggler(now=3.0)
    assert "it waits for data 0.5 s per step against 0 s: its input is slow" in msg, msg
    bare = RankBoard(open_s=0, clear_s=0)  # ranks without anatomy (the native training process): no cause
    for t in range(3):
        bare.observe(0, "alive", {"step": t, "busy_s": 0.1}, t)
        bare.observe(1, "alive", {"step": t, "busy_s": 0.6}, t)
    _, msg = bare.check_straggler(now=3.0)
    assert msg.endswith("every step waits for it"), msg


# ---- the user's frames leave out the startup hook's wrappers -------------------------------------------

def test_your_code_skips_the_startup_hooks_wrappers():
    stack = dump(7, "recv (/usr/lib/python3.11/multiprocessing/connection.py:430)",
                 f"install_dataloader.<locals>.__next__ ({HOOK}:203)",
                 "read_shard (/home/u/proj/train.py:41)", "main (/home/u/proj/train.py:80)")
    assert stall_headline(45, stack, "x") == "Stuck 45 s in read_shard (train.py:41)"
    third = folded("head", "details", stack).split("\n")[2]
    assert third == "your code: read_shard (train.py:41) < main (train.py:80)", third
    assert _our_frames(stack) == "read_shard (/home/u/proj/train.py:41) < main (/home/u/proj/train.py:80)"


# ---- one data-wait signal: the anatomy ----------------------------------------------------------------

def test_the_advisor_reads_the_data_wait_share_from_the_step_anatomy():
    adv = Advisor(StallConfig())
    adv.observe("info", {"script": {"args": {"dataloader_num_workers": 0, "cores": 2}}}, 0)
    for s in (1, 2, 3):  # the Trainer callback's first steps: no data wait of their own any more
        adv.observe("metrics", {"step": s, "values": {"step_time_s": 1.0}}, s)
    assert "dataloader" not in adv.verdicts()
    adv.observe("metrics", {"step": 3, "values": {"anatomy/r0/data_s": 0.45, "anatomy/r0/compute_s": 0.55,
                                                  "anatomy/r0/comm_s": 0.0, "anatomy/r0/step_s": 1.0}}, 4)
    v = adv.verdicts()["dataloader"]
    assert v.startswith("dataloader: 45% of each step waits for its batches (dataloader_num_workers=0)"), v
    assert adv.steps[-1].step == 3 and len(adv.steps) == 3  # the anatomy window is not a step sample


def test_the_trainer_callback_sends_no_second_data_wait():
    import tokenpulse.integrations as integ
    from tokenpulse.instrument import patch_transformers
    assert not hasattr(patch_transformers, "_patch_data_wait") and not hasattr(integ.TokenPulseCallback, "data_wait")


# ---- the CLI: ranks and show --------------------------------------------------------------------------

def anatomy(r: int, data: float, compute: float, comm: float) -> dict:
    return {f"anatomy/r{r}/data_s": data, f"anatomy/r{r}/compute_s": compute, f"anatomy/r{r}/comm_s": comm,
            f"anatomy/r{r}/step_s": data + compute + comm}


def test_cli_ranks_and_show_print_each_ranks_step_anatomy_and_the_verdicts(server_factory):
    server = server_factory(agent_lost_after_s=600)
    agent = httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {server.agent_token}"})
    aid = agent.post("/api/agents", json={"name": "fake", "host": "h"}).json()["id"]
    with server.client() as c:
        jid = c.post("/api/jobs", json={"name": "ddp", "max_steps": 100}).json()["id"]
    assert agent.post(f"/api/agents/{aid}/claim").json()["job_id"] == jid
    now = time.time()
    evs = [("metrics", {"step": 10 * k, "values": {**anatomy(0, 0.02, 0.10, 0.28), **anatomy(1, 0.02, 0.37, 0.01)}},
            now - 10 + k) for k in range(1, 4)]
    evs.append(("alert", {"kind": "straggler", "severity": "warning",
                          "message": "straggler: rank 1 (h, pid 101) works 0.39 s per step against 0.12 s"}, now))
    post_events(agent, aid, jid, 0, evs)
    agent.post(f"/api/agents/{aid}/heartbeat", json={"jobs": {str(jid): now}, "ranks": {str(jid): [
        {"rank": 0, "host": "h", "pid": 100, "step": 30, "step_time_s": 0.4, "busy_s": 0.12},
        {"rank": 1, "host": "h", "pid": 101, "step": 30, "step_time_s": 0.4, "busy_s": 0.39}]}})
    out = ok(cli(server, "ranks", str(jid)))
    assert "data" in out and "compute" in out and "comm" in out, out
    row1 = next(line for line in out.splitlines() if line.strip("│ ").startswith("1 "))
    assert "0.37 s" in row1 and "0.02 s" in row1 and "0.01 s" in row1, out
    shown = json.loads(ok(cli(server, "show", str(jid))))
    assert shown["step_anatomy"]["1"] == {"step_s": 0.4, "data": "5%", "compute": "92%", "collectives": "2%"}, shown
    assert shown["step_anatomy"]["0"]["collectives"] == "70%", shown
    assert shown["verdicts"] == ["straggler: rank 1 (h, pid 101) works 0.39 s per step against 0.12 s"], shown


# ---- the overhead cut: the tokenizer hook takes itself off after the first steps ---------------------

def test_the_tokenizer_hook_measures_the_first_steps_then_takes_itself_off():
    import transformers.tokenization_utils_base as tub
    from conftest import ROOT
    from transformers import AutoTokenizer

    from tokenpulse.instrument import firststeps, patch_torch
    cls = tub.PreTrainedTokenizerBase
    saved_call, saved_flag, saved_steps = cls.__call__, cls.__dict__.get("_tp_patched"), patch_torch.STATE.opt_steps
    tok = AutoTokenizer.from_pretrained(str(ROOT / "tokenpulse" / "demo"))
    try:
        if saved_flag:
            del cls._tp_patched
        firststeps.install_tokenizer(tub)
        hooked = cls.__call__
        assert hooked is not saved_call
        patch_torch.STATE.opt_steps = 0
        n = sum(s["calls"] for s in firststeps.FACTS.sites.values())
        tok(["one text", "another text"], truncation=True, max_length=8)
        assert sum(s["calls"] for s in firststeps.FACTS.sites.values()) == n + 1  # measured in the first steps
        patch_torch.STATE.opt_steps = firststeps.TOKENIZER_UNTIL_STEPS
        out = tok(["one text"], truncation=True, max_length=8)
        assert out["input_ids"] and cls.__call__ is saved_call  # off: the script's own call again
        tok(["one text"])
        assert sum(s["calls"] for s in firststeps.FACTS.sites.values()) == n + 1
    finally:
        cls.__call__, patch_torch.STATE.opt_steps = saved_call, saved_steps
        if saved_flag:
            cls._tp_patched = saved_flag
        elif "_tp_patched" in cls.__dict__:
            del cls._tp_patched


def test_an_evaluation_of_the_wrapped_model_is_an_evaluation_counted_once(tmp_path):
    """Fault benchmark (healthy DDP run): the script trains through DDP's forward and evaluates
    `model.module` directly; only the wrapper was hooked, so each evaluation looked like a pause every
    20 steps ("periodic stalls ... 40% of the time", a false slow alert). The inner model is hooked too,
    and a forward through the wrapper still counts one batch."""
    script = tmp_path / "wrapped.py"
    script.write_text(textwrap.dedent("""
        import json, sys, time, torch
        from tokenpulse.instrument import patch_torch as pt
        pt.install_forward(sys.modules["torch.nn.modules.module"])
        pt.install_optimizer(sys.modules["torch.optim.optimizer"])
        class Wrapper(torch.nn.Module):  # what DDP looks like from here: .module, forward calls it
            def __init__(self, m):
                super().__init__()
                self.module = m
            def forward(self, **kw):
                return self.module(**kw)
        class Tiny(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = torch.nn.Embedding(10, 4)
            def forward(self, input_ids, attention_mask=None):
                return self.emb(input_ids).sum()
        model = Wrapper(Tiny())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3)}
        for _ in range(3):  # two calls find the model, the third goes through the settled hooks
            model(**batch).backward(); opt.step(); opt.zero_grad()
        padded = pt.STATE.padded
        time.sleep(pt.EVAL_AFTER_S + 0.1)
        with torch.no_grad():
            model.module(**batch)  # evaluate(model.module)
        direct = pt.STATE.eval_batches
        with torch.no_grad():
            model(**batch)  # through the wrapper: one batch, not two
        print(json.dumps({"padded": padded, "direct": direct, "both": pt.STATE.eval_batches,
                          "in_eval": pt.STATE.in_eval}))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "TOKENPULSE_INSTRUMENT": "0"})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # the forwards after the first step (its window starts there), 6 tokens each, counted once: 12, not 24
    assert got == {"padded": 12, "direct": 1, "both": 2, "in_eval": True}, got
