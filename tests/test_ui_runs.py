"""Runs people can sort and compare (issue 22 item 3), in headless Chromium: compare of five runs
with any logged metric (eval loss included) in colours derived from the job id, and the settings
that differ; the jobs list's column picker and sort; the job page's metric picker. One server, five
finished runs posted by a stand-in agent speaking the real agent protocol, shared by the module."""
from __future__ import annotations

import time

import httpx
import pytest
from conftest import make_server
from selenium.webdriver.common.by import By
from test_ui import attr, browser, cells, console_errors, login, shot, text, texts, until  # noqa: F401 (browser: a fixture)
from test_ui_job import js, post_events

LRS = [1e-4, 2e-4, 3e-4, 4e-4, 5e-4]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    server = make_server(tmp_path_factory.mktemp("runs"), agent_lost_after_s=600).start()
    agent = httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {server.agent_token}"})
    aid = agent.post("/api/agents", json={"name": "fake", "host": "h"}).json()["id"]
    ids = []
    with server.client() as c:
        for i, lr in enumerate(LRS):
            jid = c.post("/api/jobs", json={"name": f"sweep-{i}", "max_steps": 20, "learning_rate": lr,
                                            "eval_fraction": 0.1, "eval_every": 10}).json()["id"]
            assert agent.post(f"/api/agents/{aid}/claim").json()["job_id"] == jid
            t0 = time.time() - 30
            evs = [("metrics", {"step": s, "values": {"loss": 6 - s * (i + 1) / 20, "lr": lr, "grad_norm": 1.0 + i}},
                    t0 + s)
                   for s in range(1, 21)]
            evs += [("metrics", {"step": s, "values": {"eval/loss": 6.5 - s * (i + 1) / 40}}, t0 + s) for s in (10, 20)]
            evs.append(("state", {"state": "completed", "reason": "trained 20 steps"}, t0 + 21))
            post_events(agent, aid, jid, 0, evs)
            ids.append(jid)
    yield server, ids
    server.kill()


def test_compare_five_runs_any_metric_stable_colours(runs, browser):
    server, ids = runs
    d = browser
    login(d, server)
    d.get(f"{server.url}/compare?{'&'.join(f'job={i}' for i in ids)}")
    until(d, 20, lambda d: d.find_elements(By.CSS_SELECTOR, "#compare-metrics input[value='eval/loss']"),
          "the metric picker")
    # eval loss is overlaid by default, for all five runs
    until(d, 10, lambda d: js(d, "const u = TPCMP.charts['chart-cmp-eval_loss']; return u ? u.series.length : 0") == 6,
          "five eval-loss curves")
    # the settings that differ: the learning rate, one column per run
    rows = {r[0]: r[1:] for r in cells(d, "#compare-diff tbody tr.diff", "th, td")}
    assert list(rows) == ["learning_rate"], rows
    assert rows["learning_rate"] == [str(lr) for lr in LRS], rows
    # pick grad_norm: a chart of its own, and the choice is kept
    d.find_element(By.CSS_SELECTOR, "#compare-metrics input[value='grad_norm']").click()
    until(d, 10, lambda d: d.find_elements(By.CSS_SELECTOR, "#chart-cmp-grad_norm .uplot"), "the grad_norm chart")
    # colours come from the job id: the same for a run whatever else is compared
    colour = js(d,
                f"return TPCMP.charts['chart-cmp-loss'].series.find((s) => s.label === '#{ids[2]} sweep-2').stroke()")
    assert colour == js(d, f"return TP.jobColor({ids[2]})"), colour
    shot(d, "compare-five", full=True)
    d.get(f"{server.url}/compare?job={ids[2]}&job={ids[4]}")
    until(d, 20, lambda d: d.find_elements(By.CSS_SELECTOR, "#chart-cmp-grad_norm .uplot"),
          "grad_norm kept across visits")
    again = js(d, f"return TPCMP.charts['chart-cmp-loss'].series.find((s) => s.label === '#{ids[2]} sweep-2').stroke()")
    assert again == colour, (again, colour)
    assert not console_errors(d), console_errors(d)


