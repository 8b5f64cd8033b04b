"""Browser tests of the list-side pages (jobs, submit, /docs, a missing job) in Debian's headless
Chromium against a real server; screenshots go to test-artifacts/ui/. No training runs here: a
stand-in agent speaks the real agent protocol where a job must have run somewhere."""
from __future__ import annotations

import os
import subprocess
import sys

import httpx
import numpy as np
import pytest
from conftest import ROOT
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from test_ui import attr, browser, console_errors, login, shot, text, until, wait  # noqa: F401 (browser is a fixture)

pytestmark = pytest.mark.skipif(not (os.path.exists(os.environ.get("TOKENPULSE_CHROMIUM", "/usr/bin/chromium"))
                                     and os.path.exists(os.environ.get("TOKENPULSE_CHROMEDRIVER",
                                                                       "/usr/bin/chromedriver"))),
                                reason="needs Debian's chromium and chromedriver")


def fake_agent(server, name: str = "stand-in") -> tuple[httpx.Client, int]:
    agent = httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {server.agent_token}"})
    aid = agent.post("/api/agents", json={"name": name, "host": "h"}).json()["id"]
    return agent, aid


def rows(d) -> list[int]:
    return [int(r.get_attribute("data-job")) for r in d.find_elements(By.CSS_SELECTOR, "#jobs-body tr[data-job]")]


def test_clone_and_edit_fills_the_form_and_any_job_can_be_picked(server, browser):
    """Clone & edit (/submit?clone=N) opens the form with job N's settings, and submitting creates a
    job with them, not a default one. Any job can be the start, also one older than the newest 100."""
    d = browser
    with server.client() as c:
        src = c.post("/api/jobs", json={"name": "source", "learning_rate": 0.001, "max_steps": 7, "seed": 42,
                                        "padding": "dynamic", "lora": {"rank": 4}}).json()
        for i in range(205):  # the old dropdown listed only the 100 newest, the compare picker 200
            c.post("/api/jobs", json={"name": f"filler-{i}", "max_steps": 3}).raise_for_status()
    login(d, server)

    d.get(f"{server.url}/submit?clone={src['id']}")
    until(d, 20, lambda d: d.find_element(By.ID, "clone-note").is_displayed(), "no 'settings copied' note")
    assert attr(d, '[name="learning_rate"]', "value") == "0.001"
    assert attr(d, '[name="max_steps"]', "value") == "7"
    assert attr(d, '[name="name"]', "value") == "source (clone)"
    assert d.find_element(By.NAME, "lora.enabled").is_selected()
    shot(d, "submit-clone", full=True)
    d.find_element(By.ID, "submit").click()
    wait(d, 20).until(lambda d: d.current_url.rstrip("/").rsplit("/", 1)[-1].isdigit() and "/jobs/" in d.current_url)
    new_id = int(d.current_url.rsplit("/", 1)[1])
    with server.client() as c:
        spec = c.get(f"/api/jobs/{new_id}").json()["spec"]
    assert (spec["name"], spec["learning_rate"], spec["max_steps"], spec["seed"], spec["padding"],
            spec["lora"]["rank"]) == \
        ("source (clone)", 0.001, 7, 42, "dynamic", 4), spec

    # the oldest job, far beyond the newest 100, by its id; then one by name
    d.get(f"{server.url}/submit")
    box = wait(d, 15).until(lambda d: d.find_element(By.ID, "clone-from"))
    box.send_keys(f"#{src['id']}", Keys.ENTER)
    until(d, 15, lambda d: attr(d, '[name="learning_rate"]', "value") == "0.001",
          "job 1 not picked by id")
    assert f"clone={src['id']}" in d.current_url
    box.clear()
    box.send_keys("filler-3", Keys.ENTER)
    until(d, 15, lambda d: attr(d, '[name="name"]', "value") == "filler-3 (clone)",
          "not picked by name")
    assert attr(d, '[name="max_steps"]', "value") == "3"
    box.clear()
    box.send_keys("#99999", Keys.ENTER)
    until(d, 15, lambda d: "no job #99999" in text(d, "#clone-error"), "a missing job is not named")
    shot(d, "submit-pick")
    assert not [e for e in console_errors(d) if "99999" not in e], console_errors(d)

    d.set_window_size(390, 844)  # phone width: the picker fits, nothing scrolls sideways
    d.get(f"{server.url}/submit?clone={src['id']}")
    until(d, 20, lambda d: d.find_element(By.ID, "clone-note").is_displayed(), "no 'settings copied' note on a phone")
    assert d.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")
    shot(d, "submit-clone-phone")
    d.set_window_size(1280, 800)

    # the compare page's picker finds it too, by id or by name, though it lists only the 200 newest
    d.get(f"{server.url}/compare")
    until(d, 15, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#compare-pick input")) >= 200,
          "compare picker not filled")
    d.find_element(By.ID, "pick-search").send_keys(f"#{src['id']}")
    picked = lambda: [e.get_attribute("value") for e in d.find_elements(By.CSS_SELECTOR, "#compare-pick input")]  # noqa: E731
    until(d, 15, lambda d: picked() == [str(src["id"])], "compare cannot find the oldest job by id")
    d.find_element(By.ID, "pick-search").clear()
    d.find_element(By.ID, "pick-search").send_keys("sourc")
    until(d, 15, lambda d: str(src["id"]) in picked(), "compare cannot find the oldest job by name")
    assert not console_errors(d), console_errors(d)


