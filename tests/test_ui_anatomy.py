"""The job page's Step anatomy panel in headless Chromium (issue 19 leftovers, item 2): per rank a
stacked bar of the latest window (waiting for data / in collectives / computing) and a stacked chart
over the steps, instead of one automatic chart per anatomy metric.

A stand-in agent speaking the real agent protocol posts the anatomy metrics a command job's startup
hook sends (exact values): a 2-rank DDP job whose rank 1 computes longer while rank 0 waits in
all_reduce, and a plain one-process loop that waits for data."""
from __future__ import annotations

import time

import httpx
from selenium.webdriver.common.by import By
from test_ui import attr, browser, console_errors, login, shot, until  # noqa: F401 (browser: a fixture)
from test_ui_job import post_events


def anatomy(r: int, data: float, compute: float, comm: float) -> dict:
    return {f"anatomy/r{r}/data_s": data, f"anatomy/r{r}/compute_s": compute, f"anatomy/r{r}/comm_s": comm,
            f"anatomy/r{r}/step_s": data + compute + comm}


def open_job(server_factory, d, name: str, windows: list[dict]) -> tuple:
    server = server_factory(agent_lost_after_s=600)  # the stand-in agent sends no heartbeats
    agent = httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {server.agent_token}"})
    aid = agent.post("/api/agents", json={"name": "fake", "host": "h"}).json()["id"]
    with server.client() as c:
        jid = c.post("/api/jobs", json={"name": name, "max_steps": 100}).json()["id"]
    assert agent.post(f"/api/agents/{aid}/claim").json()["job_id"] == jid
    t0 = time.time() - len(windows) * 3
    evs = [("phase", {"name": "training", "done": 0, "unit": "steps"}, t0)]
    for k, values in enumerate(windows):
        step = 10 * (k + 1)
        evs.append(("metrics", {"step": step, "values": {"step_time_s": 0.3, "loss": 5 - k / 10, **values}},
                    t0 + 3 * k))
    post_events(agent, aid, jid, 0, evs)
    login(d, server)
    d.get(f"{server.url}/jobs/{jid}")
    until(d, 20, lambda d: d.find_element(By.ID, "anatomy").is_displayed()
          and len(d.find_elements(By.CSS_SELECTOR, "#anatomy-bars .anatomy-row")) >= 1, "the Step anatomy panel")
    return server, jid


def rows(d) -> dict:
    return {int(r.get_attribute("data-rank")): r for r in d.find_elements(By.CSS_SELECTOR,
                                                                          "#anatomy-bars .anatomy-row")}


def test_a_two_rank_job_shows_each_ranks_step_as_data_collectives_compute(server_factory, browser):
    d = browser
    d.set_window_size(1200, 900)
    windows = [{**anatomy(0, 0.01, 0.10, 0.19 + k / 100), **anatomy(1, 0.01, 0.28 + k / 100, 0.01)} for k in range(6)]
    open_job(server_factory, d, "ddp-anatomy", windows)
    until(d, 15, lambda d: len(rows(d)) == 2, "a bar for each of the 2 ranks")
    r = rows(d)
    assert float(r[0].get_attribute("data-comm")) > 0.6 and float(r[1].get_attribute("data-compute")) > 0.9
    text1 = r[1].find_element(By.CSS_SELECTOR, ".anatomy-text").text
    assert text1 == "0.35 s a step: waiting for data 3%, in collectives 3%, computing 94%", text1
    seg = r[0].find_element(By.CSS_SELECTOR, ".seg-comm_s")
    assert seg.size["width"] > 0.6 * r[0].find_element(By.CSS_SELECTOR, ".anatomy-bar").size["width"]
    until(d, 10,
          lambda d: [d.find_element(By.ID, f"anatomy-chart-r{k}").get_attribute("data-points")
                     for k in (0, 1)] == ["6", "6"],
          "a chart over the steps per rank")
    assert d.find_elements(By.CSS_SELECTOR, "#anatomy-chart-r1 canvas")
    # no automatic chart per anatomy metric any more; the job's other metrics keep theirs
    assert not d.find_elements(By.CSS_SELECTOR, "[id^='chart-x-anatomy']")
    assert attr(d, "#chart-loss", "data-points") == "6"
    d.execute_script("document.getElementById('anatomy').scrollIntoView()")
    shot(d, "job-anatomy-ddp")
    assert not console_errors(d)


def test_a_plain_loop_that_waits_for_data_shows_one_input_bound_rank(server_factory, browser):
    d = browser
    d.set_window_size(1200, 900)
    open_job(server_factory, d, "loop-anatomy", [anatomy(0, 0.12, 0.18, 0.0) for _ in range(4)])
    (r0,) = rows(d).values()
    assert r0.find_element(By.CSS_SELECTOR, ".anatomy-text").text == \
        "0.3 s a step: waiting for data 40%, in collectives 0%, computing 60%"
    assert r0.find_element(By.CSS_SELECTOR, ".anatomy-rank").text == "rank 0"
    d.execute_script("document.getElementById('anatomy').scrollIntoView()")
    shot(d, "job-anatomy-loop")
