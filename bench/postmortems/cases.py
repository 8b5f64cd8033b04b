"""The five post-mortem cases as command jobs: each user script run unchanged through a real server
and agent (`tokenpulse run -- python script.py`), and what tokenpulse said about it: each alert, the
seconds from the job's start to it, and whether it names the cause and the fix.

Used by bench/postmortems.py (full sizes) and tests/test_postmortems.py (tiny sizes, seconds each)."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@dataclass
class Case:
    key: str
    script: str
    args: list  # sizes for this run (the script's own options)
    expect: str  # the alert kind whose verdict the case needs
    cause: tuple  # words that name the cause (all must appear)
    fix: tuple  # words that name the fix (all must appear)
    stall: dict = field(default_factory=dict)  # per-job thresholds (tests: tiny sizes)
    until: str = "verdict"  # run until the verdict (or the end); "end" for the fixed versions


# What the user needed to hear (issue 26's table), as the words the verdict must carry.
CAUSES = {
    "a": ("padding", 'padding="max_length"', "a_padding.py:"),
    "b": ("each optimizer step takes", "workers on"),
    "c": ("padding", "padding=\"max_length\"", "data loading is"),
    "d": ("truncation", "are cut", "max_length="),
    "e": ("no progress reported since 'loading model' finished", "the main thread waits in fetch_records"),
}
FIXES = {
    "a": ('drop padding="max_length"', "covers every example"),
    "b": ("Fix: per_device_train_batch_size=", "gradient_accumulation_steps=", "Fix: dataloader_num_workers="),
    "c": ("covers every example", "group_by_length"),
    "d": ("keeps every example", "tokenpulse analyze", "--measure"),
    "e": ("report progress", "tqdm"),
}
KINDS = {"a": ("padding",), "b": ("batch", "dataloader"), "c": ("padding",), "d": ("truncation",), "e": ("quiet",)}
SCRIPTS = {"a": "a_padding.py", "b": "b_crawl.py", "c": "c_padding_2048.py", "d": "d_truncation.py", "e": "e_stream.py"}
# The same five mistakes as other users write them (variants/): other libraries' paths to the same
# verdict, so the benchmark tests the verdict, not one way of writing the script.
VARIANTS = {"a": "variants/a_collator_pad.py", "b": "variants/b_plain_loop.py", "c": "variants/c_chat_collate.py",
            "d": "variants/d_chat_sft.py", "e": "variants/e_iterable.py"}
V_CAUSES = {
    "a": ("padding", "DataCollatorWithPadding", 'padding="max_length"', "a_collator_pad.py:"),
    "b": ("each optimizer step takes", "workers on"),
    "c": ("padding", 'padding="max_length"', "c_chat_collate.py:"),
    "d": ("truncation", "are cut", "max_length="),
    "e": ("no progress reported since 'loading model' finished", "the main thread waits in RemoteBlocks.records"),
}
V_FIXES = {
    "a": ('drop padding="max_length"', "covers every example"),
    "b": ("Fix: batch_size=", "in the DataLoader at b_plain_loop.py:", "Fix: num_workers="),
    "c": ("covers every example", "group_by_length"),
    "d": ("keeps every example", "tokenpulse analyze", "--measure"),
    "e": ("report progress", "tqdm"),
}
VERDICT_KINDS = ("padding", "truncation", "batch", "dataloader", "placement", "precision", "quiet", "slow", "stalled")


def submit(c, key: str, args: list, cwd: Path, env: dict, stall: dict, fixed: bool, variant: bool = False) -> int:
    script = (VARIANTS if variant else SCRIPTS)[key]
    command = [sys.executable, str(HERE / script), *args] + (["--fixed"] if fixed else [])
    body = {"command": command, "cwd": str(cwd), "env": env, "max_retries": 0}
    if stall:
        body["stall"] = stall
    r = c.post("/api/jobs/command", json=body)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def alerts(c, job_id: int) -> list[dict]:
    return [a for a in c.get("/api/alerts", params={"job_id": job_id, "limit": 100}).json()
            if a["kind"] in VERDICT_KINDS]


def judged(c, key: str, job_id: int, variant: bool = False) -> dict:
    """The case's verdict: its alerts of the kinds it needs, joined; seconds from the job's start to the
    first of them and to the last (the whole diagnosis); cause and fix named."""
    job = c.get(f"/api/jobs/{job_id}").json()
    got = [a for a in alerts(c, job_id) if a["kind"] in KINDS[key]]
    text = "\n".join(f"[{a['kind']}] {a['message']}" for a in sorted(got, key=lambda a: a["created_at"]))
    start = job.get("started_at") or job["created_at"]
    causes, fixes = (V_CAUSES, V_FIXES) if variant else (CAUSES, FIXES)
    return {"job": job_id, "state": job["state"], "text": text,
            "all_kinds": sorted({a["kind"] for a in got}) == sorted(KINDS[key]),
            "first_s": min((a["created_at"] - start for a in got), default=None),
            "seconds": max((a["created_at"] - start for a in got), default=None) if got else None,
            "cause": bool(got) and all(w in text for w in causes[key]),
            "fix": bool(got) and all(w in text for w in fixes[key]),
            "step": (job.get("step") or 0)}


def wait_verdict(c, key: str, job_id: int, timeout: float, variant: bool = False) -> dict:
    """Until every kind the case needs has an alert naming the cause, or the job ends, or the timeout
    (an earlier alert of the kind, e.g. a quiet start before the model loaded, is not the verdict)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = judged(c, key, job_id, variant)
        if (got["all_kinds"] and got["cause"]) or got["state"] in ("completed", "failed", "cancelled"):
            return got
        time.sleep(1)
    return judged(c, key, job_id, variant)
