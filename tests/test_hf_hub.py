"""Hub models and datasets through the real huggingface_hub client, against a local server that
speaks the Hub's HTTP API (tests/hubfixture.py; HF_ENDPOINT points the server, agent and training
processes at it). No internet, no mocks: the real download, cache and loading code runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_server, stop_agents, wait_for
from tests.hubfixture import HubFixture, tiny_model_files
from worker.training.data import DEMO_DIR

REPO = Path(__file__).resolve().parent.parent
SECRET = "hf_fixture_secret_value_7f3a"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = HubFixture()
    files = tiny_model_files(tmp_path_factory.mktemp("tinyllama"))
    h.add("models", "tiny/llama", files, info={"config": {"model_type": "llama"}})
    h.add("models", "tiny/private-llama", files, token=SECRET)
    h.add("models", "tiny/stuck-llama", files)
    h.add("models", "tiny/ships-code", {"config.json": b"{}"},
          info={"config": {"model_type": "custom", "auto_map": {"AutoModelForCausalLM": "modeling.Custom"}}})
    lines = (DEMO_DIR / "demo.jsonl").read_bytes().splitlines(keepends=True)[:200]
    h.add("datasets", "tiny/fortunes", {"data/train.jsonl": b"".join(lines), "README.md": b"# fortunes\n"})
    yield h
    h.close()


def hub_env(hub) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TOKENPULSE_SECRET_"))}
    env["HF_ENDPOINT"] = hub.url
    return env


@pytest.fixture(scope="module")
def hub_server(tmp_path_factory, hub):
    """One server and agent for the module's jobs (each test checks the jobs it submitted): the
    agent's training processes fork from its zygote, imported once for all of them. The agent holds
    the secret that only the private repo's job names."""
    s = make_server(tmp_path_factory.mktemp("hub-server"))
    s.env = {**hub_env(hub), **{k: v for k, v in s.env.items() if k.startswith("TOKENPULSE_")}}
    s.start()
    s.start_agent("a1", env={"TOKENPULSE_SECRET_ORG": SECRET})
    yield s
    stop_agents(s)
    s.kill()


JOB = {"model": "tiny/llama", "dataset": "tiny/fortunes", "max_steps": 3, "precision": "fp32",
       "batch_size": 2, "grad_accum": 1, "log_every": 1}


def events(c, job_id, kind):
    return [e["data"] for e in c.get(f"/api/jobs/{job_id}/events", params={"kinds": [kind], "limit": 100000}
                                     ).json()["events"]]


def test_train_on_hub_model_and_dataset_with_download_progress_and_a_shared_cache(hub_server, hub):
    hub.chunk_delay_s = 0.1  # ~1.5 s for the weights: progress is reported while bytes flow
    with hub_server.client() as c:
        r = c.post("/api/jobs", json=JOB)
        assert r.status_code == 201, r.text
        job = hub_server.wait_job(r.json()["id"], timeout=180)
        assert job["state"] == "completed", job
        downloads = [e for e in events(c, job["id"], "phase") if e["name"] == "downloading"]
        model_dl = [e for e in downloads if "tiny/llama" in e.get("detail", "")]
        total = model_dl[0]["total"]
        assert total > 800_000 and model_dl[-1]["done"] == total  # bytes, done/total, complete
        assert any(0 < e["done"] < total for e in model_dl), model_dl  # progress while downloading
        assert any("/s" in e.get("detail", "") for e in model_dl)  # with its speed
        assert any("tiny/fortunes" in e.get("detail", "") and e["total"] > 0 for e in downloads)
        got = list(hub.downloads)
        assert "models/tiny/llama/model.safetensors" in got and "datasets/tiny/fortunes/data/train.jsonl" in got

        # A second job on the same agent: one shared cache, nothing downloaded again.
        hub.chunk_delay_s = 0
        r = c.post("/api/jobs", json={**JOB, "seed": 1})
        job2 = hub_server.wait_job(r.json()["id"], timeout=180)
        assert job2["state"] == "completed", job2
        assert hub.downloads == got
        again = [e for e in events(c, job2["id"], "phase") if e["name"] == "downloading"]
        assert again and all(e["total"] == 0 and "nothing to download" in e["detail"] for e in again), again
    work = hub_server.data_dir.parent / "work-a1"
    assert list((work / "cache" / "hf" / "hub").glob("models--tiny--llama/snapshots/*/model.safetensors"))


def test_unknown_hub_ids_are_a_422_naming_the_field(hub_server):
    with hub_server.client() as c:
        for spec, field in [({"model": "tiny/no-such-model"}, "model"),
                            ({"dataset": "tiny/no-such-data"}, "dataset"),
                            ({"model": "tiny/llama", "revision": "v9"}, "revision"),
                            ({"model": "tiny/private-llama"}, "model")]:
            r = c.post("/api/jobs", json=spec)
            assert r.status_code == 422, (spec, r.text)
            assert r.json()["detail"]["field"] == field, (spec, r.text)
        assert "Hub" in r.text and "token" in r.text  # the private one says how to get in
        r = c.post("/api/jobs", json={"model": "tiny/ships-code"})
        assert r.status_code == 422 and r.json()["detail"]["field"] == "model" and "auto_map" in r.text, r.text


def test_private_repo_with_a_named_secret_and_the_token_never_stored(hub_server, hub):
    with hub_server.client() as c:
        r = c.post("/api/jobs", json={**JOB, "model": "tiny/private-llama", "hub_token_secret": "org"})
        assert r.status_code == 201, r.text
        job = hub_server.wait_job(r.json()["id"], timeout=180)
        assert job["state"] == "completed", job
        shown = json.dumps(c.get(f"/api/jobs/{job['id']}").json()) + json.dumps(
            c.get(f"/api/jobs/{job['id']}/events", params={"limit": 100000}).json())
    assert SECRET not in shown
    for f in hub_server.data_dir.rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f


