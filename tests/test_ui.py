"""The browser UI end to end: a real server, a real agent training the demo model, and Debian's
headless Chromium driven by Selenium (never a downloaded browser). Screenshots of every page go to
test-artifacts/ui/."""
from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
from conftest import ARTIFACTS, wait_for

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = os.environ.get("TOKENPULSE_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("TOKENPULSE_CHROMEDRIVER", "/usr/bin/chromedriver")
SHOTS = ARTIFACTS / "ui"
FAST = {"batch_size": 2, "grad_accum": 1, "precision": "fp32", "max_seq_length": 128}  # no autotuning: quicker start

pytestmark = pytest.mark.skipif(not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()),
                                reason="needs Debian's chromium and chromedriver")


def make_driver(width: int = 1280, height: int = 800):
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--window-size={width},{height}"):
        opts.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="tp-chromium-")
    opts.add_argument(f"--user-data-dir={profile}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.profile_dir = profile
    return driver


@pytest.fixture
def browser():
    d = make_driver()
    yield d
    d.quit()
    shutil.rmtree(d.profile_dir, ignore_errors=True)


def login(d, server) -> None:
    d.get(server.url + "/")  # not logged in: redirected to the login form
    assert "/login" in d.current_url
    d.find_element(By.ID, "token").send_keys(server.token)
    d.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
    wait(d, 30).until(lambda d: d.current_url.rstrip("/") == server.url
                      and d.find_elements(By.CSS_SELECTOR, "#conn.on"))


def wait(d, timeout: float) -> WebDriverWait:
    return WebDriverWait(d, timeout, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,))


def until(d, timeout: float, cond, what: str) -> None:
    """Wait for cond; on timeout say what the page showed then (state, phase, errors)."""
    try:
        wait(d, timeout).until(cond)
    except TimeoutException:
        raise AssertionError(f"{what} within {timeout} s; page: state={text(d, '#job-state')!r} "
                             f"phase={text(d, '#phase-text')!r} error={text(d, '.error')!r} "
                             f"url={d.current_url}") from None


def attr(d, css: str, name: str):
    """An attribute of the first element matching css, read in one step in the page: a live page
    re-renders between a find and a read (a stale element), the more so on a busy machine."""
    return d.execute_script(ATTR_JS, css, name)


# Selenium's get_attribute, as its atom answers: the element's property where it has a plain one
# (a field's live value, textContent, a boolean as "true" or None), else the attribute.
ATTR_JS = """
const e = document.querySelector(arguments[0]), n = arguments[1];
if (!e) return null;
const v = e[n];
if (typeof v === "boolean") return v ? "true" : null;
if (typeof v === "string" || typeof v === "number") return String(v);
return e.getAttribute(n);
"""


def cells(d, row_css: str, cell: str = "td") -> list[list[str]]:
    """The text of each row's cells, read in one step in the page (see attr: a live table
    re-renders between a find and a read)."""
    return d.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(r => [...r.querySelectorAll(arguments[1])]"
        ".map(c => c.innerText.trim()))", row_css, cell)


def texts(d, css: str, shown: bool = False) -> list[str]:
    """The text of every element matching css (only those on screen: shown), read in one step in the
    page (see attr: a live list re-renders between a find and a read)."""
    return d.execute_script(
        "return [...document.querySelectorAll(arguments[0])].filter(e => !arguments[1] || "
        "e.getClientRects().length).map(e => e.innerText.trim())", css, shown)


def text(d, css: str) -> str:
    els = d.find_elements(By.CSS_SELECTOR, css)
    return els[0].text if els else ""


def shot(d, name: str, full: bool = False) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    if full:
        w = d.get_window_size()["width"]
        h = d.execute_script("return document.documentElement.scrollHeight")
        d.set_window_size(w, min(max(h, 800) + 90, 4000))
        painted(d)
    d.save_screenshot(str(SHOTS / f"{name}.png"))
    if full:
        d.set_window_size(1280, 800)


def painted(d) -> None:
    """Wait until the page has laid out and painted a frame after a change (two animation frames)."""
    d.execute_async_script("const done = arguments[arguments.length - 1];"
                           "requestAnimationFrame(() => requestAnimationFrame(() => done()))")


def console_errors(d) -> list[str]:
    return [e["message"] for e in d.get_log("browser") if e["level"] == "SEVERE"]