def test_jobs_list_search_by_hash_id_worker_and_no_worker_notice(server, browser):
    """'#4' finds job 4 (and only it); a finished job shows the worker of its last attempt; while jobs
    wait and no agent is online the page says so, and the notice goes when a worker comes."""
    d = browser
    with server.client() as c:
        ids = [c.post("/api/jobs", json={"name": f"lr-{i}e-4", "max_steps": 3}).json()["id"] for i in range(14)]
    login(d, server)
    d.get(server.url + "/")
    until(d, 15, lambda d: len(rows(d)) == 14, "jobs not listed")
    until(d, 15, lambda d: d.find_element(By.ID, "no-worker").is_displayed(), "no 'no worker online' notice")
    notice = text(d, "#no-worker")
    assert "No worker is online: 14 queued jobs wait" in notice and "tokenpulse agent" in notice, notice
    assert "none online" in text(d, f'tr[data-job="{ids[0]}"] .phase')
    shot(d, "jobs-no-worker")

    search = d.find_element(By.ID, "search")
    search.send_keys("#4")
    until(d, 15, lambda d: rows(d) == [ids[3]], "'#4' does not find job 4 alone")
    assert "q=%234" in d.current_url
    d.refresh()  # the search survives a reload
    until(d, 15, lambda d: rows(d) == [ids[3]], "'#4' from the URL")
    search = d.find_element(By.ID, "search")
    search.clear()
    search.send_keys("4")
    until(d, 15, lambda d: len(rows(d)) == 14, "a bare '4' searches names too")

    # a worker comes: the notice goes; it runs job 1 to the end: the list still names it
    agent, aid = fake_agent(server, "gpu-box")
    until(d, 20, lambda d: not d.find_element(By.ID, "no-worker").is_displayed(), "notice stays with a worker online")
    claimed = agent.post(f"/api/agents/{aid}/claim").json()["job_id"]
    until(d, 15, lambda d: text(d, f'tr[data-job="{claimed}"] td[data-label=Worker]') == "gpu-box",
          "running job's worker")
    agent.post(f"/api/agents/{aid}/events", json={"events": [
        {"kind": "state", "job_id": claimed, "seq": 0, "t": 1.0,
         "data": {"state": "completed", "reason": "done"}}]}).raise_for_status()
    until(d, 15, lambda d: d.find_elements(By.CSS_SELECTOR, f'tr[data-job="{claimed}"] .badge.completed'),
          "not completed")
    assert text(d, f'tr[data-job="{claimed}"] td[data-label=Worker]') == "gpu-box"  # kept from the live frame
    d.refresh()
    until(d, 15, lambda d: text(d, f'tr[data-job="{claimed}"] td[data-label=Worker]') == "gpu-box",
          "a finished job shows no worker after a reload")
    shot(d, "jobs-finished-worker")
    assert not console_errors(d), console_errors(d)


