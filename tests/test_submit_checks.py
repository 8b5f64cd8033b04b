"""Submit-time file checks never block the server and never answer 500: only regular files are
opened, reads are bounded, and every bad path or file is a 422 naming the field."""
from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest


def tiny_model_dir(path):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


def post(server, spec, timeout=30):
    with server.client() as c:
        return c.post("/api/jobs", json=spec, timeout=timeout)


def test_fifo_config_is_refused_and_the_server_keeps_answering(server, tmp_path):
    model = tiny_model_dir(tmp_path / "m")
    os.mkfifo(model / "tokenizer_config.json")
    answers = []

    def health_while_submitting():
        for _ in range(10):
            t0 = time.monotonic()
            answers.append((httpx.get(f"{server.url}/api/health", timeout=30).status_code, time.monotonic() - t0))
    t = threading.Thread(target=health_while_submitting)
    t.start()
    r = post(server, {"model": str(model)})
    t.join()
    assert r.status_code == 422, r.text
    assert r.json()["detail"]["field"] == "model"
    assert "not a regular file" in r.text
    assert all(code == 200 and took < 5 for code, took in answers), answers


@pytest.mark.parametrize("name, make, needle", [
    ("fifo.jsonl", lambda p: os.mkfifo(p), "not a regular file"),
    ("empty.txt", lambda p: p.write_text(""), "empty"),
    ("blank.txt", lambda p: p.write_text("\n\n  \n"), "empty"),
    ("binary.txt", lambda p: p.write_bytes(bytes(range(256)) * 8), "binary"),
    ("nul.txt", lambda p: p.write_bytes(b"text\x00more text\n"), "NUL"),
    ("bad.jsonl", lambda p: p.write_text("{not json\n"), "not a JSON object"),
    ("bad.parquet", lambda p: p.write_bytes(b"PAR1 nonsense"), "parquet"),
])
@pytest.mark.shared_server
def test_bad_dataset_files_are_a_422_naming_the_dataset(server, tmp_path, name, make, needle):
    make(tmp_path / name)
    r = post(server, {"dataset": str(tmp_path / name)})
    assert r.status_code == 422, r.text
    assert r.json()["detail"]["field"] == "dataset", r.text
    assert needle in r.text, r.text


@pytest.mark.shared_server
def test_corrupt_dataset_info_in_a_saved_dataset(server, tmp_path):
    d = tmp_path / "saved"
    d.mkdir()
    (d / "dataset_info.json").write_text("{truncated")
    r = post(server, {"dataset": str(d)})
    assert r.status_code == 422 and r.json()["detail"]["field"] == "dataset", r.text
    (d / "dataset_info.json").write_text('["a list"]')
    r = post(server, {"dataset": str(d)})
    assert r.status_code == 422 and "features" in r.text, r.text


@pytest.mark.shared_server
@pytest.mark.parametrize("field", ["model", "dataset"])
def test_a_path_component_over_255_characters(server, tmp_path, field):
    r = post(server, {field: str(tmp_path / ("x" * 300) / "data.jsonl")})
    assert r.status_code == 422, r.text
    assert r.json()["detail"]["field"] == field, r.text


@pytest.mark.shared_server
def test_the_analyze_route_has_the_same_checks(server, tmp_path):
    os.mkfifo(tmp_path / "f.csv")
    with server.client() as c:
        r = c.post("/api/datasets/analyze", json={"dataset": str(tmp_path / "f.csv")}, timeout=30)
    assert r.status_code == 422 and "not a regular file" in r.text, r.text
