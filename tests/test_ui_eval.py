"""Evaluation in the browser (issue 15 item 3): eval loss on the job page's loss chart beside train
loss, the eval prompts' generations in their own panel (not among the automatic choices), and the
final eval on the compare page. A stand-in agent speaking the real agent protocol posts the events."""
from __future__ import annotations

import time

import httpx
from selenium.webdriver.common.by import By
from test_ui import attr, browser, console_errors, login, shot, text, until  # noqa: F401 (browser: a fixture)
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
            evs.append(("info", {"eval_step": s, "eval_generations": [{"prompt": "Q: why", "output": f"because {s}"}]},
                        t0 + s))
    evs.append(("state", {"state": "completed", "reason": "trained 20 steps"}, t0 + 21))
    post_events(agent, aid, jid, 0, evs)

    d = browser
    login(d, server)
    d.get(f"{server.url}/jobs/{jid}")
    until(d, 20, lambda d: attr(d, "#chart-loss", "data-series") == "train loss,eval loss",
          "eval loss beside train loss on the loss chart")
    # the eval column holds the two eval points, at steps 10 and 20
    col = js(d,
             "const u = TPJOB.charts['chart-loss']; return u.data[0].map((x, i) => [x, u.data[2][i]]).filter((p) => "
             "p[1] !== null)")
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


def test_submit_form_test_run_eval_prompts_and_preflight_warnings(server_factory, browser):
    """The submit page: eval prompts one per line (commas kept), the quick-test-run checkbox, and a
    submit with preflight warnings stays on the page and lists them with their fixes, a link to the
    queued job and a button to cancel it (issue 15 items 3, 4, 5)."""
    server = server_factory(preflight_wait_s=300)  # never "still running" on a loaded test box
    d = browser
    login(d, server)
    d.get(f"{server.url}/submit")
    until(d, 15, lambda d: d.find_elements(By.ID, "f-max_seq_length"), "the submit form")
    d.find_element(By.ID, "f-name").send_keys("form-warned")
    ml = d.find_element(By.ID, "f-max_seq_length")
    ml.clear()
    ml.send_keys("32")
    def click(el):  # into the middle of the view first: the sticky action bar covers the bottom
        d.execute_script("arguments[0].scrollIntoView({block: 'center'})", el)
        el.click()
    click(d.find_element(By.CSS_SELECTOR, "#details-eval summary"))
    d.find_element(By.ID, "f-eval_fraction").send_keys("0.1")
    d.find_element(By.ID, "f-eval_prompts").send_keys("Q: why, and how")  # one box per prompt (issue 25 #9)
    click(d.find_element(By.CSS_SELECTOR, ".add-prompt"))
    d.find_elements(By.CSS_SELECTOR, "textarea[name=eval_prompts]")[1].send_keys("Once upon")
    click(d.find_element(By.ID, "f-test_run"))
    click(d.find_element(By.ID, "submit"))
    until(d, 120, lambda d: d.find_element(By.ID, "submit-warnings").is_displayed(), "the preflight warnings")
    box = text(d, "#submit-warnings")
    assert "is queued and runs as asked, with 1 warning" in box and "max_seq_length:" in box, box
    assert "are longer than max_seq_length=32" in box and "fix: max_seq_length=" in box, box
    assert "/submit" in d.current_url  # stayed to show them
    jid = int(attr(d, "#open-job", "href").rsplit("/", 1)[1])
    with server.client() as c:
        spec = c.get(f"/api/jobs/{jid}").json()["spec"]
        assert spec["test_run"] is True and spec["eval_fraction"] == 0.1, spec
        assert spec["eval_prompts"] == ["Q: why, and how", "Once upon"], spec
        click(d.find_element(By.XPATH, "//div[@id='submit-warnings']//button[text()='Cancel it']"))
        until(d, 15, lambda d: c.get(f"/api/jobs/{jid}").json()["state"] == "cancelled", "the job cancelled")
    shot(d, "submit-warnings")
    assert not console_errors(d), console_errors(d)
