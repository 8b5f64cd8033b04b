"""Issue 25 in the browser: numbers people can trust and flows that do not mislead. One real server
and one headless Chromium for the module; a stand-in agent speaks the real agent protocol to put jobs
in the states a person would see (stalled, failed with a traceback, paused), so no training runs
here. Screenshots (desktop and phone) go to test-artifacts/ui/."""
from __future__ import annotations

import shutil
import signal
import time

import httpx
import pytest
from conftest import make_server
from selenium.webdriver.common.by import By  # noqa: E402
from test_ui import CHROMEDRIVER, CHROMIUM, attr, cells, console_errors, login, make_driver, shot, text, until  # noqa: F401

TRACEBACK = ("train.py:42 in main: ValueError: learning rate must be positive\n"
             "command exited with code 1; last output:\n"
             "Traceback (most recent call last):\n"
             '  File "train.py", line 42, in main\n'
             "    check(lr=-1e-4)\n"
             "    ^^^^^^^^^^^^^^^\n"
             "ValueError: learning rate must be positive")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = make_server(tmp_path_factory.mktemp("trust")).start()
    yield s
    s.kill(signal.SIGTERM)


@pytest.fixture(scope="module")
def d(srv):
    drv = make_driver()
    login(drv, srv)
    yield drv
    drv.quit()
    shutil.rmtree(drv.profile_dir, ignore_errors=True)


class StandIn:
    """An agent that claims one job and reports what the test says, through the real agent API."""

    def __init__(self, srv, name: str, commands: bool = False):
        self.http = httpx.Client(base_url=srv.url, timeout=30, headers={"Authorization": f"Bearer {srv.agent_token}"})
        hello = {"name": name, "host": "box", "accepts_commands": commands}
        self.id = self.http.post("/api/agents", json=hello).json()["id"]
        self.seq: dict[int, int] = {}

    def claim(self) -> int:
        c = self.http.post(f"/api/agents/{self.id}/claim").json()
        self.seq[c["job_id"]] = c["seq_start"]
        return c["job_id"]

    def send(self, job: int, *events: tuple) -> None:
        """events: (kind, data), or (kind, data, t) for an event of another time than now."""
        batch = []
        for kind, data, *t in events:
            batch.append({"kind": kind, "job_id": job, "seq": self.seq[job], "t": t[0] if t else time.time(),
                          "data": data})
            self.seq[job] += 1
        self.http.post(f"/api/agents/{self.id}/events", json={"events": batch}).raise_for_status()


@pytest.fixture(scope="module")
def jobs(srv):
    """A stalled job, a failed command job with a traceback, a paused job (its checkpoint one step
    past its last logged metric), and a finished one, each claimed by its own stand-in agent."""
    made = {}
    with srv.client() as c:
        for name in ("stalled", "failed", "paused", "done"):
            job = c.post("/api/jobs", json={"name": name, "max_steps": 400}).json()["id"]
            agent = StandIn(srv, f"box-{name}")
            assert agent.claim() == job
            made[name] = (job, agent)
    job, a = made["stalled"]
    a.send(job, ("phase", {"name": "training", "done": 120, "total": 400, "unit": "steps"}),
           *[("metrics",
              {"step": s,
               "values": {"loss": 3 - s / 100, "lr": 2e-4 if s < 60 else 0.00197, "tokens_per_s": 8915 + 20 * s,
                                                  "eta_s": 600 - s, "step_time_s": 0.5, "mfu": 1.14,
                          "rss_mb": 736.5 + (s % 3) / 2,
                                                  "padding_frac": 0.12, "eval/runtime": 3.2}}) for s in range(1, 121)],
           ("info", {"device": "cpu", "peak_flops": 2e10}),
           # the agent's system samples, keyed by Unix seconds (worker/agent/sysmetrics.py)
           *[("metrics", {"step": int(time.time()) - 60 + 5 * i,
                          "values": {"sys/cpu_pct": 90.0 + i, "sys/host_cpu_pct": 40.0, "sys/rss_mb": 700.0 + i}},
              int(time.time()) - 60 + 5 * i) for i in range(12)],
           ("alert",
            {"kind": "stalled", "severity": "critical", "message": "stalled: no progress in 'training' for 95 s"}))
    job, a = made["failed"]
    a.send(job, ("metrics", {"step": 1, "values": {"loss": 2.0}}),
           ("state", {"state": "failed", "reason": TRACEBACK, "failure": "error", "exit_code": 1}))
    job, a = made["paused"]
    a.send(job, *[("metrics", {"step": s, "values": {"loss": 2.0}}) for s in (367, 368)],
           ("checkpoint", {"step": 369, "path": "/tmp/ckpt/step-369"}),
           ("state", {"state": "paused", "reason": "paused at step 369; resume from /tmp/ckpt/step-369"}))
    job, a = made["done"]
    a.send(job,
           *[("metrics",
              {"step": s, "values": {"loss": 2.0 - s / 1000, "tokens_per_s": 1000.0 + s}}) for s in range(1, 51)],
           ("state", {"state": "completed", "reason": "done"}))
    return {k: v[0] for k, v in made.items()}


