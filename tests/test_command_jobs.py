"""Command jobs: your own script run as a job on an agent (issue 12, item 1). Real server, real agent
processes, real scripts written into tmp_path; the output folding is also tested on real tqdm output."""
from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path

import pytest
from conftest import ROOT, wait_exit, wait_for

from worker.agent.output import LineFolder, Masker, last_traceback_frame

PY = sys.executable


def write(path: Path, code: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(code))
    return path


def logs(c, job_id: int) -> list[dict]:
    return [e["data"] for e in c.get(f"/api/jobs/{job_id}/events",
                                     params={"kinds": "log", "limit": 10000}).json()["events"]]


def submit(c, **spec) -> dict:
    r = c.post("/api/jobs/command", json=spec)
    assert r.status_code == 201, r.text
    return r.json()


def cli_env(srv) -> dict:
    # PYTHONPATH: the CLI runs in the project's directory, where this checkout is not on sys.path
    return {**srv.env, "TOKENPULSE_URL": srv.url, "TOKENPULSE_TOKEN": srv.token, "PYTHONPATH": str(ROOT)}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie nobody reaped yet is as good as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


# ---- output folding: pure logic on real progress-bar output ---------------------------------------

def tqdm_output(n: int = 1000, **kw) -> bytes:
    from tqdm import tqdm
    buf = io.StringIO()
    print("loading", file=buf)
    for _ in tqdm(range(n), file=buf, mininterval=0, miniters=1, desc="train", ascii=False, **kw):
        pass
    print("done", file=buf)
    return buf.getvalue().encode()


def feed_in_chunks(folder: LineFolder, raw: bytes, chunk: int, dt: float) -> list[str]:
    out, t = [], 0.0
    for i in range(0, len(raw), chunk):
        out += folder.feed(raw[i:i + chunk], t)
        t += dt
    return out + folder.close()


def test_fold_real_tqdm_redraws_into_one_line_per_final_state():
    raw = tqdm_output(1000)
    assert raw.count(b"\r") >= 1000  # really redrawn a thousand times
    # Chunks of 7 bytes split the bar's multi-byte block characters: decoded across chunks.
    lines = feed_in_chunks(LineFolder(snapshot_s=10), raw, chunk=7, dt=0.0001)
    assert len(lines) == 3, lines
    assert lines[0] == "loading" and lines[2] == "done"
    assert "1000/1000" in lines[1] and "100%" in lines[1] and "\ufffd" not in lines[1]


def test_fold_throttles_a_long_redraw_without_newline():
    raw = tqdm_output(1000)
    # The same bar drawn over ~100 s (0.1 s per 64-byte chunk): a snapshot at most every 10 s, each
    # a complete redraw, never the same twice; the final state once.
    lines = feed_in_chunks(LineFolder(snapshot_s=10), raw, chunk=64, dt=0.1)
    bars = [x for x in lines if x.startswith("train")]
    assert 5 <= len(bars) <= 12, bars
    assert len(set(bars)) == len(bars)
    assert all("it/s]" in b or "?it/s]" in b for b in bars), bars  # no half-drawn snapshot
    assert "1000/1000" in bars[-1]
    # quiet output: tick() logs the pending state once after snapshot_s, and not again unchanged
    f = LineFolder(snapshot_s=10)
    assert f.feed(b"\rstep 5/10", 0.0) == []
    assert f.tick(5.0) == [] and f.tick(10.5) == ["step 5/10"] and f.tick(30.0) == []
    assert f.feed(b"\rstep 5/10\n", 31.0) == []  # already logged: not twice
    assert f.feed(b"plain\r\n", 32.0) == ["plain"]  # CRLF line endings are not redraws


