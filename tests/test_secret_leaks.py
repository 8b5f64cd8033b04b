"""Issue 24, part 2: secrets never leave the agent, checks hold at the point of use, work is bounded.

Each attack is performed for real: a real server, a real agent with --allow-commands running a real
script that prints its secret in every shape it can think of; a working directory swapped for a
symlink after its submit; a dataset outside the path roots; concurrent analyses; the files' modes.
"""
from __future__ import annotations

import base64
import json
import secrets
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from urllib.parse import quote

import httpx

from tests.conftest import ROOT, wait_for
from worker.agent.masking import SecretMask, forms
from worker.agent.output import LineFolder

PY = sys.executable

# Events in every field the agent relays, each carrying the secret; then a traceback naming it.
LEAKY = r'''
import base64, os, sys, time, urllib.parse
from tokenpulse.events import Emitter

s = os.environ["TP_LEAK_SECRET"]
em = Emitter()
print("plain:", s, flush=True)
print("base64:", base64.b64encode(s.encode()).decode(), flush=True)
print("basic auth: Basic", base64.b64encode(("user:" + s).encode()).decode(), flush=True)
print("urlsafe:", base64.urlsafe_b64encode(s.encode()).decode(), flush=True)
print("url:", urllib.parse.quote(s, safe=""), "and", urllib.parse.quote_plus(s), flush=True)
print("half:", s[: len(s) // 2], flush=True)
# a line far over the 8 KiB cut, the secret straddling it, written in two parts (no newline yet)
sys.stdout.write("x" * (8192 - 12) + s + "y" * 50)
sys.stdout.flush()
time.sleep(0.5)  # the subject, not a wait: a line's two halves in two reads (the folder must join them)
sys.stdout.write("z" * 20 + s + "\n")
sys.stdout.flush()
print("tail of a long line:", "w" * 9000, s, flush=True)
em.phase("phase " + s, done=1, total=2, unit="steps", detail="detail " + s)
em.metrics(1, **{"loss": 1.0, ("m_" + s)[:64]: 2.0})
em.info(note="info " + s, **{"key_" + s[:30]: 1})
em.emit("checkpoint", step=1, path="/tmp/ckpt-" + s)
em.alert("leaky", "alert " + s, severity="critical")
em.emit_data("alert", {"kind": "leaky2", "message": "with a stack", "stack": "Traceback: " + s})
em.log("explicit log " + s)
time.sleep(0.5)  # the subject: the alive thread speaks once more before the crash (its events masked too)
raise RuntimeError("bad token " + s)
'''


def pieces(value: str, n: int = 10) -> list[str]:
    """Every n-character piece of value (a random secret: none occurs anywhere by chance)."""
    return [value[i:i + n] for i in range(len(value) - n + 1)]


def shapes(value: str) -> list[str]:
    raw = value.encode()
    return [value, base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode(),
            quote(value, safe=""), *pieces(value)]


def leaks(text, value: str) -> list[str]:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return [s for s in shapes(value) if s in text]


def test_masking_covers_forms_pieces_and_the_cut_of_a_long_line():
    s = "hf_" + secrets.token_hex(12) + "/+="
    m = SecretMask([s])
    b64 = base64.b64encode(("user:" + s).encode()).decode()
    for text in (s, f"token={s}!", base64.b64encode(s.encode()).decode(), b64, quote(s, safe=""),
                 "x" * 30 + s[:12], s[-9:] + " tail", f"id {s[3:13]} ok"):
        assert not leaks(m(text), s) and "***" in m(text), (text, m(text))
    assert m("hf_ is short and fine") == "hf_ is short and fine"
    assert m.data({"values": {s[:20]: 1.0}, "list": [s]}) == {"values": {"***": 1.0}, "list": ["***"]}
    assert all(len(f) >= 4 for f in forms(s))
    # a line cut at max_line without a newline: masked before the cut, nothing of it on either side
    fold = LineFolder(max_line=100, mask=m)
    out = fold.feed(("a" * 90 + s + "b" * 200).encode(), 0) + fold.feed(b"\n", 0) + fold.close()
    assert not any(leaks(x, s) for x in out) and "***" in "".join(out), out
    fold = LineFolder(max_line=100, mask=m)  # the secret's first characters arrive before the cut
    out = fold.feed(("a" * 95 + s[:6]).encode(), 0) + fold.feed((s[6:] + "b" * 150 + "\n").encode(), 0)
    assert "".join(out).count("***") == 1 and not any(leaks(x, s) for x in out), out