def test_a_stalled_job_looks_stalled_in_the_list_as_on_its_page(srv, d, jobs):
    """Item 4: the list marks the stalled job and its tokens/s and ETA as stale, as the job page does;
    item 2: a failed job's root cause is readable in the list, not in a tooltip."""
    d.get(srv.url + "/")
    row = f'tr[data-job="{jobs["stalled"]}"]'
    until(d, 20, lambda d: d.find_elements(By.CSS_SELECTOR, f"{row} .badge.stalled"),
          "the list does not mark the stalled job")
    assert d.find_elements(By.CSS_SELECTOR, f"{row} td[data-label='Real tokens/s'].stale .stale-tag")
    assert d.find_elements(By.CSS_SELECTOR, f"{row} td[data-label=ETA].stale .stale-tag")
    assert not d.find_elements(By.CSS_SELECTOR, f'tr[data-job="{jobs["done"]}"] .stale-tag')
    failed = text(d, f'tr[data-job="{jobs["failed"]}"] td.phase')
    assert "train.py:42 in main: ValueError: learning rate must be positive" in failed, failed
    assert "Traceback" not in failed
    shot(d, "trust-jobs-list")
    d.set_window_size(390, 844)
    d.refresh()
    until(d, 20, lambda d: d.find_elements(By.CSS_SELECTOR, f"{row} .badge.stalled"), "phone: stalled not marked")
    el = d.find_element(By.CSS_SELECTOR, f'tr[data-job="{jobs["failed"]}"] .reason-text')
    assert el.is_displayed() and "ValueError" in el.text  # readable on a touch screen, no hover needed
    shot(d, "trust-jobs-list-phone")
    d.set_window_size(1280, 800)

    d.get(f"{srv.url}/jobs/{jobs['stalled']}")
    until(d, 20, lambda d: d.find_elements(By.CSS_SELECTOR, "#tps .stale-tag"),
          "the job page does not mark tokens/s stale")