def test_missing_job_page_and_docs_offline(server, browser):
    """/jobs/99999 says there is no such job (404), and /docs renders the API's operations from the
    app's own copy of Swagger UI: no request leaves the server."""
    d = browser
    login(d, server)
    d.get(server.url + "/jobs/99999")
    until(d, 15, lambda d: "No such job" in text(d, "main"), "no 'no such job' page")
    assert "There is no job #99999" in text(d, "main")
    shot(d, "job-missing")
    with server.client() as c:
        assert c.get("/jobs/99999").status_code == 404
        assert c.get("/jobs/9223372036854775807").status_code == 404
        r = c.get("/jobs/abc<b>")
        assert r.status_code == 404 and "No such job" in r.text and "<b>" not in r.text
        assert c.get("/redoc").status_code == 404  # it would need a CDN

    d.get(server.url + "/docs")
    until(d, 30, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".opblock")) >= 10, "Swagger UI shows no operations")
    assert "/api/jobs" in text(d, "#swagger-ui")
    urls = d.execute_script("return [location.href, ...performance.getEntriesByType('resource').map((e) => e.name)]")
    outside = [u for u in urls if not u.startswith(server.url) and not u.startswith("data:")]
    assert not outside, outside
    shot(d, "docs")


def test_layouts_compared_at_the_same_real_tokens():
    """Every layout is costed at the same real tokens per optimizer step; dynamic padding computes
    fewer tokens than padding to max length when lengths vary, packing fewer still."""
    from worker.training.analysis import analyze_lengths
    lengths = np.clip(np.random.default_rng(0).lognormal(4, 0.6, 3000).astype(int), 4, 2000)  # many short, a few long
    a = analyze_lengths(lengths, 99)
    lay = a["layouts"]
    assert {v["real_tokens_per_step"] for v in lay.values()} == {a["real_tokens_per_step"]}
    assert lay["max_length"]["compute_vs_max_length"] == 1
    assert lay["pack"]["compute_vs_max_length"] < lay["dynamic"]["compute_vs_max_length"] < 0.8
    grouped = analyze_lengths(lengths, 99, group_by_length=True)["layouts"]["dynamic"]
    assert grouped["compute_vs_max_length"] < lay["dynamic"]["compute_vs_max_length"]
    for v in lay.values():
        assert v["padded_tokens_per_step"] == pytest.approx(v["real_tokens_per_step"] * v["computed_per_real_token"])
        assert v["computed_per_real_token"] == pytest.approx(1 / (1 - v["padding_frac"]))
    assert analyze_lengths(lengths, 99, tokens_per_batch=5000)["layouts"]["pack"]["real_tokens_per_step"] == 5000


def test_analysis_table_and_failed_reanalysis(server, browser):
    """The submit page's analysis compares layouts at the same real tokens; analysing a dataset that
    fails afterwards clears the earlier results and says why. The CLI prints the same table."""
    d = browser
    login(d, server)
    d.get(server.url + "/submit")
    d.find_element(By.ID, "analyze").click()
    until(d, 180, lambda d: text(d, "#recommended"), "no dataset analysis")
    table = text(d, "#analysis-table")
    assert "Compute vs. pad to max length" in table and "Speed-up" not in table, table
    assert "same" in text(d, "#analysis-note") and "real tokens per optimizer step" in text(d, "#analysis-note")
    dyn = d.find_element(By.CSS_SELECTOR, 'tr[data-layout="dynamic"]').text
    assert dyn.split()[-2] != "100", dyn  # dynamic padding computes less than padding to max length
    shot(d, "submit-analysis-same-tokens", full=True)
    d.set_window_size(1280, 1000)
    d.execute_script("window.scrollTo(0, 0)")
    shot(d, "submit-analysis-top")  # docs/screenshots/submit.png
    d.set_window_size(1280, 800)

    ds = d.find_element(By.NAME, "dataset")
    ds.clear()
    ds.send_keys("/nonexistent/data.jsonl")
    d.find_element(By.ID, "analyze").click()
    until(d, 30, lambda d: text(d, "#analysis-error"), "no analysis error")
    assert not d.find_element(By.ID, "analysis").is_displayed(), "the previous dataset's results stay on screen"
    assert not text(d, "#recommended")
    assert "dataset" in text(d, "#analysis-error")
    shot(d, "submit-analysis-failed")

    env = {**os.environ, "TOKENPULSE_URL": server.url, "TOKENPULSE_TOKEN": server.token, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "tokenpulse.cli", "analyze", "--dataset", "builtin:demo"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "recommended max_seq_length" in r.stdout and "vs max_length" in r.stdout and "pack" in r.stdout, r.stdout