def check_only(tmp_path, spec: dict, env: dict, cache: Path):
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    r = subprocess.run([sys.executable, "-m", "worker.training.analyze", "--spec", str(tmp_path / "spec.json"),
                        "--check-only", "--cache-dir", str(cache)], capture_output=True, text=True,
                       timeout=180, env={**env, "PYTHONPATH": str(REPO)}, cwd=tmp_path)
    return r.returncode, json.loads(r.stdout)


def test_offline_mode_uses_the_cache_only(tmp_path, hub):
    cache = tmp_path / "cache"
    env = hub_env(hub)
    assert check_only(tmp_path, JOB, env, cache) == (0, {"ok": True})  # online: downloads into cache/hf
    n = len(hub.downloads)
    offline = {**env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing reachable
    assert check_only(tmp_path, JOB, offline, cache) == (0, {"ok": True})
    unreachable = {**env, "HF_ENDPOINT": "http://127.0.0.1:9"}  # not offline, but no Hub: the cache serves
    assert check_only(tmp_path, JOB, unreachable, cache) == (0, {"ok": True})
    code, out = check_only(tmp_path, {**JOB, "model": "tiny/never-downloaded"}, offline, cache)
    assert code == 2 and out["field"] == "model" and "offline" in out["error"], out
    assert len(hub.downloads) == n


def test_a_stuck_download_raises_a_stall_alert(hub_server, hub):
    hub.chunk_delay_s = 60  # the weights' first 64 KB arrive, then nothing for a minute
    try:
        with hub_server.client() as c:  # a model the agent's cache does not hold yet
            r = c.post("/api/jobs", json={**JOB, "model": "tiny/stuck-llama",
                                          "stall": {"floor_s": 1, "first_step_s": 4, "factor": 2}})
            job_id = r.json()["id"]
            alerts = wait_for(lambda: [a for a in c.get("/api/alerts", params={"job_id": job_id}).json()
                                       if a["kind"] == "stalled"], 120, "a stalled alert")
            assert "downloading" in json.dumps(alerts), alerts
            c.post(f"/api/jobs/{job_id}/cancel")
            assert hub_server.wait_job(job_id, timeout=60)["state"] == "cancelled"
    finally:
        hub.chunk_delay_s = 0


MULTI_README = b"""---
configs:
- config_name: short
  data_files:
  - split: train
    path: short/train.jsonl
  - split: validation
    path: short/validation.jsonl
- config_name: long
  data_files:
  - split: train
    path: long/train.jsonl
---
# two configs
"""


def analyze(tmp_path, spec: dict, env: dict, cache: Path):
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    r = subprocess.run([sys.executable, "-m", "worker.training.analyze", "--spec", str(tmp_path / "spec.json"),
                        "--cache-dir", str(cache)], capture_output=True, text=True,
                       timeout=180, env={**env, "PYTHONPATH": str(REPO)}, cwd=tmp_path)
    return r.returncode, json.loads(r.stdout)


def rows(n: int, word: str) -> bytes:
    return b"".join(json.dumps({"text": " ".join([word] * (i + 1))}).encode() + b"\n" for i in range(n))


def test_hub_dataset_config_and_split(tmp_path, hub):
    hub.add("datasets", "tiny/multi", {"README.md": MULTI_README, "short/train.jsonl": rows(30, "a"),
                                       "short/validation.jsonl": rows(7, "b"), "long/train.jsonl": rows(11, "c d e")})
    env, cache = hub_env(hub), tmp_path / "cache"
    base = {"dataset": "tiny/multi"}
    assert analyze(tmp_path, {**base, "dataset_config": "short"}, env, cache)[1]["examples"] == 30
    assert analyze(tmp_path, {**base, "dataset_config": "short", "dataset_split": "validation"}, env, cache
                   )[1]["examples"] == 7
    assert analyze(tmp_path, {**base, "dataset_config": "long"}, env, cache)[1]["examples"] == 11
    code, out = analyze(tmp_path, {**base, "dataset_config": "short", "dataset_split": "test"}, env, cache)
    assert code == 2 and out["field"] == "dataset_split" and "validation" in out["error"], out


def test_streaming_a_hub_dataset_reads_it_from_the_hub_without_downloading_it_first(tmp_path, hub):
    lines = (DEMO_DIR / "demo.jsonl").read_bytes().splitlines(keepends=True)[:300]
    hub.add("datasets", "tiny/stream", {"data/train.jsonl": b"".join(lines)})
    cache = tmp_path / "cache"
    (tmp_path / "spec.json").write_text(json.dumps({**JOB, "dataset": "tiny/stream", "streaming": True,
                                                    "max_steps": 2}))
    r = subprocess.run([sys.executable, "-m", "worker.training.train", "--spec", str(tmp_path / "spec.json"),
                        "--out", str(tmp_path / "out"), "--cache-dir", str(cache)], capture_output=True,
                       text=True, timeout=300, env={**hub_env(hub), "PYTHONPATH": str(REPO)}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "streaming from the Hub" in r.stderr and "accumulating" in r.stderr
    assert (tmp_path / "out" / "final" / "config.json").exists()
    assert not list((cache / "hf" / "hub").glob("datasets--tiny--stream/snapshots/*/data/train.jsonl"))
