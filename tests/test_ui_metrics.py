"""The job page charts every metric a job logs: eval loss beside train loss, and any other series
(a Trainer script's, the explicit API's) in charts grouped by prefix. A stand-in agent speaks the
real agent protocol, so the page is fed exactly what a script's events would store."""
from __future__ import annotations

import httpx
from selenium.webdriver.common.by import By  # noqa: E402
from test_ui import (  # noqa: F401 (browser is a fixture)
    attr,
    browser,
    console_errors,
    login,
    pytestmark,  # noqa: F401 (skips without Debian's chromium)
    shot,
    until,
)


def test_every_logged_metric_gets_a_chart_grouped_by_prefix(server, browser):
    d = browser
    with server.client() as c:
        jid = c.post("/api/jobs", json={"name": "metrics galore", "max_steps": 40}).json()["id"]
    agent = httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {server.agent_token}"})
    aid = agent.post("/api/agents", json={"name": "stand-in", "host": "h"}).json()["id"]
    claim = agent.post(f"/api/agents/{aid}/claim").json()
    assert claim["job_id"] == jid
    evs, seq = [], claim["seq_start"]
    for step in range(1, 41):
        values = {"loss": 3.0 / step, "lr": 1e-4, "train/accuracy": step / 40, "custom_score": step % 7}
        if step % 10 == 0:
            values.update({"eval/loss": 3.2 / step, "eval/ppl": 2.0 ** (3.2 / step), "eval_accuracy": step / 50})
        evs.append({"kind": "metrics", "job_id": jid, "seq": seq, "t": 1e9 + step,
                    "data": {"step": step, "values": values}})
        seq += 1
    agent.post(f"/api/agents/{aid}/events", json={"events": evs}).raise_for_status()

    login(d, server)
    d.get(f"{server.url}/jobs/{jid}")
    until(d, 60, lambda d: attr(d, "#chart-loss", "data-series") == "train loss,eval loss",
          "eval loss beside train loss on the loss chart")
    until(d, 30, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".extra-charts .chart[data-points='40'], "
                                                               ".extra-charts .chart[data-points='4']")) == 4,
          "a chart for each other metric")
    groups = [s.get_attribute("id") for s in d.find_elements(By.CSS_SELECTOR, ".extra-charts")]
    assert groups == ["charts-eval", "charts-other", "charts-train"], groups
    titles = {g: [h.text for h in d.find_elements(By.CSS_SELECTOR, f"#{g} .chart-head h2")] for g in groups}
    assert titles == {"charts-eval": ["eval/ppl", "eval_accuracy"], "charts-other": ["custom_score"],
                      "charts-train": ["train/accuracy"]}, titles
    assert attr(d, "#chart-x-eval_ppl", "data-points") == "4"
    # each new chart has the same export and text alternative as the fixed ones
    assert d.find_elements(By.CSS_SELECTOR, "#charts-train .export button")
    assert "train/accuracy" in attr(d, "#chart-x-train_accuracy-summary", "textContent")
    shot(d, "job-extra-metrics", full=True)
    assert not console_errors(d), console_errors(d)