def test_fold_edge_cases():
    f = LineFolder()
    # a bar cleared by its program (tqdm leave=False) leaves its last drawn state, not blanks
    assert f.feed(b"\rbar 1\rbar 2\r     \r", 0) == []
    assert f.feed(b"next\n", 0) == ["next"]
    assert f.feed(b"\rbar 3\r      \r\n", 0) == ["bar 3"]
    assert f.feed(b"\n", 0) == [""]  # an empty line printed on purpose stays
    # a very long line without newline is cut, not buffered without bound
    g = LineFolder(max_line=100)
    out = g.feed(b"x" * 250, 0) + g.close()
    assert [len(x) for x in out] == [100, 100, 50]
    assert LineFolder().feed("caf\u00e9 ok\n".encode()[:4], 0) == []  # half a character waits


def test_mask_and_traceback_frame():
    m = Masker(["hf_abcdef123", "", "x"])
    assert m("token=hf_abcdef123 x") == "token=*** x"
    try:
        def main():
            raise ValueError("bad learning rate 1e9")
        main()
    except ValueError:
        lines = traceback.format_exc().splitlines()
    here = Path(__file__)
    frame = last_traceback_frame(["noise"] + lines + ["after: more output"], str(here.parent))
    assert frame is not None and frame.startswith(f"{here.name}:") and frame.endswith(
        "in main: ValueError: bad learning rate 1e9"), frame
    assert last_traceback_frame(["no traceback here"]) is None


# ---- real jobs ---------------------------------------------------------------------------------

PROGRESS = """
    import os, sys, time
    from tqdm import tqdm
    print("setting", os.environ["MY_SETTING"], "job", os.environ["TOKENPULSE_JOB_ID"], "cwd", os.getcwd())
    for i in range(1, 501):
        sys.stdout.write(f"\\rstep {i}/500")
        sys.stdout.flush()
    sys.stdout.write("\\n")
    for _ in tqdm(range(1000), mininterval=0, miniters=1, desc="epoch"):
        pass
    print("finished", flush=True)
"""

FAIL = """
    import sys
    print("about to fail", flush=True)

    def main():
        lr = float(sys.argv[1])
        raise ValueError(f"learning rate {lr} is too high")

    if __name__ == "__main__":
        main()
"""


