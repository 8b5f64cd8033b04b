"""Memory is a first-class choice (issue 15 item 6): running out of host memory is an `oom` like
CUDA's. Real allocator failures, no mocks: the test-only knob TOKENPULSE_TEST_MEMORY_HEADROOM_MB caps
the training process's address space (RLIMIT_AS) at what it has mapped when it sets up its batches
plus that much, so a micro-batch of 8 rows of 1,024 tokens fails in torch's CPU allocator and one of
4 rows fits."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from worker.training.fit import CPU_TOKENS_CAP
from worker.training.memory import HEADROOM_ENV, is_oom

HEADROOM = {HEADROOM_ENV: "700"}
BIG = {"padding": "max_length", "max_seq_length": 1024, "max_steps": 2, "precision": "fp32", "device": "cpu"}


def test_allocator_errors_count_as_out_of_memory():
    with pytest.raises(RuntimeError) as e:
        torch.empty(1 << 60, dtype=torch.uint8)  # the CPU allocator refuses: a real RuntimeError
    assert is_oom(e.value), e.value
    assert is_oom(MemoryError()) and not is_oom(RuntimeError("shape mismatch")) and not is_oom(ValueError("x"))
    assert is_oom(RuntimeError("could not create a primitive"))  # oneDNN's scratchpad, refused by the limit


def test_cpu_oom_fails_as_oom_and_is_retried_with_half_the_micro_batch(server):
    server.start_agent("small", env=HEADROOM)
    with server.client() as c:
        r = c.post("/api/jobs", json={"name": "too big", "batch_size": 8, "grad_accum": 1, **BIG})
        assert r.status_code == 201, r.text
        job = server.wait_job(r.json()["id"], timeout=400)
        assert job["state"] == "completed", job
        first, second = job["attempts"]
        assert first["failure"] == "oom" and first["exit_code"] == 5 and first["outcome"] == "retried", first
        assert "can't allocate memory" in first["reason"], first
        assert second["outcome"] == "completed"
        assert (job["spec"]["batch_size"], job["spec"]["grad_accum"]) == (4, 2)  # same effective batch
        alerts = c.get("/api/alerts", params={"job_id": job["id"]}).json()
        assert any(a["kind"] == "oom" for a in alerts), alerts


def test_autotune_treats_an_allocator_failure_as_does_not_fit(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"batch_size": "auto", "grad_accum": 1, **BIG}))
    out = subprocess.run([sys.executable, "-m", "worker.training.train", "--spec", str(spec), "--out",
                          str(tmp_path / "out")], env={**os.environ, **HEADROOM}, cwd=ROOT,
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    events = [json.loads(line.split(": ", 1)[1]) for line in out.stderr.splitlines()
              if line.startswith("[tokenpulse] info: ") and '"measured"' in line]
    (chosen,) = events
    table = chosen["measured"]
    assert {"row_len": 1024, "rows": 8, "tokens_per_s": 0.0, "fits": False} in table, table
    assert chosen["batch_size"] <= 4 and all(m["fits"] for m in table if m["rows"] <= 4), table
    assert "completed: trained 2 steps" in out.stdout


def test_analysis_measures_the_largest_micro_batch_per_sequence_length(server_factory, tmp_path):
    """`tokenpulse analyze --measure`: per candidate max_seq_length, the largest micro-batch of full
    rows that fits (measured in the analysis child, which gets the same address-space headroom: far
    below the 16,384-token CPU cap) and its tokens/s: longer rows, fewer of them. (fp32 asked for: with
    precision=auto the choice follows a timing of bf16 against fp32, and one whole run that chose bf16
    found no room for a single 1,024-token row after 8 of 512 had fitted; not reproduced alone.)"""
    s = server_factory(**{HEADROOM_ENV.removeprefix("TOKENPULSE_").lower(): 700})
    env = {**os.environ, "TOKENPULSE_URL": s.url, "TOKENPULSE_TOKEN": s.token, "COLUMNS": "200"}
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"precision": "fp32"}))
    out = subprocess.run([sys.executable, "-m", "tokenpulse.cli", "analyze", str(spec), "--measure", "400"], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rows of full length that fit" in out.stdout, out.stdout
    table = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) == 4 and cells[0].replace(",", "").isdigit() and cells[1].endswith(("row", "rows")):
            table[int(cells[0].replace(",", ""))] = (int(cells[1].split()[0]), float(cells[2].replace(",", "")),
                                                     cells[3])
    assert {256, 512, 1024, 2048} <= set(table), out.stdout
    rows = [table[L][0] for L in (256, 512, 1024, 2048)]
    assert all(table[L][2] == "memory" and table[L][1] > 0 for L in (256, 512, 1024, 2048)), out.stdout
    assert rows == sorted(rows, reverse=True) and rows[0] > rows[-1] >= 1, out.stdout
    # memory stopped each search, not the token cap (how many rows of 1,024 fit varies by machine: 4 or 8)
    assert all(table[L][0] * L < CPU_TOKENS_CAP for L in (256, 512, 1024, 2048)), out.stdout