def test_jobs_list_column_picker_sort_and_filter(runs, browser):
    server, ids = runs
    d = browser
    login(d, server)
    until(d, 20, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#jobs-body tr[data-job]")) == 5, "the five runs")
    d.find_element(By.CSS_SELECTOR, "#col-picker summary").click()
    # the menu opens on screen, whatever the toolbar's width, with a search box over its many names
    def on_screen(d):
        menu = d.find_element(By.ID, "col-picks").rect
        return menu["x"] >= 0 and menu["x"] + menu["width"] <= d.execute_script("return innerWidth")
    until(d, 5, on_screen, "the column menu on screen")
    d.find_element(By.ID, "col-search").send_keys("learning")

    def shown_picks(d):
        return [e.get_attribute("value") for e in d.find_elements(By.CSS_SELECTOR, "#col-picks input[type=checkbox]")
                if e.is_displayed()]
    until(d, 5, lambda d: shown_picks(d) and all("learning" in v for v in shown_picks(d)), "the search narrowing")
    d.find_element(By.CSS_SELECTOR, "#col-picks input[value='spec:learning_rate']").click()
    d.find_element(By.ID, "col-search").clear()
    d.find_element(By.ID, "col-search").send_keys(" ")  # cleared: every name again (an input event)
    d.find_element(By.CSS_SELECTOR, "#col-picks input[value='last:eval/loss']").click()
    d.find_element(By.CSS_SELECTOR, "#col-picker summary").click()

    def column(c):
        return texts(d, f"#jobs-body td[data-col='{c}']")
    until(d, 10, lambda d: len(column("last:eval/loss")) == 5, "the eval loss column")
    assert column("spec:learning_rate") == [str(lr) for lr in reversed(LRS)]  # newest first
    # the filter box lives through re-renders (sorting, live updates): typing in it is never lost
    box = d.find_element(By.CSS_SELECTOR, "input.col-filter[data-col='spec:learning_rate']")
    # sort on the final eval loss, lowest first: the run with the highest learning rate wins here
    d.find_element(By.CSS_SELECTOR, "th.picked[data-col='last:eval/loss'] button.sort").click()
    until(d, 5, lambda d: column("last:eval/loss") == ["4", "4.5", "5", "5.5", "6"], "sorted by eval loss")
    d.find_element(By.CSS_SELECTOR, "th.picked[data-col='last:eval/loss'] button.sort").click()
    until(d, 5, lambda d: column("last:eval/loss") == ["6", "5.5", "5", "4.5", "4"], "sorted the other way")
    box.send_keys(">=0.0003")
    until(d, 5, lambda d: column("spec:learning_rate") == ["0.0003", "0.0004", "0.0005"],
          "filtered on the learning rate")
    # sorted and filtered by the server, over every page: its count says 3 jobs pass, not 5 on a page
    until(d, 10, lambda d: text(d, "#page-info") == "1–3 of 3", "the server's count of the filtered jobs")
    shot(d, "jobs-columns")
    # kept per browser: a new visit shows the same columns, sort and filter
    d.get(server.url + "/")
    until(d, 20, lambda d: column("spec:learning_rate") == ["0.0003", "0.0004", "0.0005"], "columns kept across visits")
    assert not console_errors(d), console_errors(d)


def test_job_page_metric_picker_remembered(runs, browser):
    server, ids = runs
    d = browser
    login(d, server)
    d.get(f"{server.url}/jobs/{ids[0]}")
    until(d, 20, lambda d: d.find_elements(By.CSS_SELECTOR, "#panel-add option[value='eval/loss']"),
          "the metric picker")
    # the section links: only to sections this job shows (one process: no rank table)
    shown = lambda d: texts(d, "#jump a", shown=True)  # noqa: E731
    until(d, 10, shown, "the section links")
    links = shown(d)
    assert {"Overview", "Charts", "Log"} <= set(links) and "Ranks" not in links, links
    for k in ("grad_norm", "eval/loss"):
        d.execute_script("const s = document.getElementById('panel-add'); s.value = arguments[0]; s.dispatchEvent(new "
                         "Event('change'))", k)
    until(d, 10, lambda d: attr(d, "#chart-custom", "data-series") == "grad_norm,eval/loss",
          "both metrics in the panel")
    assert js(d, "return TPJOB.charts['chart-custom'].data[1].filter((v) => v !== null).length") == 20
    shot(d, "job-panel")
    # another job logging the same metrics opens with the same panel
    d.get(f"{server.url}/jobs/{ids[3]}")
    until(d, 20, lambda d: attr(d, "#chart-custom", "data-series") == "grad_norm,eval/loss",
          "the panel remembered for the same metric set")
    d.find_element(By.CSS_SELECTOR, "#panel-picked .chip[data-key='grad_norm'] button").click()
    until(d, 10, lambda d: attr(d, "#chart-custom", "data-series") == "eval/loss",
          "grad_norm removed")
    assert not console_errors(d), console_errors(d)