def test_command_job_completes_folded_fails_with_frame_and_is_confined(server_factory, tmp_path):
    roots = tmp_path / "roots"
    proj = roots / "proj"
    write(proj / "progress.py", PROGRESS)
    write(proj / "fail.py", FAIL)
    (roots / "afile").write_text("x")
    srv = server_factory(path_roots=[str(roots)])
    srv.start_agent("cmd", "--allow-commands")
    with srv.client() as c:
        schema = c.get("/openapi.json").json()
        assert "post" in schema["paths"]["/api/jobs/command"], "OpenAPI shows the command endpoint"

        # confinement: the working directory must lie under path_roots and be a directory
        for cwd, words in [(str(tmp_path), "outside the allowed roots"), (f"{roots}/../", "outside"),
                           (str(roots / "missing"), "does not exist"), (str(roots / "afile"), "not a directory")]:
            r = c.post("/api/jobs/command", json={"command": ["true"], "cwd": cwd})
            assert r.status_code == 422, r.text
            assert r.json()["detail"]["field"] == "cwd" and words in r.text, r.text
        for body, field in [({"command": []}, "command"), ({"command": "python 'unclosed"}, "command"),
                            ({"command": ["x"], "env": {"BAD NAME": "1"}}, "env"),
                            ({"command": ["x"], "secret_env": ["TOKENPULSE_AGENT_TOKEN"]}, "secret_env"),
                            ({"command": ["x"], "stall": {"floor_s": "Infinity"}}, "stall.floor_s"),
                            ({"command": ["x"], "extra": 1}, "extra")]:
            r = c.post("/api/jobs/command", json=body)
            assert r.status_code == 422 and r.json()["detail"]["field"] == field, (body, r.text)

        ok = submit(c, command=[PY, "progress.py"], cwd=str(proj), env={"MY_SETTING": "42"})
        assert ok["kind"] == "command" and ok["name"].endswith("progress.py"), ok
        bad = submit(c, command=f"{PY} fail.py 1e9", cwd=str(proj), max_retries=3)

        job = srv.wait_job(ok["id"], timeout=120)
        assert job["state"] == "completed" and job["exit_code"] == 0, job
        assert job["spec"]["command"] == [PY, "progress.py"] and job["spec"]["cwd"] == str(proj.resolve())
        assert job["spec"]["env"] == {"MY_SETTING": "42"}
        lines = logs(c, ok["id"])
        out = [x["line"] for x in lines if x["stream"] in ("stdout", "stderr")]
        assert f"setting 42 job {ok['id']} cwd {proj.resolve()}" in out, out
        assert out.count("step 500/500") == 1, out
        assert not any(x.startswith("step") and x != "step 500/500" for x in out), out
        bars = [x for x in out if x.startswith("epoch")]
        assert len(bars) == 1 and "1000/1000" in bars[0], bars  # 1,000 redraws, one line
        assert "finished" in out
        assert len(out) <= 6, out  # not one line per redraw

        job = srv.wait_job(bad["id"], timeout=120)
        assert job["state"] == "failed" and job["failure"] == "error" and job["exit_code"] == 1, job
        assert job["reason"].startswith("fail.py:7 in main: ValueError: learning rate 1000000000.0 is too "
                                        "high"), job["reason"]
        assert len(job["attempts"]) == 1, "a script's own error is not retried"
        alerts = c.get("/api/alerts", params={"job_id": bad["id"]}).json()
        assert any(a["kind"] == "crashed" and "fail.py:7 in main" in a["message"] for a in alerts), alerts
        # the traceback is shown once (the reason box), not again in the alert (issue 25, item 3)
        crashed = next(a for a in alerts if a["kind"] == "crashed")
        assert "Traceback" not in crashed["message"] and "\n" not in crashed["message"], crashed["message"]
        assert "last output" in job["reason"], job["reason"]  # ... which keeps it

        # clone / retry of a command job is a command job
        again = c.post(f"/api/jobs/{bad['id']}/clone", json={"changes": {"command": [PY, "fail.py", "2"]}})
        assert again.status_code == 201 and again.json()["kind"] == "command", again.text
        c.post(f"/api/jobs/{again.json()['id']}/cancel")

    # the CLI, as a person types it in their project directory: follows to the end, exit status 0
    env = cli_env(srv)
    cli = subprocess.run([PY, "-m", "tokenpulse.cli", "run", "--name", "from-cli", "--env", "MY_SETTING=7",
                          "--follow", "--", PY, "progress.py"], cwd=proj, env=env, capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "completed" in cli.stdout and "from-cli" in cli.stdout, cli.stdout


SLEEPER = """
    import os, signal, subprocess, sys, time
    marker = sys.argv[1]
    child = subprocess.Popen(["sleep", "1000"])
    open(marker + ".pids", "w").write(f"{os.getpid()} {child.pid}")
    if sys.argv[2] == "ignore":
        def note(sig, frame):
            open(marker, "a").write("SIGTERM ignored\\n")
        signal.signal(signal.SIGTERM, note)
    print("ready", flush=True)
    while True:
        time.sleep(1000)
"""


def test_cancel_stops_a_command_sigterm_then_sigkill_and_pause_is_refused(server_factory, tmp_path):
    proj = tmp_path / "proj"
    write(proj / "sleeper.py", SLEEPER)
    srv = server_factory()
    srv.start_agent("cmd", "--allow-commands")  # --grace 5 (conftest)
    env = cli_env(srv)
    with srv.client() as c:
        # A script that ignores SIGTERM: followed from the CLI; Ctrl+C stops following, not the job.
        cli = subprocess.Popen([PY, "-m", "tokenpulse.cli", "run", "-f", "--", PY, "sleeper.py", str(proj / "m1"),
                                "ignore"],
                               cwd=proj, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_for(lambda: (proj / "m1.pids").exists(), 60, "the first sleeper to start")
        job_id = c.get("/api/jobs").json()["jobs"][0]["id"]
        wait_for(lambda: any(x["line"] == "ready" for x in logs(c, job_id)), 30, "its output")
        cli.send_signal(signal.SIGINT)
        wait_exit(cli, 60, "`tokenpulse run -f` after Ctrl+C")
        out = cli.communicate()[0]
        assert f"job {job_id} keeps running" in out and f"tokenpulse cancel {job_id}" in out, out
        assert c.get(f"/api/jobs/{job_id}").json()["state"] == "running"

        r = c.post(f"/api/jobs/{job_id}/pause")
        assert r.status_code == 409 and "cannot pause" in r.text and "Cancel it instead" in r.text, r.text

        pid, child = map(int, (proj / "m1.pids").read_text().split())
        t0 = time.time()
        assert c.post(f"/api/jobs/{job_id}/cancel").status_code == 200
        job = srv.wait_job(job_id, timeout=60)
        took = time.time() - t0
        assert job["state"] == "cancelled" and job["signal"] == "SIGKILL", job
        assert "SIGTERM ignored" in (proj / "m1").read_text()  # asked first...
        assert took >= 4, took  # ...and killed only after the grace period
        assert not alive(pid) and not alive(child), "the whole process group is gone"

        # A script that obeys SIGTERM stops at once, with its child.
        j2 = submit(c, command=[PY, "sleeper.py", str(proj / "m2"), "obey"], cwd=str(proj))
        wait_for(lambda: (proj / "m2.pids").exists() and any(x["line"] == "ready" for x in logs(c, j2["id"])),
                 60, "the second sleeper to start")
        pid, child = map(int, (proj / "m2.pids").read_text().split())
        assert c.post(f"/api/jobs/{j2['id']}/cancel").status_code == 200
        job = srv.wait_job(j2["id"], timeout=30)
        assert job["state"] == "cancelled" and job["signal"] == "SIGTERM", job
        assert not alive(pid) and not alive(child)


def test_only_agents_that_opted_in_take_command_jobs(server_factory, tmp_path):
    proj = tmp_path / "proj"
    write(proj / "hello.py", 'print("hello from a command job")\n')
    srv = server_factory()
    srv.start_agent("plain")
    with srv.client() as c:
        wait_for(lambda: c.get("/api/agents").json(), 30, "the plain agent to register")
        plain = c.get("/api/agents").json()[0]
        assert plain["accepts_commands"] is False
        cmd = submit(c, command=[PY, "hello.py"], cwd=str(proj), priority=10)
        assert "--allow-commands" in cmd["reason"], cmd  # says what it waits for
        # A training job queued after it, lower priority: the plain agent claims that one, skipping
        # the command job it may not run.
        train = c.post("/api/jobs", json={"name": "train", "max_steps": 1000}).json()
        wait_for(lambda: c.get(f"/api/jobs/{train['id']}").json()["state"] in ("starting", "running"), 60,
                 "the plain agent to claim the training job")
        assert c.get(f"/api/jobs/{cmd['id']}").json()["state"] == "queued"
        c.post(f"/api/jobs/{train['id']}/cancel")
        srv.wait_job(train["id"], timeout=60)
        # Idle now, polling every second: still it never takes the command job.
        seen = c.get("/api/agents").json()[0]["seen_at"]
        wait_for(lambda: c.get("/api/agents").json()[0]["seen_at"] > seen + 2, 30, "the plain agent to poll again")
        assert c.get(f"/api/jobs/{cmd['id']}").json()["state"] == "queued"

        srv.start_agent("cmd", "--allow-commands")
        job = srv.wait_job(cmd["id"], timeout=60)
        assert job["state"] == "completed", job
        agents = {a["name"]: a for a in c.get("/api/agents").json()}
        assert agents["cmd"]["accepts_commands"] is True
        assert job["attempts"][0]["agent_id"] == agents["cmd"]["id"]
        assert any(x["line"] == "hello from a command job" for x in logs(c, cmd["id"]))


def test_commands_need_a_token_with_the_commands_scope(server):
    with server.client() as c:
        assert "commands" in c.get("/api/tokens").json()[0]["scopes"], "the initial admin token may"
        plain = c.post("/api/tokens", json={"name": "viewer", "role": "user"}).json()
        assert plain["scopes"] == []
        r = c.post("/api/tokens", json={"name": "bad", "role": "metrics", "allow_commands": True})
        assert r.status_code == 422 and r.json()["detail"]["field"] == "allow_commands", r.text
        job = submit(c, command=["true"])
    with server.client(plain["token"]) as p:
        r = p.post("/api/jobs/command", json={"command": ["true"]})
        assert r.status_code == 403 and "commands" in r.text and "--allow-commands" in r.text, r.text
        r = p.post(f"/api/jobs/{job['id']}/clone", json={"changes": {}})
        assert r.status_code == 403 and "clone refused" in r.text, r.text  # not its job (test_roles.py: nor its right)
        # it cannot grant itself the right through a new token either
        r = p.post("/api/tokens", json={"name": "escalate", "role": "user", "allow_commands": True})
        assert r.status_code == 403, r.text
        assert p.post("/api/jobs", json={"name": "training is fine"}).status_code == 201
    with server.client(server.agent_token) as a:
        assert a.post("/api/jobs/command", json={"command": ["true"]}).status_code == 403
    env = {**server.env, "TOKENPULSE_URL": server.url, "TOKENPULSE_TOKEN": server.token}
    out = subprocess.run([PY, "-m", "tokenpulse.cli", "tokens", "create", "ci", "--role", "user", "--allow-commands"],
                         env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "may submit command jobs" in out.stdout, out.stdout + out.stderr
    token = re.search(r"tpu_[\w-]+", out.stdout).group(0)
    with server.client(token) as t:
        assert t.post("/api/jobs/command", json={"command": ["true"]}).status_code == 201


SECRETIVE = """
    import hashlib, os, sys
    value = os.environ["TP_TEST_SECRET"]
    print("digest", hashlib.sha256(value.encode()).hexdigest())
    print("the secret is", value, flush=True)
    print("stderr has it too:", value, file=sys.stderr, flush=True)
    print("plain", os.environ.get("PLAIN"), "unnamed key", os.environ.get("OTHER_API_KEY"),
          "tokenpulse vars", sorted(k for k in os.environ if k.startswith("TOKENPULSE_")), flush=True)
    raise RuntimeError(f"refusing to train with {value}")
"""


def test_secret_env_values_never_reach_the_server(server_factory, tmp_path):
    value = "tp-secret-" + secrets.token_hex(16)
    proj = tmp_path / "proj"
    write(proj / "secretive.py", SECRETIVE)
    srv = server_factory()
    srv.start_agent("cmd", "--allow-commands", env={"TP_TEST_SECRET": value, "OTHER_API_KEY": "not-passed-on"})
    answers = []
    with srv.client() as c:
        job = submit(c, command=[PY, "secretive.py"], cwd=str(proj), env={"PLAIN": "visible"},
                     secret_env=["TP_TEST_SECRET"])
        answers.append(json.dumps(job))
        done = srv.wait_job(job["id"], timeout=60)
        assert done["state"] == "failed" and "secretive.py:" in done["reason"] and "***" in done["reason"], done
        out = [x["line"] for x in logs(c, job["id"])]
        digest = hashlib.sha256(value.encode()).hexdigest()
        assert f"digest {digest}" in out, "the script got the value"
        assert "the secret is ***" in out and "stderr has it too: ***" in out, out
        line = next(x for x in out if x.startswith("plain "))
        assert line.startswith("plain visible unnamed key None tokenpulse vars "), line
        seen = set(ast.literal_eval(line.split("tokenpulse vars ", 1)[1]))
        # the job's id and event pipe (the instrumentation adds the pipe's identity), its tree's tag and
        # its agent's pid (worker/agent/keeper.py), the file its agent announces a cancel in
        # (tokenpulse/control.py); never a token
        assert {"TOKENPULSE_EVENT_FD", "TOKENPULSE_JOB_ID", "TOKENPULSE_JOB_TREE"} <= seen <= {
            "TOKENPULSE_EVENT_FD", "TOKENPULSE_JOB_ID", "TOKENPULSE_EVENT_PIPE_ID", "TOKENPULSE_EVENT_PIPE_PATH",
            "TOKENPULSE_JOB_TREE", "TOKENPULSE_AGENT_PID", "TOKENPULSE_CONTROL_FILE"}, seen
        for path in (f"/api/jobs/{job['id']}", "/api/jobs", f"/api/jobs/{job['id']}/events?limit=100000",
                     "/api/alerts", "/api/agents", "/api/tokens"):
            r = c.get(path)
            assert r.status_code == 200
            answers.append(r.text)
        assert json.loads(answers[1])["spec"]["secret_env"] == ["TP_TEST_SECRET"]  # the name is shown
        # a secret the worker does not have: refused at start, naming it, not retried
        missing = submit(c, command=[PY, "secretive.py"], cwd=str(proj), secret_env=["TP_NOT_SET_ANYWHERE"])
        done = srv.wait_job(missing["id"], timeout=60)
        assert done["state"] == "failed" and done["failure"] == "spec" and "TP_NOT_SET_ANYWHERE" in done["reason"], done
        assert len(done["attempts"]) == 1
    assert not any(value in a for a in answers)
    srv.kill()  # the database files, checkpointed and closed
    db_files = list(srv.data_dir.glob("tokenpulse.db*"))
    assert db_files and not any(value.encode() in f.read_bytes() for f in db_files)
    assert b"refusing to train with ***" in b"".join(f.read_bytes() for f in db_files)


# ---- the browser -------------------------------------------------------------------------------

CHROMIUM = os.environ.get("TOKENPULSE_CHROMIUM", "/usr/bin/chromium")  # as tests/test_ui.py
CHROMEDRIVER = os.environ.get("TOKENPULSE_CHROMEDRIVER", "/usr/bin/chromedriver")


@pytest.mark.skipif(not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()),
                    reason="needs Debian's chromium and chromedriver (make browser)")
def test_browser_command_mode_submits_and_job_page_shows_the_command(server_factory, tmp_path):
    ui = pytest.importorskip("test_ui")  # its driver, login and screenshot helpers (selenium)
    from selenium.webdriver.common.by import By
    roots = tmp_path / "roots"
    write(roots / "proj" / "hello.py",
          'import os\nprint("hello", os.environ["GREETING"], len(os.environ["TP_UI_SECRET"]))\n')
    srv = server_factory(path_roots=[str(roots)])
    srv.start_agent("cmd", "--allow-commands", env={"TP_UI_SECRET": "ui-secret-value"})
    d = ui.make_driver()
    try:
        ui.login(d, srv)
        d.get(srv.url + "/submit")
        d.find_element(By.CSS_SELECTOR, 'input[name="job-mode"][value="command"]').click()
        assert not ui.attr(d, "#command-form", "hidden")
        assert ui.attr(d, "#submit-form", "hidden")  # the training form steps aside
        d.find_element(By.ID, "c-command").send_keys(f"{PY} hello.py")
        d.find_element(By.ID, "c-cwd").send_keys(str(tmp_path))  # outside the roots: refused, by the field
        d.find_element(By.ID, "c-env").send_keys("GREETING=from the browser")
        d.find_element(By.ID, "c-secret-env").send_keys("TP_UI_SECRET")
        d.find_element(By.ID, "command-submit").click()
        err = ui.wait(d, 15).until(lambda d: d.find_elements(By.ID, "c-cwd-error"))[0]
        assert "outside the allowed roots" in err.text
        ui.shot(d, "submit-command-error")
        cwd = d.find_element(By.ID, "c-cwd")
        cwd.clear()
        cwd.send_keys(str(roots / "proj"))
        d.find_element(By.ID, "command-submit").click()
        ui.wait(d, 15).until(lambda d: "/jobs/" in d.current_url)
        ui.wait(d, 90).until(lambda d: d.find_element(By.ID, "job-state").text == "completed")
        # the log's text as stored in the page (read in one step), whether or not it is scrolled into view
        ui.wait(d, 60).until(lambda d: "hello from the browser 15" in (ui.attr(d, "#log", "textContent") or ""))
        box = d.find_element(By.ID, "command-box")
        assert box.is_displayed()
        assert d.find_element(By.ID, "command-line").text == f"{PY} hello.py"
        assert "GREETING=from the browser" in box.text and "TP_UI_SECRET" in box.text
        assert "ui-secret-value" not in d.page_source
        ui.shot(d, "job-command", full=True)
        # Clone & edit opens the Command form filled in
        d.get(srv.url + "/submit?clone=" + d.current_url.rsplit("/", 1)[1])
        ui.wait(d, 15).until(lambda d: ui.attr(d, "#c-command", "value") == f"{PY} hello.py")
        assert ui.attr(d, "#c-env", "value") == "GREETING=from the browser"
        assert ui.attr(d, "#c-secret-env", "value") == "TP_UI_SECRET"
        ui.shot(d, "submit-command", full=True)
    finally:
        d.quit()


def test_migration_gives_the_initial_user_token_the_commands_scope(tmp_path):
    """An installation from before command jobs: after the upgrade its first-start user token may
    submit them (one machine keeps just working); every other token may not."""
    import sqlite3

    from alembic import command

    from server.db import alembic_config, upgrade_to_head
    url = f"sqlite:///{tmp_path / 'old.db'}"
    command.upgrade(alembic_config(url), "0003")
    with sqlite3.connect(tmp_path / "old.db") as db:
        db.executemany("INSERT INTO tokens (name, role, hash, created_at) VALUES (?, ?, ?, 0)",
                       [("initial user", "user", "h1"), ("initial agent", "agent", "h2"), ("alice", "user", "h3")])
        db.execute("INSERT INTO jobs (name, state, spec, priority, created_at, attempt, next_seq) "
                   "VALUES ('old', 'completed', '{}', 0, 0, 1, 0)")
    upgrade_to_head(url)
    with sqlite3.connect(tmp_path / "old.db") as db:
        # and since 0009 (roles): the first user token is the admin; agent tokens keep taking command
        # and multi-node jobs, as any agent could before roles
        assert {n: (r, sc) for n, r, sc in db.execute("SELECT name, role, scopes FROM tokens")} == {
            "initial user": ("admin", "commands"), "initial agent": ("agent", "commands gang"), "alice": ("user", "")}
        assert db.execute("SELECT kind FROM jobs").fetchone() == ("train",)


def test_python_in_a_command_is_the_one_beside_the_agent(server_factory, tmp_path):
    """`tokenpulse run -- python train.py`: python resolves to the agent's own environment (where
    torch, transformers and the instrumentation live), even when the agent's PATH lacks its venv."""
    srv = server_factory()
    bare_path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                                if Path(p).resolve() != Path(sys.executable).parent.resolve())
    srv.start_agent("cmd", "--allow-commands", env={"PATH": bare_path})
    with srv.client() as c:
        jid = submit(c, command=["python", "-c", "import sys; print('interpreter', sys.executable)"],
                     cwd=str(tmp_path))["id"]
        job = srv.wait_job(jid, timeout=120)
        assert job["state"] == "completed", job
        line = next(x["line"] for x in logs(c, jid) if x["line"].startswith("interpreter "))
        assert Path(line.split(" ", 1)[1]).parent == Path(sys.executable).parent, line
        # a job that sets PATH itself decides
        jid = submit(c, command=["sh", "-c", "echo path $PATH"],
                     env={"PATH": bare_path}, cwd=str(tmp_path))["id"]
        job = srv.wait_job(jid, timeout=120)
        assert job["state"] == "completed", (job, logs(c, jid))
        assert f"path {bare_path}" in [x["line"] for x in logs(c, jid)], logs(c, jid)