def test_ui_end_to_end(agent_server, browser):
    server, d = agent_server, browser
    login(d, server)
    errors: list[str] = []

    # -- submit page: Analyze dataset shows the recommended length and the layouts table --
    d.get(server.url + "/submit")
    d.find_element(By.ID, "analyze").click()
    until(d, 180, lambda d: text(d, "#recommended"), "no dataset analysis")
    rec = text(d, "#recommended")
    assert re.fullmatch(r"\d[\d,]* tokens", rec), rec
    assert "truncates" in text(d, "#analysis-summary")
    assert "Packing" in text(d, "#analysis-table")
    assert d.execute_script("return document.querySelectorAll('#chart-hist canvas').length") == 1
    d.find_element(By.ID, "use-recommended").click()
    assert attr(d, '[name="max_seq_length"]', "value") == rec.split()[0].replace(",", "")
    shot(d, "submit-analysis", full=True)

    # -- an invalid value: the API's message appears next to its field --
    lr = d.find_element(By.NAME, "learning_rate")
    lr.clear()
    lr.send_keys("5")
    d.find_element(By.ID, "submit").click()
    wait(d, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#f-learning_rate-error"))
    assert "invalid" in lr.get_attribute("class")
    assert "/submit" in d.current_url
    shot(d, "submit-validation")
    # the refused POST is the only thing the console may show so far (Chromium logs every 4xx)
    errors += [e for e in console_errors(d) if not ("/api/jobs" in e and "422" in e)]

    # -- submit the demo job through the form --
    lr.clear()
    lr.send_keys("0.0003")
    d.find_element(By.NAME, "name").send_keys("ui-demo")
    steps = d.find_element(By.NAME, "max_steps")
    steps.clear()
    steps.send_keys("30")
    d.find_element(By.ID, "submit").click()
    wait(d, 30).until(lambda d: re.search(r"/jobs/\d+$", d.current_url))
    job_id = int(d.current_url.rsplit("/", 1)[1])

    # -- watch it: phase text changes, chart points increase, the job ends completed --
    phases, points = [], []
    deadline = time.time() + 300
    while time.time() < deadline:
        p = text(d, "#phase-text")
        if p and (not phases or phases[-1] != p):
            phases.append(p)
        n = int(attr(d, "#chart-loss", "data-points") or 0)
        if n and (not points or points[-1] != n):
            points.append(n)
        if text(d, "#job-state") == "completed":
            break
        time.sleep(0.1)
    assert text(d, "#job-state") == "completed", (phases, points)
    until(d, 30, lambda d: (d.execute_script("return TPJOB.series.loss.step") or [0])[-1] == 30,
          "the final refill never reached step 30")
    final_points = int(attr(d, "#chart-loss", "data-points"))
    names = {re.split(r"[\d·]", p)[0].strip() for p in phases}
    assert len(names) >= 2, phases  # e.g. loading model, tokenizing, training
    assert any(p.startswith("training") for p in phases), phases
    assert len([n for n in points if n > 0]) >= 2 and points == sorted(points), points  # grew live
    assert final_points >= 30 * 0.9, final_points
    assert d.execute_script("return document.querySelectorAll('#chart-loss canvas').length") == 1
    assert "30 / 30" in text(d, "#step")
    assert text(d, "#info .choices"), "automatic choices are shown"
    assert "Final model" in text(d, "#output")
    assert d.find_element(By.ID, "retry").is_displayed() and not d.find_element(By.ID, "cancel").is_displayed()
    d.execute_script("window.scrollTo(0, 0)")
    shot(d, "job-completed", full=True)
    errors += console_errors(d)

    # -- jobs page lists it, completed; workers shows the agent; compare overlays it --
    d.get(server.url + "/")
    wait(d, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, f'tr[data-job="{job_id}"] .badge.completed'))
    row = d.find_element(By.CSS_SELECTOR, f'tr[data-job="{job_id}"]').text
    assert "ui-demo" in row and "30 / 30" in row and "tok/s" in row, row
    shot(d, "jobs")
    d.get(server.url + "/workers")
    wait(d, 30).until(lambda d: "a1" in text(d, "#workers-body") and "online" in text(d, "#workers-body"))
    shot(d, "workers")
    d.get(f"{server.url}/compare?job={job_id}")
    wait(d, 30).until(lambda d: d.execute_script("return document.querySelectorAll('#chart-cmp-loss "
                                                 "canvas').length") == 1)
    shot(d, "compare")
    errors += console_errors(d)

    # -- cancel a slow job from its page --
    with server.client() as c:
        slow = c.post("/api/jobs",
                      json={"name": server.plan_fault("slow", step_sleep_s=0.2), "max_steps": 2000, **FAST}).json()
    d.get(f"{server.url}/jobs/{slow['id']}")
    until(d, 180, lambda d: text(d, "#job-state") == "running" and text(d, "#phase-text").startswith("training"),
          "the slow job is not training")
    until(d, 60, lambda d: int(attr(d, "#chart-loss", "data-points") or 0) >= 2,
          "no chart points for the slow job")
    assert "hb-ok" in attr(d, "#heartbeat time", "class") and attr(d, "#heartbeat time", "title"), \
        "heartbeat age with absolute time on hover"
    shot(d, "job-running")
    # pause (a checkpoint, the process ends), resume (queued again, continues from the checkpoint)
    d.find_element(By.ID, "pause").click()
    until(d, 60, lambda d: text(d, "#job-state") == "paused", "not paused")
    assert d.find_element(By.ID, "resume").is_displayed() and not d.find_element(By.ID, "pause").is_displayed()
    d.find_element(By.ID, "resume").click()
    until(d, 120, lambda d: text(d, "#job-state") == "running", "not running again after resume")
    until(d, 30, lambda d: "#2" in text(d, "#attempts"), "no second attempt listed")
    d.find_element(By.ID, "cancel").click()
    d.find_element(By.ID, "cancel-confirm").click()
    until(d, 60, lambda d: text(d, "#job-state") == "cancelled", "not cancelled")
    assert server.wait_job(slow["id"], timeout=60)["state"] == "cancelled"
    shot(d, "job-cancelled")

    # -- phone width: the jobs list becomes cards, nothing scrolls sideways --
    d.set_window_size(390, 844)
    d.get(server.url + "/")
    wait(d, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, f'tr[data-job="{job_id}"]'))
    assert d.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")
    shot(d, "jobs-phone")
    errors += console_errors(d)
    assert not errors, errors