def test_numbers_mfu_never_above_100_and_one_formatter_per_unit(srv, d, jobs):
    """Item 1: an MFU over 100 % (a peak measured on a busy machine) is not shown as a number; item 7:
    learning rates in one notation, tokens/s with one prefix rule, distinct axis ticks, units for the
    extra metrics, smoothing beyond the loss chart."""
    d.get(f"{srv.url}/jobs/{jobs['stalled']}")
    until(d, 20, lambda d: "peak measured too low" in text(d, "#mfu"), "MFU over 100 % is not explained")
    assert "114" not in text(d, "#mfu") and "%" not in text(d, "#mfu").split("peak")[0], text(d, "#mfu")
    assert text(d, "#lr") == "1.97e-3", text(d, "#lr")
    fmt = d.execute_script("""return [TP.compact(8915, 'tok/s'), TP.compact(10512, 'tok/s'), TP.small(2e-4),
        TP.small(0.00197),
        TP.ticks([736.5, 737, 737.5]), TP.ticks([0.0002, 0.0004, 0.0006]), TP.metricFormat('padding_frac').value(0.12),
        TP.metricFormat('eval/runtime').value(3.2)]""")
    assert fmt[:4] == ["8.92 ktok/s", "10.5 ktok/s", "2.00e-4", "1.97e-3"], fmt
    assert len(set(fmt[4])) == 3 and len(set(fmt[5])) == 3, fmt
    assert fmt[6:] == ["12.0 %", "3.2 s"], fmt
    until(d, 20, lambda d: d.find_elements(By.ID, "chart-x-padding_frac"), "no padding_frac chart")
    assert text(d, "#chart-x-padding_frac-title") == "padding_frac (%)"
    assert text(d, "#chart-x-eval_runtime-title") == "eval/runtime (s)"
    smoothed = d.execute_script("return ['chart-step', 'chart-x-padding_frac'].map((id) => "
                                "TPJOB.charts[id].series.map((s) => s.label))")
    assert all("smoothed" in labels for labels in smoothed), smoothed
    # Issue 33 #13: each System chart fills its card, and its time axis has room for the date line
    until(d, 20, lambda d: int(attr(d, "#sys-mem", "data-points") or 0) >= 2, "the System charts")
    fill = d.execute_script("return ['sys-cpu', 'sys-mem'].map((id) => { const u = document.getElementById(id)"
                            ".querySelector('.uplot'); return [u.getBoundingClientRect().width, "
                            "u.closest('.chart-box').clientWidth] })")
    assert all(box - 40 <= w <= box for w, box in fill), fill  # the box's padding only
    assert d.execute_script("return document.querySelector('#sys-cpu .u-axis').getBoundingClientRect().height") >= 50
    # not hovering, each System legend says its latest reading, not "–" (which reads as no data)
    legend = d.execute_script("return [...document.querySelectorAll('#sys-cpu .u-legend .u-value')]"
                              ".map((e) => e.textContent)")
    assert legend[1:] == ["101", "40"] and ":" in legend[0], legend
    d.execute_script("document.getElementById('system').scrollIntoView()")
    shot(d, "trust-job-system")
    shot(d, "trust-job-stalled", full=True)
    assert not console_errors(d), console_errors(d)


def test_a_failed_commands_traceback_once_in_monospace_and_pause_one_step(srv, d, jobs):
    """Item 3: the root cause leads the reason box; the traceback appears once outside the log, in a
    monospace block, and the Attempts cell links to it. Item 6: a paused job names one step."""
    d.get(f"{srv.url}/jobs/{jobs['failed']}")
    until(d, 20, lambda d: text(d, "#reason .reason-head"), "no reason headline")
    assert text(d, "#reason .reason-head") == "train.py:42 in main: ValueError: learning rate must be positive"
    assert "failure: error, exit code 1" in text(d, "#reason")
    tb = d.find_element(By.ID, "traceback")
    assert "monospace" in tb.value_of_css_property("font-family") and tb.value_of_css_property("white-space") == "pre"
    outside_log = d.execute_script("""const c = document.getElementById('job').cloneNode(true);
        c.querySelector('#log').remove(); c.querySelector('#config').remove(); return c.textContent""")
    assert outside_log.count("Traceback (most recent call last)") == 1, outside_log.count("Traceback (most recent call "
                                                                                          "last)")
    cell = d.find_element(By.CSS_SELECTOR, "#attempts td.wrap")
    assert "ValueError" in cell.text and "Traceback" not in cell.text
    assert cell.find_element(By.TAG_NAME, "a").get_attribute("href").endswith("#reason")
    shot(d, "trust-job-failed-traceback", full=True)
    d.set_window_size(390, 844)
    d.refresh()
    until(d, 20, lambda d: text(d, "#reason .reason-head"), "phone: no reason headline")
    # the pre scrolls, not the page
    assert d.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")
    shot(d, "trust-job-failed-phone")
    d.set_window_size(1280, 800)

    d.get(f"{srv.url}/jobs/{jobs['paused']}")
    until(d, 20, lambda d: "paused" in text(d, "#phase-text"), "not paused")
    assert "369" in text(d, "#phase-text") and "368" not in text(d, "#phase-text"), text(d, "#phase-text")
    assert text(d, "#step").startswith("369"), text(d, "#step")
    assert "paused at step 369" in text(d, "#reason")
    # its Throughput card, empty, says it may still come (not that the job reported none: it is not over)
    until(d, 20, lambda d: text(d, "#chart-tps").startswith("No throughput before the pause: it comes after the job "
                                                            "resumes."), "the paused job's empty Throughput card")


