"""Issue 22 (1, 4): system metrics from a command job's first seconds, charted on the job page and
summarised on the workers page; its log (control codes dropped, bounded by log_max_bytes) searched
and downloaded in the browser, through the API and the CLI. Real server, agent, command, Chromium."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from conftest import ROOT, wait_for
from selenium.webdriver.common.by import By
from test_ui import attr, browser, console_errors, login, shot, text, until  # noqa: F401 (browser: a fixture)

from worker.agent.slow import SlowDetector

SCRIPT = textwrap.dedent("""
    import os, sys, time
    print("\\x1b[32mstarting\\x1b[0m", flush=True)
    for i in range(3):  # tqdm's nested bars: cursor-up between lines
        sys.stdout.write(f"\\x1b[Aouter {i}\\x1b[A\\x1b[2Kinner {i}\\n")
    for i in range(1500):  # ~150 KB of log: over the bound (64 KiB), so the oldest lines go
        print(f"filler line {i:05d} " + "x" * 80)
    sys.stdout.flush()
    end = time.time() + float(sys.argv[1])
    n = 0
    with open("scratch.bin", "wb") as f:
        while time.time() < end:  # busy on a CPU, writing to disk
            n += sum(range(200000))
            f.write(b"\\0" * 65536)
            if n % 7 == 0:
                f.flush()
                os.fsync(f.fileno())
    print("needle found at the end", flush=True)