def test_a_script_printing_its_secret_every_way_leaks_it_nowhere(server_factory, tmp_path):
    value = "S3cr/" + secrets.token_hex(16) + "+=&x"  # URL-encoding and base64 differ from it
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "leaky.py").write_text(textwrap.dedent(LEAKY))
    srv = server_factory()
    answers, frames = [], []
    with srv.client() as c:
        # a credential-looking name in plain env: refused, naming the field and pointing to secret_env
        for name in ("HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "MY_SECRET"):
            r = c.post("/api/jobs/command", json={"command": [PY, "leaky.py"], "cwd": str(proj),
                                                  "env": {name: value}})
            assert r.status_code == 422 and r.json()["detail"]["field"] == f"env.{name}", r.text
            assert "secret_env" in r.json()["detail"]["message"], r.text
            answers.append(r.text)
        assert c.get("/api/jobs").json()["total"] == 0, "nothing refused was stored"
        ok = c.post("/api/jobs/command", json={"command": [PY, "-c", "print(1)"], "env": {
            "TOKENIZERS_PARALLELISM": "false"}})
        assert ok.status_code == 201, ok.text  # not every name with TOKEN in it is a credential

        job = c.post("/api/jobs/command", json={"command": [PY, "leaky.py"], "cwd": str(proj),
                                                 "secret_env": ["TP_LEAK_SECRET"], "max_retries": 0}).json()
        answers.append(json.dumps(job))
        # every frame of the job, from before it is claimed to its end
        ws = srv.ws(f"jobs,alerts,job:{job['id']}").__enter__()
        stop = threading.Event()

        def listen():
            while not stop.is_set():
                try:
                    frames.append(ws.recv(timeout=0.5))
                except TimeoutError:
                    continue
                except Exception:
                    return
        t = threading.Thread(target=listen, daemon=True)
        t.start()
        srv.start_agent("cmd", "--allow-commands", env={"TP_LEAK_SECRET": value})
        done = srv.wait_job(job["id"], timeout=120)
        # the job's own final frame ends what there is to read (its alerts and log came before it)
        def final_frame():
            for f in list(frames):
                frame = json.loads(f)
                if frame.get("type") == "job" and frame["job"]["id"] == job["id"] and frame["job"]["state"] == "failed":
                    return True
        wait_for(final_frame, 60, "the job's final frame", every=0.1)
        stop.set()
        t.join(5)
        ws.close()
        assert done["state"] == "failed" and "leaky.py" in done["reason"] and "***" in done["reason"], done
        events = c.get(f"/api/jobs/{job['id']}/events?limit=100000").json()["events"]
        kinds = {e["kind"] for e in events}
        assert {"phase", "info", "checkpoint", "alert", "log", "state"} <= kinds, kinds
        metrics = c.get(f"/api/jobs/{job['id']}/metrics").text
        assert '"m_***' in metrics and '"loss"' in metrics, metrics[:500]  # its name masked, the point kept
        lines = [e["data"]["line"] for e in events if e["kind"] == "log"]
        assert any(x.startswith("plain: ***") for x in lines), lines[:5]
        assert any(x.startswith("z" * 20 + "***") for x in lines) or any("***" in x and "z" * 20 in x for x in lines)
        for path in (f"/api/jobs/{job['id']}", "/api/jobs", f"/api/jobs/{job['id']}/events?limit=100000",
                     f"/api/jobs/{job['id']}/metrics", "/api/alerts", f"/api/alerts?job_id={job['id']}", "/metrics"):
            r = c.get(path)
            assert r.status_code in (200, 403), (path, r.status_code)
            answers.append(r.text)
    assert frames, "the websocket carried the job's frames"
    assert not [(i, leaks(a, value)) for i, a in enumerate(answers) if leaks(a, value)]
    assert not [leaks(f, value) for f in frames if leaks(f, value)]
    srv.kill()
    journal = list((srv.data_dir.parent / "work-cmd" / "journal").glob("*"))
    assert not [p for p in journal if leaks(p.read_bytes(), value)], "the agent's journal holds it masked"
    db_files = list(srv.data_dir.glob("tokenpulse.db*"))
    blob = b"".join(f.read_bytes() for f in db_files)
    assert db_files and b"bad token ***" in blob
    assert not leaks(blob, value), leaks(blob, value)


def test_a_working_directory_swapped_for_a_symlink_after_submit_runs_nothing(server_factory, tmp_path):
    roots = tmp_path / "roots"
    proj = roots / "proj"
    proj.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    marker = tmp_path / "ran"
    script = f"open({str(marker)!r}, 'w').write(__import__('os').getcwd())\n"
    (proj / "run.py").write_text(script)
    (outside / "run.py").write_text(script)
    srv = server_factory(path_roots=[str(roots)])
    with srv.client() as c:
        job = c.post("/api/jobs/command", json={"command": [PY, "run.py"], "cwd": str(proj)})
        assert job.status_code == 201, job.text
        # after the submit (checked then), the directory becomes a link out of the roots
        (proj / "run.py").unlink()
        proj.rmdir()
        proj.symlink_to(outside, target_is_directory=True)
        srv.start_agent("cmd", "--allow-commands")
        done = srv.wait_job(job.json()["id"], timeout=60)
        assert done["state"] == "failed" and done["failure"] == "spec", done
        assert "outside the server's path roots" in done["reason"] and "nothing was run" in done["reason"], done
        assert str(outside.resolve()) in done["reason"], done
    assert not marker.exists(), "the command ran outside the roots"


def test_files_outside_the_roots_are_refused_unread_and_never_quoted(server_factory, tmp_path):
    roots = tmp_path / "roots"
    roots.mkdir()
    (roots / "ok.jsonl").write_text(json.dumps({"text": "hello", "label": 1}) + "\n")
    private = tmp_path / "private"
    private.mkdir()
    (private / "creds.csv").write_text("db_user,db_password\nadmin,hunter2hunter2\n")
    (private / "creds.jsonl").write_text(json.dumps({"db_user": "a", "db_password": "b"}) + "\n")
    (roots / "link.csv").symlink_to(private / "creds.csv")
    srv = server_factory(path_roots=[str(roots)])
    with srv.client() as c:
        for path in (private / "creds.csv", private / "creds.jsonl", roots / "link.csv",
                     f"{roots}/../private/creds.csv"):
            for url in ("/api/jobs", "/api/datasets/analyze"):
                r = c.post(url, json={"dataset": str(path), "text_field": "nope"})
                assert r.status_code == 422 and r.json()["detail"]["field"] == "dataset", r.text
                assert "outside the allowed roots" in r.text and "db_password" not in r.text, r.text
        r = c.post("/api/jobs", json={"dataset": str(roots / "ok.jsonl"), "text_field": "nope"})
        assert r.status_code == 422 and "it has: text, label" in r.text, r.text  # inside: listed
    # without roots the server reads what a submit names (single machine), but quotes none of it
    srv2 = server_factory()
    with srv2.client() as c:
        for path in (private / "creds.csv", private / "creds.jsonl"):
            r = c.post("/api/jobs", json={"dataset": str(path), "text_field": "nope"})
            assert r.status_code == 422 and r.json()["detail"]["field"] == "text_field", r.text
            assert "db_password" not in r.text and "db_user" not in r.text and "TOKENPULSE_PATH_ROOTS" in r.text, r.text
        r = c.post("/api/jobs", json={"dataset": str(private / "creds.jsonl")})
        assert r.status_code == 422 and "db_password" not in r.text, r.text


def test_hub_side_names_are_validated_like_model_ids(server):
    with server.client() as c:
        for field in ("dataset_config", "dataset_split", "revision", "dataset_revision"):
            for bad in ("../../../../etc", "\x00", "/etc/passwd", "a/../b"):
                r = c.post("/api/jobs", json={"dataset": "org/data", field: bad})
                assert r.status_code == 422 and r.json()["detail"]["field"] == field, (field, bad, r.text)
        assert c.get("/api/jobs").json()["total"] == 0


def analyze_children(server_pid: int) -> int:
    n = 0
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat_ = (p / "stat").read_text()
            cmd = (p / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat_.rsplit(")", 1)[1].split()[1]) == server_pid and b"worker.training.analyze" in cmd:
            n += 1
    return n


def test_concurrent_analyses_are_bounded_and_a_caller_over_its_share_gets_429(server_factory, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"example {i} " * (i % 7 + 1)}) + "\n" for i in range(50)))
    srv = server_factory(analysis_slots=1, analyses_per_user=2)
    users = []
    with srv.client() as c:
        for name in ("u1", "u2"):
            made = c.post("/api/tokens", json={"name": name, "role": "user"})
            assert made.status_code == 201, made.text
            users.append(made.json()["token"])
    results: list = []
    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], analyze_children(srv.proc.pid))
            time.sleep(0.05)

    def ask(token, i):
        with httpx.Client(base_url=srv.url, timeout=120, headers={"Authorization": f"Bearer {token}"}) as c:
            r = c.post("/api/datasets/analyze", json={"dataset": str(data), "max_seq_length": 16 + i})
            results.append((token, r.status_code, r.headers.get("retry-after"), r.text[:300]))

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    threads = [threading.Thread(target=ask, args=(users[0 if i < 3 else 1], i)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    stop.set()
    w.join(5)
    codes = sorted(r[1] for r in results)
    assert codes.count(200) == 3 and codes.count(429) == 1, results  # 2 places per caller
    assert [r[0] for r in results if r[1] == 429] == [users[0]], results
    assert all(r[2] and int(r[2]) > 0 for r in results if r[1] == 429), results
    assert all("at most 2" in r[3] for r in results if r[1] == 429), results
    assert peak[0] == 1, f"{peak[0]} analysis children at once (1 slot: never 0, never 2)"


def test_data_dir_database_and_backups_are_private(server_factory, tmp_path):
    srv = server_factory()
    with srv.client() as c:
        c.post("/api/jobs", json={"name": "x"}).raise_for_status()
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(srv.data_dir) == 0o700
    for p in srv.data_dir.glob("tokenpulse.db*"):
        assert mode(p) == 0o600, (p, oct(mode(p)))
    assert {p.name for p in srv.data_dir.glob("tokenpulse.db*")} >= {"tokenpulse.db", "tokenpulse.db-wal"}
    out = tmp_path / "backup.db"
    r = subprocess.run([PY, "-m", "tokenpulse.cli", "db", "backup", str(out), "--data-dir", str(srv.data_dir)],
                       env=srv.env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert mode(out) == 0o600


def test_metrics_labels_come_from_a_fixed_set(server):
    """One external job raising 50 alerts of made-up kinds adds one series ("other"), not 50."""
    with server.client() as c:
        made = c.post("/api/jobs/external", json={"name": "ext"})
        assert made.status_code == 201, made.text
        job_id, cred = made.json()["id"], made.json()["report_token"]
        evs = [{"kind": "alert", "job_id": job_id, "seq": i, "t": time.time(),
                "data": {"kind": f"kind-{i}", "message": "x"}} for i in range(50)]
        with httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {cred}"}) as ext:
            ext.post(f"/api/jobs/{job_id}/events", json={"events": evs}).raise_for_status()
        text = c.get("/metrics").text
    rows = [line for line in text.splitlines() if line.startswith("tokenpulse_open_alerts{")]
    kinds = {line.split('kind="')[1].split('"')[0] for line in rows}
    assert kinds == {"other"} and rows[0].endswith(" 50.0"), rows


def test_a_dripping_hub_times_out_its_own_submits_and_holds_no_other(server_factory, tmp_path, monkeypatch):
    """A Hub endpoint that answers one byte a second: each submit naming a Hub repo fails on its own
    deadline; builtin and command submits, made meanwhile, never wait on it."""
    import http.server
    import socketserver

    class Drip(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "100000")
            self.end_headers()
            try:
                for _ in range(120):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(1)
            except OSError:
                pass

    hub = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Drip)
    hub.daemon_threads = True
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{hub.server_address[1]}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    srv = server_factory(hub_check_timeout_s=3)
    results: dict = {}

    def post(key, path, body):
        t0 = time.monotonic()
        with srv.client() as c:
            r = c.post(path, json=body)
        results[key] = (r.status_code, time.monotonic() - t0, r.text[:300])

    try:
        hubs = [threading.Thread(target=post, args=(f"hub{i}", "/api/jobs", {"model": f"org/slow-model-{i}"}))
                for i in range(8)]  # more than any thread pool the checks could share
        for t in hubs:
            t.start()
        time.sleep(0.5)
        post("builtin", "/api/jobs", {"name": "builtin"})
        post("command", "/api/jobs/command", {"command": [PY, "-c", "print(1)"]})
        for t in hubs:
            t.join(60)
    finally:
        hub.shutdown()
    assert results["builtin"][0] == 201 and results["builtin"][1] < 2.5, results["builtin"]
    assert results["command"][0] == 201 and results["command"][1] < 2.5, results["command"]
    for i in range(8):
        code, took, text = results[f"hub{i}"]
        assert code == 422 and '"field":"model"' in text.replace(" ", "") and "did not answer" in text, text
        assert took < 10, (i, took)


def test_webhook_logs_name_the_receiver_host_never_its_secret_path(caplog):
    """A Slack/Discord webhook URL's path is its credential: delivery failures are logged with the
    host only (a refused one, one that times out, one that cannot be reached)."""
    import asyncio
    import logging
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from server.webhooks import Webhooks
    from tests.conftest import free_port

    class Refuses(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(404)
            self.end_headers()

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Refuses)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    secret = "T0123/B4567/abcdefSECRETxyz"
    refused = f"http://127.0.0.1:{httpd.server_port}/services/{secret}"
    unreachable = f"http://127.0.0.1:{free_port()}/services/{secret}"

    async def run():
        wh = Webhooks([refused, unreachable], timeout_s=1.0, retries=1, backoff_s=0.05)
        wh.start()
        wh.send({"id": 1, "job_id": 1, "kind": "slow", "severity": "warning", "state": "open", "message": "m"})
        deadline = time.monotonic() + 60
        while wh.failed < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await wh.stop()
        return wh

    try:
        with caplog.at_level(logging.INFO, logger="tokenpulse.webhooks"):
            wh = asyncio.run(run())
    finally:
        httpd.shutdown()
    assert wh.failed == 2
    text = caplog.text
    assert f"127.0.0.1:{httpd.server_port}/..." in text and "giving up" in text and "refused" in text
    assert secret not in text and "SECRET" not in text, text