def test_a_command_jobs_empty_loss_and_throughput_cards_say_why(srv, d, jobs):
    """Issue 33 #15: a command job that has reported no loss or throughput shows both cards with a note
    saying where tokenpulse looks for them; once it is over, that it reported none."""
    with srv.client() as c:
        job = c.post("/api/jobs/command", json={"command": ["python", "loop.py"], "name": "silent loop",
                                                "priority": 100}).json()["id"]
    agent = StandIn(srv, "box-commands", commands=True)
    assert agent.claim() == job
    agent.send(job, ("phase", {"name": "running"}),  # and a long list of choices, for the Log below (#18)
               *[("info", {f"setting_{i}": i, "reason": "a reason long enough to take a line or two of the panel "
                                                        "beside the log"}) for i in range(24)])
    d.get(f"{srv.url}/jobs/{job}")
    until(d, 20, lambda d: text(d, "#job-state") == "running", "the command job is not running")
    until(d, 10, lambda d: "No loss reported yet. tokenpulse reads it from tokenpulse.log" in text(d, "#chart-loss"),
          "the empty Loss card says nothing")
    assert "printed lines such as “loss 2.31”" in text(d, "#chart-loss")
    assert "No throughput reported yet. tokenpulse counts tokens per second" in text(d, "#chart-tps")
    assert not d.find_element(By.ID, "chart-lr").is_displayed()  # the other empty cards fold away
    d.execute_script("document.getElementById('chart-loss').scrollIntoView({block: 'center'})")
    shot(d, "trust-command-empty-charts")
    agent.send(job, ("state", {"state": "completed", "reason": "exited 0", "exit_code": 0}))
    until(d, 20, lambda d: text(d, "#chart-loss").startswith("This job reported no loss."), "no note once it is over")
    assert text(d, "#chart-tps").startswith("This job reported no throughput.")

    # Issue 33 #18: beside a long list of choices, the Log takes its panel's height (not 340 px in a tall panel)
    until(d, 10, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#info li")) >= 24, "the choices")
    d.execute_script("document.getElementById('logs').scrollIntoView()")
    log, panel, side = (d.execute_script("return document.querySelector(arguments[0]).getBoundingClientRect()", css)
                        for css in ("#log", "#logs .log-panel", "#logs > .panel:last-child"))
    assert side["height"] > 700, side  # the panel beside it is tall...
    # ...and so is the log
    assert panel["bottom"] - log["bottom"] < 30 and log["height"] > side["height"] - 200, (log, panel, side)
    shot(d, "trust-log-tall-panel", full=True)


def test_compare_draws_the_runs_that_exist_and_names_the_missing_one(srv, d, jobs):
    """Item 13: /compare?job=A&job=999&job=B draws A and B and says that 999 does not exist."""
    d.get(f"{srv.url}/compare?job={jobs['stalled']}&job=999&job={jobs['done']}")
    until(d, 20, lambda d: "job #999 does not exist" in text(d, "#compare-missing"), "the missing job is not named")
    until(d, 20, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#chart-cmp-loss .uplot")) == 1, "no loss chart")
    assert d.execute_script("return document.querySelectorAll('#compare-diff thead th a').length") == 2
    shot(d, "trust-compare-missing")
    assert not [e for e in console_errors(d) if "999" not in e or "Uncaught" in e], console_errors(d)
    d.find_element(By.CSS_SELECTOR, "#compare-missing button").click()
    until(d, 10, lambda d: "999" not in d.current_url, "the missing job stays in the URL")


def test_unknown_route_in_the_browser_is_the_apps_page(srv, d):
    """Item 14: an unknown route shows the app's 404 page, with its header, not raw JSON."""
    d.get(srv.url + "/no/such/page")
    until(d, 10, lambda d: "No such page" in text(d, "main"), "no 404 page")
    assert "/no/such/page" in text(d, "main") and "detail" not in d.page_source.split("<main")[1]
    assert d.find_elements(By.CSS_SELECTOR, "header.top nav a")
    shot(d, "trust-404")


def test_submit_no_duplicate_after_warnings_hub_fields_folded_and_command_ranks(srv, d, jobs):  # jobs: claimed first
    """Item 12: after "queued with 1 warning" the button stays off (a second click would queue a
    duplicate) until a setting changes; the Hub-only fields are folded away. Item 11: the Command
    form has processes per machine, max retries and priority."""
    d.get(srv.url + "/submit")
    until(d, 20, lambda d: d.find_element(By.ID, "submit").is_enabled(), "no submit form")
    assert not d.find_element(By.NAME, "revision").is_displayed()
    assert not attr(d, "#details-hub", "open")
    # issue 33 #21: "Loss on the response only" follows the data's shape until set: off for the plain-
    # text demo, on once a prompt field is named, half-ticked for a file whose columns are not known yet
    def resp() -> tuple:
        return tuple(attr(d, "#f-loss_on_response_only", a) for a in ("checked", "indeterminate"))
    assert resp() == (None, None)
    d.find_element(By.NAME, "prompt_field").send_keys("question")
    assert resp() == ("true", None)
    d.find_element(By.NAME, "prompt_field").clear()
    data = d.find_element(By.NAME, "dataset")
    data.clear()
    data.send_keys("/data/mine.jsonl")
    assert resp() == (None, "true")
    assert "decided from the dataset's columns" in attr(d, "#f-loss_on_response_only", "title")
    shot(d, "submit-response-only-undecided")
    data.clear()
    data.send_keys("builtin:demo")
    assert resp() == (None, None)
    d.find_element(By.NAME, "streaming").click()
    d.find_element(By.NAME, "epochs").send_keys("2")
    d.find_element(By.NAME, "name").send_keys("warned once")
    steps = d.find_element(By.NAME, "max_steps")
    steps.clear()
    steps.send_keys("5")
    d.find_element(By.ID, "submit").click()
    until(d, 20, lambda d: d.find_element(By.ID, "submit-warnings").is_displayed(), "no warnings shown")
    btn = d.find_element(By.ID, "submit")
    assert not btn.is_enabled() and btn.text.startswith("Queued as #"), btn.text
    d.execute_script("arguments[0].click()", btn)  # even a forced click queues nothing
    time.sleep(0.5)
    with srv.client() as c:
        warned = c.get("/api/jobs", params={"q": "warned once"}).json()
        assert warned["total"] == 1
        assert c.get(f"/api/jobs/{warned['jobs'][0]['id']}").json()["spec"]["loss_on_response_only"] is False
    shot(d, "trust-submit-queued-warnings")
    d.find_element(By.NAME, "seed").send_keys("1")  # a changed setting is a new job: the button is back
    until(d, 5, lambda d: d.find_element(By.ID, "submit").is_enabled(), "the button stays off after a change")

    d.get(srv.url + "/submit?mode=command")
    until(d, 20, lambda d: d.find_element(By.ID, "command-form").is_displayed(), "no command form")
    d.find_element(By.ID, "c-command").send_keys("python train.py")
    for field, value in (("c-nproc-per-node", "2"), ("c-max-retries", "0"), ("c-priority", "7")):
        box = d.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    d.find_element(By.ID, "command-submit").click()
    until(d, 20, lambda d: "/jobs/" in d.current_url, "the command job was not submitted")
    with srv.client() as c:
        spec = c.get(f"/api/jobs/{d.current_url.rsplit('/', 1)[1]}").json()["spec"]
    assert (spec["nproc_per_node"], spec["max_retries"], spec["priority"]) == (2, 0, 7), spec
    d.get(srv.url + "/submit?mode=command")
    until(d, 20, lambda d: d.find_element(By.ID, "command-form").is_displayed(), "no command form")
    box = d.find_element(By.ID, "c-nproc-per-node")
    box.clear()
    box.send_keys("many")
    d.find_element(By.ID, "c-command").send_keys("true")
    d.find_element(By.ID, "command-submit").click()
    until(d, 20, lambda d: "whole number" in text(d, "#c-nproc-per-node-error"),
          "a bad rank count is not named beside its field")
    d.set_window_size(390, 844)
    shot(d, "trust-submit-command-phone")
    d.set_window_size(1280, 800)


def test_pending_data_check_keeps_the_form_until_its_warnings_come(server_factory):
    """Item 8: a submit whose data analysis outlasts the server's wait answers "pending"; the form
    stays, says it is checking the data, and shows the truncation warning when the analysis is done
    (GET /api/jobs/{id}/preflight), instead of going to the job page and losing it."""
    s = server_factory(preflight_wait_s=0.01)
    d = make_driver()  # its own browser: a login here would replace the module browser's session cookie
    try:
        pending_check(s, d)
    finally:
        d.quit()
        shutil.rmtree(d.profile_dir, ignore_errors=True)


def pending_check(s, d):
    login(d, s)
    d.get(s.url + "/submit")
    until(d, 20, lambda d: d.find_element(By.ID, "submit").is_enabled(), "no submit form")
    box = d.find_element(By.NAME, "max_seq_length")
    box.clear()
    box.send_keys("16")
    d.find_element(By.NAME, "name").send_keys("short rows")
    d.find_element(By.ID, "submit").click()
    until(d, 20, lambda d: "checking your data" in text(d, "#submit-warnings"), "no 'checking your data'")
    assert "/submit" in d.current_url
    shot(d, "trust-submit-checking-data")
    until(d, 180, lambda d: "max_seq_length" in text(d, "#submit-warnings ul.warnings"),
          "the pending analysis' warning never shown")
    assert "/submit" in d.current_url and "would be cut" in text(d, "#submit-warnings")
    shot(d, "trust-submit-pending-warnings")
    with s.client() as c:
        jid = c.get("/api/jobs", params={"q": "short rows"}).json()["jobs"][0]["id"]
        again = c.get(f"/api/jobs/{jid}/preflight", params={"wait_s": 0}).json()
        assert again["preflight"]["analysis"] == "cached" and [w["kind"] for w in again["warnings"]] == ["truncation"]
        assert c.get("/api/jobs/99999/preflight").status_code == 404
        assert c.get(f"/api/jobs/{jid}/preflight", params={"wait_s": -1}).status_code == 422


def test_eval_prompts_one_box_each_and_clone_keeps_a_multiline_prompt_whole(srv, d, jobs):
    """Item 9: a prompt may span lines in the browser (one box per prompt), and cloning an
    API-submitted "Q: ...?\\nA:" prompt keeps it one prompt."""
    want = ["Q: what is 2+2?\nA:", "Once upon a time"]
    with srv.client() as c:
        src = c.post("/api/jobs",
                     json={"name": "prompted", "max_steps": 5, "eval_fraction": 0.1, "eval_prompts": want}).json()["id"]
    d.get(f"{srv.url}/submit?clone={src}")
    until(d, 20, lambda d: d.find_element(By.ID, "clone-note").is_displayed(), "not cloned")
    boxes = d.find_elements(By.CSS_SELECTOR, "textarea[name=eval_prompts]")
    assert [b.get_attribute("value") for b in boxes] == want, [b.get_attribute("value") for b in boxes]
    assert attr(d, "#details-eval", "open") is not None  # a set prompt opens its group
    add = d.find_element(By.CSS_SELECTOR, ".add-prompt")
    d.execute_script("arguments[0].scrollIntoView({block: 'center'})", add)  # not under the sticky actions bar
    add.click()
    third = d.find_elements(By.CSS_SELECTOR, "textarea[name=eval_prompts]")[2]
    third.send_keys("Translate:\nhello ->")
    shot(d, "trust-submit-prompts", full=True)
    d.find_element(By.ID, "submit").click()
    until(d, 20, lambda d: "/jobs/" in d.current_url, "the clone was not submitted")
    with srv.client() as c:
        spec = c.get(f"/api/jobs/{d.current_url.rsplit('/', 1)[1]}").json()["spec"]
    assert spec["eval_prompts"] == want + ["Translate:\nhello ->"], spec["eval_prompts"]


def test_a_queued_job_says_what_it_waits_for(srv, d, jobs):
    """Item 16: a queued job's page names its place in the queue and the job it waits behind, says
    what the workers are doing, and shows no empty charts."""
    with srv.client() as c:
        first = c.post("/api/jobs", json={"name": "first in line", "max_steps": 5, "priority": 50}).json()["id"]
        second = c.post("/api/jobs", json={"name": "second in line", "max_steps": 5, "priority": 49}).json()["id"]
    d.get(f"{srv.url}/jobs/{second}")
    until(d, 20, lambda d: "#2 in the queue" in text(d, "#phase-text"), "no place in the queue")
    assert f"behind #{first} first in line" in text(d, "#phase-text"), text(d, "#phase-text")
    assert "worker" in text(d, "#phase-text")
    assert text(d, "#elapsed-label") == "Queued for" and "waiting" not in text(d, "#elapsed")
    assert not [b for b in d.find_elements(By.CSS_SELECTOR, ".charts .chart-box") if b.is_displayed()], \
        "empty charts shown"
    shot(d, "trust-job-queued")
    with srv.client() as c:  # out of the way of the other tests' stand-in agents
        for j in (first, second):
            c.post(f"/api/jobs/{j}/cancel").raise_for_status()


def test_rank_table_keeps_up_ticks_explains_and_ends_where_the_job_did(srv, d, jobs):
    """Item 5: rank 0's step follows the header (its metrics come before the heartbeat's row); the
    last-progress ages tick; "own work" is explained on the page; a completed job's ranks end at its
    last step (not 297 and 298 of 300); on a phone every column is readable."""
    with srv.client() as c:
        jid = c.post("/api/jobs",
                     json={"name": "two ranks", "max_steps": 300, "nproc_per_node": 2, "priority": 90}).json()["id"]
    a = StandIn(srv, "box-ranks")
    assert a.claim() == jid
    now = time.time()
    a.http.post(f"/api/agents/{a.id}/heartbeat", json={"jobs": {str(jid): now}, "ranks": {str(jid): [
        {"rank": r, "host": "box", "pid": 100 + r, "device": "cpu", "step": 120 - r, "step_time_s": 0.5,
         "busy_s": 0.3 + r / 10,
         "rss_mb": 500, "alive_at": now, "progress_at": now - 3} for r in (0, 1)]}}).raise_for_status()
    a.send(jid, ("phase", {"name": "training", "done": 125, "total": 300, "unit": "steps"}),
           ("metrics", {"step": 125, "values": {"loss": 1.0}}))
    d.get(f"{srv.url}/jobs/{jid}")
    until(d, 20, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#ranks-body tr")) == 2, "no rank rows")
    rank_cells = lambda: cells(d, "#ranks-body tr")  # noqa: E731
    until(d, 10, lambda d: rank_cells()[0][4] == "125", "rank 0 lags the header")
    assert text(d, "#step").startswith("125")
    age = rank_cells()[0][7]
    until(d, 10, lambda d: rank_cells()[0][7] != age, "the last-progress age does not tick")
    assert "own work" in text(d, "#ranks .help") and "Own work" in text(d, "#ranks thead")
    d.set_window_size(390, 844)
    d.execute_script("document.getElementById('ranks').scrollIntoView()")
    assert d.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")
    assert d.execute_script("return [...document.querySelectorAll('#ranks-body tr:first-child td')].every((td) => "
                            "td.getBoundingClientRect().right <= window.innerWidth + 1)")
    shot(d, "trust-ranks-phone")
    d.set_window_size(1280, 800)
    a.send(jid, ("phase", {"name": "training", "done": 300, "total": 300, "unit": "steps"}),
           ("state",
            {"state": "completed", "reason": "done", "ranks": {"0": "exited with code 0", "1": "exited with code 0"}}))
    until(d, 20, lambda d: [r[4] for r in rank_cells()] == ["300", "300"], "a completed job's ranks end short")
    d.execute_script("document.getElementById('ranks').scrollIntoView()")
    shot(d, "trust-ranks-ended")


def test_generations_as_a_prompt_by_step_table_and_a_long_summary_stays_in_its_panel(srv, d, jobs):
    """Item 18: generations are a prompt x step table right under the charts (not far down a side
    column); a continuation that starts with a newline shows where the prompt ends; a trainer's long
    summary JSON wraps inside its panel."""
    with srv.client() as c:
        jid = c.post("/api/jobs", json={"name": "generating", "max_steps": 20, "priority": 95}).json()["id"]
    a = StandIn(srv, "box-gen")
    assert a.claim() == jid
    gens = lambda s: [{"prompt": "Q: 2+2?\nA:", "output": f" {s // 10 + 2}"},  # noqa: E731
                      {"prompt": "Once upon", "output": f"\na time {s}"}]
    a.send(jid,
           *[("metrics", {"step": s, "values": {"loss": 3 - s / 10, "eval/loss": 3.1 - s / 10}}) for s in (10, 20)],
           *[("info", {"eval_step": s, "eval_generations": gens(s)}) for s in (10, 20)],
           ("info", {"train_summary": {f"metric_{i}_with_a_long_name": 123456.789 * i for i in range(40)}}))
    d.get(f"{srv.url}/jobs/{jid}")
    until(d, 20, lambda d: d.find_elements(By.CSS_SELECTOR, "#generations .gen-table tbody tr"), "no generations table")
    heads = [th.text for th in d.find_elements(By.CSS_SELECTOR, "#generations thead th")]
    assert heads == ["Prompt", "step 20", "step 10"], heads
    assert len(d.find_elements(By.CSS_SELECTOR, "#generations tbody tr")) == 2
    assert len(d.find_elements(By.CSS_SELECTOR, "#generations .gen-nl")) == 2  # "\na time": the new line is marked
    gen_top, log_top = d.execute_script("return [document.getElementById('generations').getBoundingClientRect().top, "
                                        "document.getElementById('log').getBoundingClientRect().top]")
    assert gen_top < log_top, (gen_top, log_top)
    until(d, 10, lambda d: "train summary" in text(d, "#info"), "no summary among the choices")
    assert d.execute_script("const i = document.getElementById('info'); return i.scrollWidth <= i.clientWidth + 1")
    shot(d, "trust-generations", full=True)
    d.set_window_size(390, 844)
    d.refresh()
    until(d, 20, lambda d: d.find_elements(By.CSS_SELECTOR, "#generations .gen-table"), "phone: no generations")
    assert d.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")
    d.execute_script("document.getElementById('generations').scrollIntoView()")
    shot(d, "trust-generations-phone")
    d.set_window_size(1280, 800)


def test_server_gone_banner_with_the_time_of_the_last_data(srv, d, jobs):
    """Item 17: when the server goes away a banner says so and since when; it goes when it is back.
    (Last in this file: it stops the module's server and starts it again.)"""
    d.get(f"{srv.url}/jobs/{jobs['done']}")
    until(d, 20, lambda d: d.find_elements(By.CSS_SELECTOR, "#conn.on"), "not live")
    srv.kill(signal.SIGTERM)
    until(d, 30, lambda d: d.find_elements(By.CSS_SELECTOR, "#offline-banner:not([hidden])"),
          "no banner when the server is gone")
    banner = text(d, "#offline-banner")
    assert "not answering" in banner and "ago" in banner or "just now" in banner, banner
    shot(d, "trust-offline-banner")
    srv.start()
    until(d, 60, lambda d: not d.find_element(By.ID, "offline-banner").is_displayed(),
          "the banner stays after the server is back")