""")


def test_system_metrics_and_logs(server_factory, browser, tmp_path):
    server = server_factory(log_max_bytes=65536)
    server.start_agent("sys", "--allow-commands")
    work = tmp_path / "work"
    work.mkdir()
    (work / "busy.py").write_text(SCRIPT)
    with server.client() as c:
        r = c.post("/api/jobs/command", json={"command": [sys.executable, "busy.py", "14"], "cwd": str(work),
                                              "name": "busy", "instrument": False})
        assert r.status_code == 201, r.text
        jid = r.json()["id"]
        job = wait_for(lambda: (j := c.get(f"/api/jobs/{jid}").json())["started_at"] and j, 90, "job started")

        def sys_series():
            s = c.get(f"/api/jobs/{jid}/metrics", params={"prefix": "sys/"}).json()["series"]
            return s if "sys/cpu_pct" in s and s["sys/cpu_pct"]["t"] else None
        series = wait_for(sys_series, 30, "sys/ metrics")
        # from its first seconds: the first sample about a second after the start
        first_t = series["sys/cpu_pct"]["t"][0]
        assert first_t - job["started_at"] < 4.0, (first_t, job["started_at"])
        assert {"sys/rss_mb", "sys/disk_write_mbps", "sys/host_cpu_pct",
                "sys/host_mem_pct"} <= set(series), series.keys()
        assert all(k.startswith("sys/") for k in series)
        assert series["sys/rss_mb"]["value"][0] > 1  # a Python process holds megabytes
        # system samples are not the job's step or its latest metrics
        j = c.get(f"/api/jobs/{jid}").json()
        assert not any(k.startswith("sys/") for k in j["last"]) and (j["step"] or 0) < 10**6, j
        # the workers page's machine summary (the agent posts it every 5 s)
        agent = wait_for(lambda: next((a for a in c.get("/api/agents").json() if a["system"]), None), 30,
                         "machine sample")
        assert agent["system"]["cores"] >= 1 and agent["system"]["mem_total_mb"] > 0 and agent["system"]["gpus"] == []

        # the job page's System panels
        login(browser, server)
        d = browser
        d.get(f"{server.url}/jobs/{jid}")
        until(d, 30, lambda d: d.find_element(By.ID, "system").is_displayed(), "System panel shown")
        until(d, 30, lambda d: int(attr(d, "#sys-cpu", "data-points")) >= 2,
              "CPU chart has points")
        assert "job (% of one core)" in attr(d, "#sys-cpu", "data-series")
        assert attr(d, "#sys-mem", "data-points") != "0"
        assert not d.find_elements(By.ID, "charts-sys"), "sys/ series also drawn as step charts"
        cpu = max(v for v in c.get(f"/api/jobs/{jid}/metrics", params={"keys": "sys/cpu_pct"}).json()
                  ["series"]["sys/cpu_pct"]["value"])
        assert cpu > 10, cpu  # the busy loop shows (two cores shared with the suite)
        d.find_element(By.ID, "system").location_once_scrolled_into_view  # noqa: B018 -- reading it scrolls there
        shot(d, "job-system-panels")
        d.get(f"{server.url}/workers")
        until(d, 30, lambda d: "CPU" in text(d, "td.machine") and "memory" in text(d, "td.machine"), "machine column")
        shot(d, "workers-machine")

        done = server.wait_job(jid, timeout=120)
        assert done["state"] == "completed", done

        # the log: bounded, control codes gone, searchable
        full = c.get(f"/api/jobs/{jid}/logs", params={"limit": 100000}).json()
        lines = [x["line"] for x in full["lines"]]
        assert "needle found at the end" in lines and "filler line 01499 " + "x" * 80 in lines
        assert "filler line 00000 " + "x" * 80 not in lines, "over log_max_bytes the oldest lines go"
        stored = server.query("SELECT SUM(LENGTH(data)) FROM events WHERE job_id = ? AND kind = 'log'", (jid,))[0][0]
        assert stored <= 65536 * 1.1, stored
        assert not any("\x1b" in x or "[A" in x or "[2K" in x for x in lines)
        hit = c.get(f"/api/jobs/{jid}/logs", params={"grep": "NEEDLE"}).json()
        assert [x["line"] for x in hit["lines"]] == ["needle found at the end"] and hit["matched"] == 1
        rx = c.get(f"/api/jobs/{jid}/logs", params={"grep": r"filler line 0149[0-9]", "regex": "true"}).json()
        assert rx["matched"] == 10
        bad = c.get(f"/api/jobs/{jid}/logs", params={"grep": "(", "regex": "true"})
        assert bad.status_code == 422 and bad.json()["detail"]["field"] == "grep"
        txt = c.get(f"/api/jobs/{jid}/logs.txt")
        assert txt.headers["content-disposition"] == f'attachment; filename="job-{jid}.log"'
        assert txt.text.splitlines() == lines

    # the CLI
    env = {**os.environ, "TOKENPULSE_URL": server.url, "TOKENPULSE_TOKEN": server.token}
    out = subprocess.run([sys.executable, "-m", "tokenpulse.cli", "logs", str(jid), "--grep", "needle"],
                         env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.splitlines() == ["needle found at the end"], out
    out = subprocess.run([sys.executable, "-m", "tokenpulse.cli", "logs", str(jid), "--follow", "--tail", "2"],
                         env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "needle found at the end", out

    # the job page's search and download
    d.get(f"{server.url}/jobs/{jid}")
    until(d, 30, lambda d: "needle" in text(d, "#log"), "log tail")
    d.find_element(By.ID, "log-grep").send_keys("filler line 0149")
    d.find_element(By.CSS_SELECTOR, "#log-search button[type=submit]").click()
    until(d, 20, lambda d: d.find_element(By.ID, "log-results").is_displayed(), "search results")
    assert text(d, "#log-search-note").startswith("10 of "), text(d, "#log-search-note")
    assert len(text(d, "#log-results").splitlines()) == 10
    href = attr(d, "#log-download", "href")
    assert href.endswith(f"/api/jobs/{jid}/logs.txt?grep=filler+line+0149"), href
    shot(d, "job-log-search")
    d.find_element(By.ID, "log-clear").click()
    until(d, 10, lambda d: d.find_element(By.ID, "log").is_displayed(), "log tail back")
    assert not console_errors(d), console_errors(d)


def test_gpu_idle_is_a_slow_reason():
    """The GPU's utilisation (fed by the agent's sampler) below 10 % while steps go by: a slow reason."""
    s = SlowDetector(gpu="NVIDIA H100")
    s.config.alert_open_s = 0
    for i in range(12):
        s.observe("metrics", {"step": i, "values": {"step_time_s": 0.5, "tokens_per_s": 1000.0}}, 100.0 + i)
        s.machine.observe_gpu(100.0 + i, 3.0)
    assert any(k == "gpu_idle" and "GPU sits idle" in t for k, t in s.reasons()), s.reasons()
    busy = SlowDetector(gpu="NVIDIA H100")
    for i in range(12):
        busy.observe("metrics", {"step": i, "values": {"step_time_s": 0.5, "tokens_per_s": 1000.0}}, 100.0 + i)
        busy.machine.observe_gpu(100.0 + i, 95.0)
    assert not any(k == "gpu_idle" for k, _ in busy.reasons())
