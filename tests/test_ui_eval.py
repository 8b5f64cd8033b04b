"""Evaluation in the browser (issue 15 item 3): eval loss on the job page's loss chart beside train
loss, the eval prompts' generations in their own panel (not among the automatic choices), and the
final eval on the compare page. A stand-in agent speaking the real agent protocol posts the events."""
from __future__ import annotations

import time

import httpx
from selenium.webdriver.common.by import By

from test_ui import browser, console_errors, login, shot, text, until  # noqa: F401 (browser: a fixture)
from test_ui_job import js, post_events


def test_eval_loss_on_chart_generations_panel_and_compare(server_factory, browser):
    server = server_factory(agent_lost_after_s=600)  # the stand-in agent sends no heartbeats
    agent = httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {server.agent_token}"})
    aid = agent.post("/api/agents", json={"name": "fake", "host": "h"}).json()["id"]
    with server.client() as c:
        jid = c.post("/api/jobs", json={"name": "evalrun", "max_steps": 20, "eval_fraction": 0.1, "eval_every": 10,
                                        "eval_prompts": ["Q: why"]}).json()["id"]
    assert agent.post(f"/api/agents/{aid}/claim").json()["job_id"] == jid
    t0 = time.time() - 30
    evs = [("info", {"device": "cpu", "reason": "no accelerator found"}, t0),
           ("info", {"eval_examples": 150, "eval_held_out": 150, "reason": "0.1 of the examples held out"}, t0)]
    for s in range(1, 21):
        evs.append(("metrics", {"step": s, "values": {"loss": 6 - s / 10, "lr": 1e-4}}, t0 + s))
        if s % 10 == 0:
            evs.append(("metrics", {"step": s, "values": {"eval/loss": 6.5 - s / 20, "eval/ppl": 100.0 - s}}, t0 + s))
            evs.append(("info", {"eval_step": s, "eval_generations": [{"prompt": "Q: why", "output": f"because {s}"}]}, t0 + s))
    evs.append(("state", {"state": "completed", "reason": "trained 20 steps"}, t0 + 21))
    post_events(agent, aid, jid, 0, evs)

    d = browser
    login(d, server)
    d.get(f"{server.url}/jobs/{jid}")
    until(d, 20, lambda d: d.find_element(By.ID, "chart-loss").get_attribute("data-series") == "train loss,eval loss",
          "eval loss beside train loss on the loss chart")
    # the eval column holds the two eval points, at steps 10 and 20
    col = js(d, "const u = TPJOB.charts['chart-loss']; return u.data[0].map((x, i) => [x, u.data[2][i]]).filter((p) => p[1] !== null)")
    assert col == [[10, 6.0], [20, 5.5]], col
    until(d, 10, lambda d: d.find_element(By.ID, "generations").is_displayed(), "the Generations panel")
    gens = text(d, "#generations-list")
    assert gens.index("step 20") < gens.index("step 10") and "because 20" in gens and "Q: why" in gens, gens
    assert text(d, "#eval-loss") == "5.5 (ppl 80)", text(d, "#eval-loss")
    assert "eval generations" not in text(d, "#info") and "eval examples: 150" in text(d, "#info")
    shot(d, "job-eval", full=True)
    assert not console_errors(d), console_errors(d)

    d.get(f"{server.url}/compare?job={jid}")
    until(d, 20, lambda d: "eval loss (last)" in text(d, "#compare-diff"), "the final eval on the compare page")
    rows = {r.find_element(By.TAG_NAME, "th").text: r.find_element(By.TAG_NAME, "td").text
            for r in d.find_elements(By.CSS_SELECTOR, "#compare-diff tbody tr")}
    assert rows["eval loss (last)"] == "5.5" and rows["eval perplexity (last)"] == "80", rows
    assert not console_errors(d), console_errors(d)