def test_reconnect_fills_gap(server_factory, browser):
    """A server restart mid-training: the page reconnects and fills the gap from REST, so the loss
    chart has every step with no hole."""
    server = server_factory()
    server.start_agent("a1")
    d = browser
    login(d, server)
    with server.client() as c:
        job = c.post("/api/jobs",
                     json={"name": server.plan_fault("restart", step_sleep_s=0.1), "max_steps": 40, **FAST}).json()
    d.get(f"{server.url}/jobs/{job['id']}")
    until(d, 180, lambda d: int(attr(d, "#chart-loss", "data-points") or 0) >= 3,
          "no chart points before the restart")
    server.kill(signal.SIGTERM)
    wait(d, 30).until(lambda d: not d.find_elements(By.CSS_SELECTOR, "#conn.on"))
    # training goes on while the server is down: the agent journals what it cannot send (the gap)
    held = server.journaled("a1", job["id"])
    wait_for(lambda: server.journaled("a1", job["id"]) >= held + 5, 60, "events journaled while the server is down")
    server.start()
    wait(d, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#conn.on"))
    until(d, 180, lambda d: text(d, "#job-state") == "completed", "not completed after the restart")
    until(d, 30, lambda d: (d.execute_script("return TPJOB.series.loss.step") or [0])[-1] == 40,
          "the chart never reached the last step")
    steps = d.execute_script("return TPJOB.series.loss.step")
    assert steps == list(range(steps[0], steps[0] + len(steps))), f"hole in the chart: {steps}"
    assert steps[-1] == 40
    errs = [e for e in console_errors(d)  # while the server was down: expected, nothing else
            if not ("WebSocket" in e or "Failed to load resource" in e or "ERR_CONNECTION_REFUSED" in e)]
    assert not errs, errs


def test_submit_form_covers_every_jobspec_field(server):
    """The submit page has a hand-written input (label and help) for every JobSpec setting. Checked
    against the hand-written FORM table and the page as served; form_fields() also gives a catch-all
    input to any field the table lacks, so checking its output alone could never fail."""
    from html.parser import HTMLParser

    from tokenpulse.protocol import JobSpec, LoraSpec, SlurmSpec, StallSpec
    from web.pages import FORM
    want = {n for n in JobSpec.model_fields if n not in ("lora", "stall", "slurm")}
    want |= {f"lora.{n}" for n in LoraSpec.model_fields} | {f"stall.{n}" for n in StallSpec.model_fields}
    want |= {f"slurm.{n}" for n in SlurmSpec.model_fields}
    written = {name: help_text for _, _, fields in FORM for name, _, _, help_text in fields}
    assert want <= set(written), f"JobSpec fields without a hand-written form entry: {want - set(written)}"
    assert all(written.values()), [n for n, h in written.items() if not h]

    class Inputs(HTMLParser):
        def __init__(self):
            super().__init__()
            self.inputs, self.helps, self._help = {}, {}, None

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag in ("input", "select", "textarea") and a.get("name"):
                self.inputs[a["name"]] = a.get("aria-describedby")
            self._help = a.get("id") if tag == "span" and "help" in (a.get("class") or "") else None

        def handle_data(self, data):
            if self._help:
                self.helps[self._help] = self.helps.get(self._help, "") + data.strip()

    with server.client() as c:
        r = c.get("/submit")
    assert r.status_code == 200 and 'id="submit-form"' in r.text, r.text[:500]
    page = Inputs()
    page.feed(r.text)
    assert want <= set(page.inputs), f"no input on the page for {want - set(page.inputs)}"
    assert all(page.helps.get(page.inputs[n]) for n in want), [n for n in want if not page.helps.get(page.inputs[n])]


def test_alert_banner_stack_ack_and_notification(server, browser):
    """An alert with a stack dump, sent the way an agent sends it: the job page shows it with its
    stack, the header counts it, a desktop notification fires (permission granted), Acknowledge
    works. A stand-in agent speaks the real agent protocol, so no training is needed."""
    import httpx
    d = browser
    agent = httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {server.agent_token}"})
    aid = agent.post("/api/agents", json={"name": "fake", "host": "h"}).json()["id"]
    with server.client() as c:
        jid = c.post("/api/jobs", json={"name": "stuck <img src=x onerror=alert(1)>"}).json()["id"]
    assert agent.post(f"/api/agents/{aid}/claim").json()["job_id"] == jid
    # A granted Notification that records what it was asked to show.
    d.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": """
        window.__notes = [];
        window.Notification = class { constructor(title, o) { window.__notes.push([title, o && o.body]); }
          static get permission() { return "granted"; }
          static requestPermission() { return Promise.resolve("granted"); } };"""})
    login(d, server)
    d.get(f"{server.url}/jobs/{jid}")
    until(d, 30, lambda d: d.find_elements(By.CSS_SELECTOR, "#conn.on") and text(d, "#job-state"), "page not live")
    now = time.time()
    events = [{"kind": "phase", "job_id": jid, "seq": 0, "t": now,
               "data": {"name": "training", "done": 3, "total": 10, "unit": "steps"}},
              {"kind": "metrics", "job_id": jid, "seq": 1, "t": now, "data": {"step": 3, "values": {"loss": 2.5}}},
              {"kind": "alert", "job_id": jid, "seq": 2, "t": now, "data": {
                  "kind": "stalled", "severity": "critical", "message": "stalled: no progress in 'training' for 60 s",
                  "stack": "Thread 0x1 (most recent call first):\n  File \"train.py\", line 42 in step"}}]
    agent.post(f"/api/agents/{aid}/events", json={"events": events}).raise_for_status()
    until(d, 30, lambda d: d.find_elements(By.CSS_SELECTOR, "#alerts-live .alert.critical.open"), "no alert banner")
    banner = d.find_element(By.CSS_SELECTOR, "#alerts-live .alert")
    assert "stalled" in banner.text and "Stack dump (2 lines" in banner.text
    # the phase line renders on its own frame, not always with the banner's
    until(d, 30, lambda d: text(d, "#phase-text") == "training 3/10 steps", "the phase line")
    assert text(d, "#job-name") == "stuck <img src=x onerror=alert(1)>"  # names are text, never markup
    assert not d.find_elements(By.CSS_SELECTOR, "main img")
    until(d, 30, lambda d: text(d, "#alert-count") == "⚠ 1", "header badge")
    assert d.execute_script("return window.__notes") == [[f"tokenpulse: job {jid} stalled",
                                                          "stalled: no progress in 'training' for 60 s"]]
    banner.find_element(By.TAG_NAME, "summary").click()
    assert 'line 42 in step' in banner.find_element(By.TAG_NAME, "pre").text
    shot(d, "job-alert")
    banner.find_element(By.XPATH, ".//button[text()='Acknowledge']").click()
    until(d, 30, lambda d: d.find_elements(By.CSS_SELECTOR, "#alerts-live .alert.acked"), "not acknowledged")
    until(d, 30, lambda d: not d.find_element(By.ID, "alert-count").is_displayed(), "badge still shown")
    with server.client() as c:
        assert c.get("/api/alerts", params={"job_id": jid}).json()[0]["state"] == "acked"
    assert not console_errors(d), console_errors(d)
