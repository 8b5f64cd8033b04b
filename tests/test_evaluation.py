"""Evaluation (issue 15 item 3): a held-out split by seed, eval loss and perplexity beside train loss
at the eval steps, eval prompts' generations, and the final eval over REST and in the CLI.
Real server, agent and training process; the tiny builtin model on the demo data."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from conftest import ROOT

from tokenpulse.protocol import JobSpec
from worker.training.evaluation import hold_out, subset
from worker.training.tokenization import Tokenized


def toy(n: int) -> Tokenized:
    lens = np.arange(n) % 5 + 2
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    tokens = np.concatenate([np.full(k, i, np.int32) for i, k in enumerate(lens)])  # token = its example
    return Tokenized(tokens, offsets, (np.arange(n) % 2).astype(np.int32))


def test_hold_out_is_disjoint_complete_and_fixed_by_seed():
    data = toy(100)
    train, ev = hold_out(data, 0.1, seed=3)
    assert (train.n, ev.n) == (90, 10)
    got_train, got_eval = set(train.tokens.tolist()), set(ev.tokens.tolist())
    assert not got_train & got_eval and got_train | got_eval == set(range(100))
    # each example kept whole, with its own prompt length
    for part in (train, ev):
        for i in range(part.n):
            ex = part.tokens[part.offsets[i]:part.offsets[i + 1]]
            assert len(set(ex.tolist())) == 1 and len(ex) == data.lengths[ex[0]]
            assert part.prompt_lens[i] == data.prompt_lens[ex[0]]
    again = hold_out(data, 0.1, seed=3)[1]
    assert np.array_equal(again.tokens, ev.tokens)
    assert not np.array_equal(hold_out(data, 0.1, seed=4)[1].tokens, ev.tokens)
    assert subset(data, np.array([5])).tokens.tolist() == [5] * int(data.lengths[5])


def test_eval_spec_is_checked_at_submit(server):
    with server.client() as c:
        r = c.post("/api/jobs", json={"eval_fraction": 0.1, "eval_dataset": "x.jsonl"})
        assert r.status_code == 422 and "one of eval_fraction, eval_dataset or eval_split" in r.text
        r = c.post("/api/jobs", json={"eval_fraction": 0.9})
        assert r.status_code == 422 and "eval_fraction" in r.text
        r = c.post("/api/jobs", json={"eval_dataset": str(server.data_dir / "missing.jsonl")})
        assert r.status_code == 422 and r.json()["detail"]["field"] == "eval_dataset", r.text
        bad = server.data_dir / "eval.jsonl"
        bad.write_text(json.dumps({"body": "no text column"}) + "\n")
        r = c.post("/api/jobs", json={"eval_dataset": str(bad)})
        assert r.status_code == 422 and r.json()["detail"]["field"] == "eval_dataset", r.text
        assert "'text'" in r.json()["detail"]["message"]
        r = c.post("/api/jobs", json={"eval_prompts": ["x"] * 9})
        assert r.status_code == 422 and "eval_prompts" in r.text


def test_job_with_eval_fraction_reports_eval_loss_generations_and_final_eval(agent_server):
    s = agent_server
    spec = {"name": "eval", "max_steps": 12, "eval_fraction": 0.1, "eval_every": 4, "learning_rate": 2e-3,
            "batch_size": 4, "grad_accum": 1, "precision": "fp32", "eval_prompts": ["Q: what", "A fortune"],
            "eval_max_new_tokens": 5, "eval_max_examples": 64, "seed": 2}
    with s.client() as c:
        r = c.post("/api/jobs", json=spec)
        assert r.status_code == 201, r.text
        jid = r.json()["id"]
        job = s.wait_job(jid, timeout=300)
        assert job["state"] == "completed", job
        series = c.get(f"/api/jobs/{jid}/metrics", params={"keys": ["eval/loss", "eval/ppl", "loss"]}).json()["series"]
        ev = series["eval/loss"]
        assert ev["step"] == [4, 8, 12], ev
        assert ev["value"][0] > ev["value"][1] > ev["value"][2], ev  # it learns
        assert np.allclose(series["eval/ppl"]["value"], np.exp(ev["value"]))
        assert len(series["loss"]["step"]) == 12  # train loss beside it, every step
        # the summary's latest values are the final eval
        assert job["last"]["eval/loss"] == ev["value"][-1] and job["info"]["eval_examples"] == 64
        events = c.get(f"/api/jobs/{jid}/events", params={"kinds": ["info", "phase"]}).json()["events"]
        gens = [e["data"] for e in events if e["kind"] == "info" and "eval_generations" in e["data"]]
        assert [g["eval_step"] for g in gens] == [4, 8, 12]
        assert [x["prompt"] for x in gens[-1]["eval_generations"]] == ["Q: what", "A fortune"]
        assert all(isinstance(x["output"], str) for g in gens for x in g["eval_generations"])
        evals = [e["data"] for e in events if e["kind"] == "phase" and e["data"]["name"] == "evaluating"]
        assert evals and evals[-1]["unit"] == "batches" and evals[-1]["done"] == evals[-1]["total"]
    env = {**os.environ, "TOKENPULSE_URL": s.url, "TOKENPULSE_TOKEN": s.token, "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "tokenpulse.cli", "watch", str(jid)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"eval loss {ev['value'][-1]:.4f}, perplexity" in out.stdout, out.stdout
    out = subprocess.run([sys.executable, "-m", "tokenpulse.cli", "jobs"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert "eval loss" in out.stdout and f"{ev['value'][-1]:.4f}" in out.stdout, out.stdout


def test_separate_eval_dataset(tmp_path):
    """eval_dataset: a file of its own, tokenized with the training fields; evaluated at the end only
    when no eval_every is given."""
    from test_training import Recorder, quick_spec

    from worker.training.controls import Controls
    from worker.training.data import DEMO_DIR
    from worker.training.session import Session
    rows = [json.loads(line) for line in (DEMO_DIR / "demo.jsonl").read_text().splitlines()[:20]]
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    em = Recorder()
    code = Session(quick_spec(max_steps=3, eval_dataset=str(path)), tmp_path / "out", em, Controls()).run()
    assert code == 0
    evals = [d for k, d in em.events if k == "metrics" and "eval/loss" in d["values"]]
    assert [d["step"] for d in evals] == [3]
    assert em.infos("eval_examples")[0]["eval_examples"] == 20


def test_eval_split_of_a_saved_dataset_dict(tmp_path):
    """eval_split: another split of the same dataset (a save_to_disk DatasetDict here; a Hub dataset
    works the same way); a split it does not have fails naming eval_split."""
    import datasets
    from test_training import Recorder, quick_spec

    from tokenpulse.errors import SpecError
    from worker.training.controls import Controls
    from worker.training.data import DEMO_DIR
    from worker.training.session import Session
    texts = [json.loads(line)["text"] for line in (DEMO_DIR / "demo.jsonl").read_text().splitlines()[:60]]
    path = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[:48]}),
                          "validation": datasets.Dataset.from_dict({"text": texts[48:]})}).save_to_disk(str(path))
    em = Recorder()
    assert Session(quick_spec(max_steps=2, dataset=str(path), eval_split="validation"), tmp_path / "o", em,
                   Controls()).run() == 0
    assert [d["step"] for k, d in em.events if k == "metrics" and "eval/loss" in d["values"]] == [2]
    assert em.infos("eval_examples")[0]["eval_examples"] == 12
    try:
        Session(quick_spec(max_steps=2, dataset=str(path), eval_split="nope"), tmp_path / "p", Recorder(),
                Controls()).run()
        raise AssertionError("an unknown eval split must fail")
    except SpecError as e:
        assert e.field == "eval_split" and "'nope'" in e.message, (e.field, e.message)
    assert JobSpec(eval_split="validation").has_eval
