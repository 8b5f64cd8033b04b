"""The job page's rank table in headless Chromium, for a real 2-rank job (torchrun, gloo)."""
from __future__ import annotations

from conftest import wait_for
from selenium.webdriver.common.by import By
from test_ui import browser, cells, console_errors, login, shot, until  # noqa: F401 (browser: a fixture)


def test_job_page_shows_a_row_per_rank(server, browser):
    d = browser
    server.start_agent("a1", env={"OMP_NUM_THREADS": "1"})  # 2 ranks on 2 shared cores
    with server.client() as c:
        # long enough to watch it run; slow steps (mostly asleep) leave the cores to the browser
        name = server.plan_fault("ranked", step_sleep_s=0.5)
        jid = c.post("/api/jobs", json={"name": name, "max_steps": 400, "batch_size": 2, "max_seq_length": 64,
                                        "precision": "fp32", "torch_compile": "off",
                                        "nproc_per_node": 2}).json()["id"]
        rest = wait_for(lambda: (lambda rows: rows if len(rows) == 2 and all(r["step"] for r in rows) else None)(
            c.get(f"/api/jobs/{jid}/ranks").json()), 240, "two ranks stepping")
        login(d, server)
        d.get(f"{server.url}/jobs/{jid}")
        until(d, 30, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#ranks:not([hidden]) #ranks-body tr")) == 2,
              "two rank rows on the job page")
        # each row once its live columns have values (a rank's last-progress age comes with its first beat)
        until(d, 30, lambda d: all("ago" in r[7] and r[4] != "–" for r in cells(d, "#ranks-body tr")),
              "each rank's step and last-progress age")
        rows = cells(d, "#ranks-body tr")
        assert [r[0] for r in rows] == ["0", "1"]
        assert [r[2] for r in rows] == [str(x["pid"]) for x in rest]
        assert all(r[1] == rest[0]["host"] and r[3] == "cpu" and r[4] != "–" and r[8].endswith("MiB")
                   for r in rows), rows
        assert all("ago" in r[7] for r in rows), rows
        assert all(r[9] == "–" for r in rows), rows  # no exit while it runs
        # each rank's identity in the automatic choices, its pid exact (not rounded like a measurement)
        until(d, 30, lambda d: all(f"pid: {x['pid']}" in d.find_element(By.ID, "info").text for x in rest),
              "each rank's exact pid among the automatic choices")
        assert not console_errors(d)
        d.execute_script("document.getElementById('ranks').scrollIntoView()")
        shot(d, "job-ranks-running")
        c.post(f"/api/jobs/{jid}/cancel")
        assert server.wait_job(jid, timeout=60)["state"] == "cancelled"
        # each rank's exit is stored as its own event comes in (on a busy machine, after the job's state)
        exits = wait_for(lambda: (lambda e: e if None not in e and "–" not in e else None)(
            [x["exit"] for x in c.get(f"/api/jobs/{jid}/ranks").json()]), 60, "each rank's exit")
        assert exits == ["cancelled", "cancelled"], exits
        until(d, 30, lambda d: [r[9] for r in cells(d, "#ranks-body tr")] == exits,
              "each rank's exit on the job page once the job ended")
        d.execute_script("document.getElementById('ranks').scrollIntoView()")
        shot(d, "job-ranks-ended")
