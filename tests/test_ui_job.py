"""The job page in headless Chromium (issue 11, browser items 13-15, 18-20): the phase line's final
states, smoothed and stale live figures, only the memory series that exist, chart options (log
scale, outlier clipping, wall-clock axis, keyboard zoom), CSV/PNG export and text alternatives, the
training process's output in the Log, and "Dump stacks" that leaves the controls as they were.

A stand-in agent speaking the real agent protocol drives the figures (exact values, no training);
the log and control items use a real agent and a real training process."""
from __future__ import annotations

import csv
import io
import re
import time

import httpx
from conftest import wait_for
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select
from test_ui import FAST, attr, browser, cells, console_errors, login, shot, text, until  # noqa: F401 (browser: a fixture)


def js(d, code: str):
    return d.execute_script(code)


def post_events(agent, aid: int, jid: int, seq: int, events: list[tuple]) -> int:
    """events: (kind, data, t); returns the next seq."""
    batch = []
    for kind, data, t in events:
        batch.append({"kind": kind, "job_id": jid, "seq": seq, "t": t, "data": data})
        seq += 1
    agent.post(f"/api/agents/{aid}/events", json={"events": batch}).raise_for_status()
    return seq


def number(s: str) -> float:
    m = re.search(r"([\d,.]+)\s*(k)?", s)
    assert m, s
    return float(m.group(1).replace(",", "")) * (1000 if m.group(2) else 1)


class FakeRun:
    """A job claimed by a stand-in agent that speaks the real agent protocol, with 80 logged steps
    posted on a CPU: speed alternating between two values every step, a loss with one spike at
    step 40, RSS but no CUDA memory, an MFU against a CPU peak. The page is open on it."""

    def __init__(self, server_factory, d, tmp_path, name: str):
        server = server_factory(agent_lost_after_s=600)  # the stand-in agent sends no heartbeats
        agent = httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {server.agent_token}"})
        aid = agent.post("/api/agents", json={"name": "fake", "host": "h"}).json()["id"]
        with server.client() as c:
            jid = c.post("/api/jobs", json={"name": name, "max_steps": 100}).json()["id"]
        assert agent.post(f"/api/agents/{aid}/claim").json()["job_id"] == jid
        d.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(tmp_path)})
        login(d, server)
        d.get(f"{server.url}/jobs/{jid}")
        until(d, 15, lambda d: d.find_elements(By.CSS_SELECTOR, "#conn.on") and text(d, "#job-state"), "page not live")

        t0 = time.time() - 80
        evs = [("info", {"device": "cpu", "reason": "no accelerator found"}, t0),
               ("info", {"peak_flops": 1.6e11, "flops_per_token": 6.5e6, "reason": "MFU is measured against a matmul"},
                t0),
               ("phase", {"name": "training", "done": 0, "total": 100, "unit": "steps"}, t0)]
        for s in range(1, 81):
            fast = s % 2 == 0
            evs.append(("metrics", {"step": s, "values": {
                "loss": 1000.0 if s == 40 else 5 - s / 40, "lr": 3e-4 * (100 - s) / 100, "grad_norm": 1.0,
                "rss_mb": 500.0 + s,
                "tokens_per_s": 3000.0 if fast else 1000.0, "padded_tokens_per_s": 3300.0 if fast else 1100.0,
                "step_time_s": 0.1 if fast else 0.3, "eta_s": (100 - s) * (0.1 if fast else 0.3), "mfu": 0.7}}, t0 + s))
            evs.append(("phase", {"name": "training", "done": s, "total": 100, "unit": "steps"}, t0 + s))
        seq = post_events(agent, aid, jid, 0, evs)
        until(d, 20, lambda d: attr(d, "#chart-loss", "data-points") == "80",
              "80 loss points")
        self.d, self.agent, self.aid, self.jid, self.seq, self.t0 = d, agent, aid, jid, seq, t0

    def post(self, events: list[tuple]) -> None:
        self.seq = post_events(self.agent, self.aid, self.jid, self.seq, events)


def test_live_speed_smoothed_mfu_caveat_and_only_existing_series(server_factory, browser, tmp_path):
    """Issue 11 #19: tokens/s and ETA are smoothed; MFU on a CPU says it is rough; no "CUDA peak" on a CPU run."""
    run = FakeRun(server_factory, browser, tmp_path, "speed")
    d = run.d
    # 19: smoothed tokens/s and ETA (the raw values swing 1,000 <-> 3,000 tok/s and 6 s <-> 18 s)
    until(d, 10, lambda d: "tok/s" in text(d, "#tps"), "tokens/s shown")
    tps = number(text(d, "#tps"))
    assert 1500 <= tps <= 2500, text(d, "#tps")
    assert "latest: 3 ktok/s" in attr(d, "#tps", "title")
    eta = text(d, "#eta")
    assert re.fullmatch(r"\d+ s", eta) and 3 <= int(eta.split()[0]) <= 5, eta  # 20 steps x ~0.2 s
    # MFU on a CPU says it is rough; the memory chart has no "CUDA peak" series on a CPU run
    assert "70 %" in text(d, "#mfu") and "rough on CPU" in text(d, "#mfu")
    assert "other processes" in attr(d, "#mfu .caveat", "title")
    assert attr(d, "#chart-mem", "data-series") == "process RSS"
    assert "CUDA" not in text(d, "#chart-mem")
    assert not console_errors(d), console_errors(d)


def test_chart_log_clip_wallclock_keyboard_export_and_text(server_factory, browser, tmp_path):
    """Issue 11 #20: log scale, outlier clipping, a wall-clock x axis, keyboard zoom, CSV and PNG
    export, a text alternative for each chart."""
    run = FakeRun(server_factory, browser, tmp_path, "charts")
    d, jid, t0 = run.d, run.jid, run.t0
    # 20: text alternative, outlier clipping, log scale, keyboard zoom, wall-clock axis
    summary = attr(d, "#chart-loss-summary", "textContent")
    assert summary.startswith("Loss: 80 points from step 1 to step 80."), summary
    assert "highest 1000 (step 40)" in summary, summary
    assert attr(d, "#chart-loss", "aria-describedby") == "chart-loss-summary chart-keys"
    ymax = lambda: js(d, "return TPJOB.charts['chart-loss'].scales.y.max")  # noqa: E731
    assert ymax() >= 1000
    d.find_element(By.ID, "clip").click()
    until(d, 5, lambda d: ymax() < 10, "the spike still sets the loss axis with clipping on")
    clipped = attr(d, "#chart-loss-summary", "textContent")
    assert "1 point is outside the clipped y range" in clipped
    shot(d, "job-clipped", full=True)
    d.find_element(By.ID, "logy").click()
    until(d, 5, lambda d: js(d, "return TPJOB.charts['chart-loss'].scales.y.distr") == 3, "no log scale")
    xr = lambda: js(d, "const x = TPJOB.charts['chart-grad'].scales.x; return [x.min, x.max]")  # noqa: E731
    full = xr()
    d.find_element(By.ID, "chart-loss").send_keys("+")
    until(d, 5, lambda d: xr()[1] - xr()[0] < (full[1] - full[0]) * 0.6, "+ does not zoom (the other charts follow)")
    zoomed_in = xr()
    d.find_element(By.ID, "chart-loss").send_keys(Keys.ARROW_LEFT)
    until(d, 5, lambda d: xr()[0] < zoomed_in[0] and abs((xr()[1] - xr()[0]) - (zoomed_in[1] - zoomed_in[0])) < 1e-6,
          "left arrow does not pan")
    d.find_element(By.ID, "chart-loss").send_keys("0")
    until(d, 5, lambda d: xr() == full, "0 does not zoom out")
    Select(d.find_element(By.ID, "xaxis")).select_by_value("time")
    until(d, 5, lambda d: js(d, "return TPJOB.charts['chart-loss'].scales.x.time") is True, "no wall-clock axis")
    assert abs(js(d, "return TPJOB.charts['chart-loss'].data[0][0]") - (t0 + 1)) < 1
    shot(d, "job-wallclock-log", full=True)
    Select(d.find_element(By.ID, "xaxis")).select_by_value("step")
    d.find_element(By.ID, "logy").click()

    # CSV and PNG export of a chart, saved by the browser
    d.find_element(By.CSS_SELECTOR, "button[aria-label='Loss: save as CSV']").click()
    f = wait_for(lambda: next(iter(tmp_path.glob(f"job-{jid}-loss.csv")), None), 10, "the CSV download")
    rows = list(csv.reader(io.StringIO(f.read_text())))
    assert rows[0] == ["attempt", "step", "time", "loss", "loss_smoothed"] and len(rows) == 81, rows[:3]
    assert rows[40][:2] == ["1", "40"] and float(rows[40][3]) == 1000.0 and rows[40][2].endswith("Z")
    d.find_element(By.CSS_SELECTOR, "button[aria-label='Memory (MiB): save as PNG']").click()
    png = wait_for(lambda: next(iter(tmp_path.glob(f"job-{jid}-mem.png")), None), 10, "the PNG download")
    wait_for(lambda: png.stat().st_size > 1000, 10, "a complete PNG")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not console_errors(d), console_errors(d)


def test_a_new_attempt_is_charted_alone_with_the_earlier_one_faded_behind_it(server_factory, browser, tmp_path):
    """Issue 33 #1-2: attempt 1 logged steps 1-80 at ~2,000 tok/s; it is preempted and attempt 2
    starts again from step 1 at 20,000 tok/s. The charts hold attempt 2's 30 steps alone (not
    attempt 2 for steps 1-30 and attempt 1's slow tail for 31-80), attempt 1 is a faded series one
    click hides, the tiles describe attempt 2, and the API and the CSV say whose points they are."""
    run = FakeRun(server_factory, browser, tmp_path, "two attempts")
    d, jid = run.d, run.jid
    run.post([("state", {"state": "queued", "failure": "preempted", "reason": "preempted by the scheduler"},
               time.time())])
    assert run.agent.post(f"/api/agents/{run.aid}/claim").json()["job_id"] == jid
    t1 = time.time() - 30
    run.post([("metrics", {"step": s, "values": {"loss": 3 - s / 40, "tokens_per_s": 20000.0,
                                                 "padded_tokens_per_s": 21000.0, "step_time_s": 0.02,
                                                 "rss_mb": 315.61 + 0.01 * (s % 4),
                                                 "eta_s": (100 - s) * 0.02}}, t1 + s) for s in range(1, 31)])
    until(d, 20, lambda d: attr(d, "#chart-loss", "data-points") == "30", "the chart holds attempt 2's 30 steps only")
    until(d, 10, lambda d: number(text(d, "#tps")) >= 15, "the tokens/s tile is attempt 2's")  # "20 ktok/s"
    assert "ktok/s" in text(d, "#tps"), text(d, "#tps")
    labels = lambda: js(d, "return TPJOB.charts['chart-loss'].series.map((s) => s.label)")  # noqa: E731
    # (attempt 1's points come from their own request: they may be drawn after attempt 2's live ones)
    until(d, 20, lambda d: "attempt 1: train loss" in labels(), "the earlier attempt drawn faded")
    assert js(d, "return TPJOB.charts['chart-loss'].scales.x.max") >= 80  # attempt 1's steps stay in view
    d.find_element(By.ID, "earlier").click()  # hide the earlier attempt
    until(d, 5, lambda d: "attempt 1: train loss" not in labels(), "the earlier attempt does not hide")
    # 16: attempt 2's memory wobbles by 0.03 MiB around 315.6: the axis does not make it a climb
    span = js(d, "const y = TPJOB.charts['chart-mem'].scales.y; return y.max - y.min")
    assert span >= 0.02 * 315, span
    d.find_element(By.ID, "earlier").click()
    until(d, 5, lambda d: "attempt 1: train loss" in labels(), "the earlier attempt does not come back")
    cookies = {c["name"]: c["value"] for c in d.get_cookies()}
    with httpx.Client(base_url=d.current_url.split("/jobs/")[0], cookies=cookies, timeout=30) as c:
        now, first = (c.get(f"/api/jobs/{jid}/metrics", params={"keys": "loss", **q}).json()
                      for q in ({}, {"attempt": 1}))
    assert now["attempt"] == 2 and now["series"]["loss"]["step"] == list(range(1, 31))
    assert first["attempt"] == 1 and first["series"]["loss"]["step"] == list(range(1, 81))
    d.find_element(By.CSS_SELECTOR, "button[aria-label='Loss: save as CSV']").click()
    f = wait_for(lambda: next(iter(tmp_path.glob(f"job-{jid}-loss.csv")), None), 10, "the CSV download")
    rows = list(csv.reader(io.StringIO(f.read_text())))
    assert rows[0][:4] == ["attempt", "step", "time", "loss"]
    assert [r[0] for r in rows[1:]] == ["1"] * 80 + ["2"] * 30, rows[:3]
    shot(d, "job-two-attempts", full=True)
    assert not console_errors(d), console_errors(d)
    # Compare: "#1 attempt 1" against "#1 attempt 2", picked from the job's own attempts
    d.get(d.current_url.split("/jobs/")[0] + f"/compare?job={jid}.1&job={jid}.2")
    loss_labels = "const u = TPCMP.charts['chart-cmp-loss']; return u ? u.series.map((s) => s.label) : []"
    until(d, 15, lambda d: {f"#{jid} attempt 1 two attempts", f"#{jid} attempt 2 two attempts"}
          <= set(js(d, loss_labels)), "Compare does not draw the two attempts")
    assert len(d.find_elements(By.CSS_SELECTOR, f"#compare-pick input[value='{jid}.1']:checked")) == 1
    assert "preempted" in text(d, "#compare-diff") and "attempt 2" in text(d, "#compare-diff thead")
    # 22: one legend entry per run (attempt 1's faint raw curve is not listed), and a run with no point
    # of a metric is named: attempt 2 never logged lr
    rows = d.find_elements(By.CSS_SELECTOR, "#chart-cmp-loss .u-legend .u-series")
    shown = [e.text for e in rows if e.is_displayed()]
    assert len(shown) == 3, shown  # step, attempt 1, attempt 2
    d.find_element(By.CSS_SELECTOR, "#compare-metrics input[value='lr']").click()
    until(d, 10, lambda d: f"No lr points: #{jid} attempt 2 two attempts." in text(d, "#chart-cmp-lr"),
          "the run without lr named")


def test_one_step_count_a_live_stuck_headline_and_a_fresh_fix_asks_first(server_factory, browser, tmp_path):
    """Issue 33 #5: the Step tile says the training phase's count when it runs ahead of the metrics
    (one count on the page); #7: "Stuck 30 s in fetch_batch" keeps counting while the alert is open;
    #4: an Apply fix that restarts from step 0 asks first, saying how many steps would be run again."""
    run = FakeRun(server_factory, browser, tmp_path, "counts")
    d, now = run.d, time.time()
    run.post([("metrics", {"step": 81, "values": {"loss": 2.9}}, now),
              ("phase", {"name": "training", "done": 83, "total": 100, "unit": "steps"}, now)])
    until(d, 10, lambda d: "83/100" in text(d, "#phase-text"), "the phase's count")
    until(d, 10, lambda d: text(d, "#step") == "83 / 100", "the Step tile says the phase's 83, not the metrics' 81")
    # 14: not hovering, a legend says each series' latest value (not "–", which reads as missing data)
    legend = lambda: [e.text for e in d.find_elements(By.CSS_SELECTOR, "#chart-loss .u-legend .u-value")]  # noqa: E731
    until(d, 10, lambda d: legend()[:2] == ["81", "2.9"] and "–" not in legend(), "the legend's latest values")
    # 12: scrolled, the sticky section links sit below the dark site header, not over it
    gap = js(d, "window.scrollTo(0, 1200); return document.getElementById('jump').getBoundingClientRect().top - "
                "document.querySelector('header.top').getBoundingClientRect().bottom")
    assert gap >= 0, gap
    js(d, "window.scrollTo(0, 0)")
    run.post([("alert", {"kind": "stalled", "severity": "critical",
                         "message": "Stuck 30 s in fetch_batch (train.py:41)\nstalled: no progress for 30 s",
                         "data": {"stuck_since": time.time() - 30}}, time.time())])
    head = ".alert.stalled .alert-headline, .alert .alert-headline"
    until(d, 10, lambda d: text(d, head).startswith("Stuck 3"), "the stall headline")
    until(d, 15, lambda d: re.match(r"Stuck (3[3-9]|[4-9]\d) s in fetch_batch", text(d, head)),
          "the headline keeps counting how long it has been stuck")
    fix = {"kind": "padding", "title": "pack the rows", "changes": {"padding": ["auto", "pack"]},
           "effect": "up to 3x the real tokens/s", "resume": "fresh", "why_fresh": "the batch layout changes"}
    run.post([("alert", {"kind": "slow", "severity": "warning", "message": "slow: 90% padding",
                         "data": {"fixes": [fix], "costs": []}}, time.time())])
    until(d, 10, lambda d: d.find_elements(By.CSS_SELECTOR, "button.apply-fix"), "the Apply fix button")
    btn = d.find_element(By.CSS_SELECTOR, "button.apply-fix")
    d.execute_script("arguments[0].scrollIntoView({block: 'center'})", btn)
    btn.click()
    until(d, 5, lambda d: "Restart from step 0? The 83 steps done" in text(d, ".fix-confirm"),
          "the confirmation saying what is lost")
    assert not btn.is_displayed()
    d.find_element(By.CSS_SELECTOR, ".fix-confirm-no").click()
    until(d, 5, lambda d: btn.is_displayed() and not d.find_element(By.CSS_SELECTOR, ".fix-confirm").is_displayed(),
          "Keep running puts the button back")
    assert btn.text == "Apply fix"  # nothing was asked of the server
    shot(d, "job-confirm-fix-stuck", full=True)
    # confirmed: the fix is asked for; the attempt pauses for it (the stand-in agent says so), and the
    # slow alert it closes says "fix #1 applied" (#20), not "the training process ended (paused)"
    btn.click()
    d.find_element(By.CSS_SELECTOR, ".fix-confirm-yes").click()
    until(d, 10, lambda d: btn.text == "Applying…", "the fix asked for")
    run.post([("alert", {"kind": "slow", "message": "the training process ended (paused)", "clear": True}, time.time()),
              ("state", {"state": "paused", "reason": "paused as asked"}, time.time())])
    cleared = "return [...document.querySelectorAll('#alerts-old-list .alert')].map((e) => e.textContent).join(' ')"
    until(d, 15, lambda d: "Cleared: fix #1 applied (pack the rows)" in js(d, cleared),
          "the slow alert cleared by the fix")
    assert "training process ended" not in js(d, cleared)
    me = js(d, "return Promise.all(['/api/tokens/me', '/api/tokens'].map((u) => fetch(u).then((r) => r.json())))"
               ".then(([me, all]) => all.find((t) => t.id === me.id).name)")
    until(d, 10, lambda d: f"· by {me} ·" in text(d, "#changes"), "who applied the fix, by name (#19)")
    assert "by token" not in text(d, "#changes")
    # the relaunched attempt (fresh, from step 1) at 10x the pace: the before/after panel verifies it,
    # and the tiles beside it describe the new attempt, not the old one's higher-numbered steps (#1-2)
    assert run.agent.post(f"/api/agents/{run.aid}/claim").json()["job_id"] == run.jid
    t2 = time.time()  # after the fix was applied: the comparison's "after" steps
    # packed: each step carries more real tokens in the same step time as before (its median, 0.1 s)
    fast = {"tokens_per_s": 20000.0, "padded_tokens_per_s": 20500.0, "step_time_s": 0.1}
    run.post([("info", {"tokens": 1_200_000, "examples": 4000}, t2)] + [e for s in range(1, 13) for e in (
        ("metrics", {"step": s, "values": {"loss": 4.0 - s / 40, **fast, "eta_s": (100 - s) * 0.1}}, t2 + s / 100),
        ("phase", {"name": "training", "done": s, "total": 100, "unit": "steps"}, t2 + s / 100))])
    until(d, 20, lambda d: "verified" in text(d, "#changes"), "the fix verified")
    # what got faster is said (tokens/s, and each step carrying more, so an epoch takes fewer steps),
    # not "6.7x faster" beside an ETA that stays the same
    verdict = text(d, "#changes .change-verdict")
    assert re.match(r"verified: 6\.7x the real tokens/s \(3,000 -> 20,000\); each step carries 6\.7x the real "
                    r"tokens in about the same time: an epoch takes 6\.7x fewer steps \(6 min 40 s -> 1 min 0 s\), "
                    r"the same number of steps about as long", verdict), verdict
    rows = {r[0]: r[1:] for r in cells(d, "#changes table.before-after tbody tr", "th, td")}
    assert rows["Real tokens per step"] == ["300", "2,000"] and rows["An epoch"] == ["6 min 40 s", "1 min 0 s"], rows
    until(d, 10, lambda d: text(d, "#step") == "12 / 100" and number(text(d, "#tps")) >= 15,
          "the tiles describe the new attempt")
    assert "ktok/s" in text(d, "#tps")
    shot(d, "job-after-fix", full=True)
    assert not console_errors(d), console_errors(d)
    # 10: Compare says what the job was asked with: attempt 1 ran padding auto; the job now runs pack
    d.get(d.current_url.split("/jobs/")[0] + f"/compare?job={run.jid}.1&job={run.jid}")
    until(d, 15, lambda d: "padding" in text(d, "#compare-diff"), "the settings that differ")
    rows = d.find_elements(By.CSS_SELECTOR, "#compare-diff tbody tr.diff")
    row = [r.text for r in rows if r.text.startswith("padding")]
    assert row and "auto" in row[0] and "pack (asked auto; fix #1)" in row[0], row


def test_stall_marks_speed_and_eta_stale(server_factory, browser, tmp_path):
    """Issue 11 #15: during a stall tokens/s and ETA keep their last values, marked stale with the reason."""
    run = FakeRun(server_factory, browser, tmp_path, "stall")
    d = run.d
    # 15: a stall marks tokens/s and ETA stale, with the reason; recovery clears it
    run.post([("alert",
               {"kind": "stalled", "severity": "critical", "message": "stalled: no progress in 'training' for 60 s"},
               time.time())])
    until(d, 10,
          lambda d: (d.find_elements(By.CSS_SELECTOR, "#tps .stale-tag")
                     and d.find_elements(By.CSS_SELECTOR, "#eta .stale-tag")),
          "tokens/s and ETA not marked stale during a stall")
    assert "stalled: no progress" in attr(d, "#eta", "title")
    assert "stale" in attr(d, "#tps", "class")
    js(d, "window.scrollTo(0, 0)")
    shot(d, "job-stale")
    run.post([("alert", {"kind": "stalled", "message": "progressing again", "clear": True}, time.time())])
    until(d, 10, lambda d: not d.find_elements(By.CSS_SELECTOR, "#tps .stale-tag"),
          "still stale after the stall cleared")
    assert not console_errors(d), console_errors(d)


def test_completed_job_final_phase_line(server_factory, browser, tmp_path):
    """Issue 11 #14: a completed job says so (not "saving 1/1 · path"), "Ran for", lr 0 as "0"; the
    last points are drawn."""
    run = FakeRun(server_factory, browser, tmp_path, "final")
    d = run.d
    # 14: the end of the run: no stale "saving 1/1 · path", "Ran for", a learning rate of 0 as "0"
    now = time.time()
    evs = [("metrics", {"step": s, "values": {"loss": 3.0, "lr": 3e-4 * (100 - s) / 100, "tokens_per_s": 2000.0}}, now)
           for s in range(81, 101)]
    evs += [("phase", {"name": "saving", "detail": "final model"}, now),
            ("phase", {"name": "saving", "done": 1, "total": 1, "detail": "/tmp/out/final"}, now),
            ("checkpoint", {"step": 100, "path": "/tmp/out/final", "final": True}, now),
            ("state", {"state": "completed", "reason": "trained 100 steps", "exit_code": 0}, now)]
    run.post(evs)
    until(d, 15, lambda d: text(d, "#job-state") == "completed", "not completed")
    until(d, 5, lambda d: text(d, "#phase-text") == "completed · 100 steps · final model saved", "final phase line")
    assert not d.find_element(By.ID, "phase-progress").is_displayed()
    xs = "const u = TPJOB.charts['chart-loss']; return [u.data[0].length, u.scales.x.max]"
    until(d, 5, lambda d: js(d, xs) == [100, 100],
          "the last points are not drawn (a shorter series set every chart's x range)")
    assert text(d, "#elapsed-label") == "Ran for" and text(d, "#lr") == "0" and text(d, "#eta") == "–"
    assert not d.find_elements(By.CSS_SELECTOR, ".stale-tag")
    shot(d, "job-completed-final", full=True)
    assert not console_errors(d), console_errors(d)


def test_job_page_log_stack_pause_cancel(agent_server, browser):
    """A real run: the Log shows the training process's own output; Dump stacks puts the stack in the
    log and leaves Pause in place; paused and cancelled jobs say so in the phase line."""
    server, d = agent_server, browser
    login(d, server)
    with server.client() as c:
        name = server.plan_fault("log", step_sleep_s=0.2)
        jid = c.post("/api/jobs", json={"name": name, "max_steps": 2000, **FAST}).json()["id"]
    d.get(f"{server.url}/jobs/{jid}")
    until(d, 180, lambda d: text(d, "#job-state") == "running" and text(d, "#phase-text").startswith("training"),
          "not training")
    # 18: the training process's output, not only the agent's one line
    until(d, 60, lambda d: re.search(r"^step \d+/2,000 · loss ", text(d, "#log"), re.M), "no step lines in the log")
    log = text(d, "#log")
    assert "chose precision=fp32 (asked for)" in log and "tokenizing done" in log, log
    assert d.find_elements(By.CSS_SELECTOR, "#log .line.stdout")
    # 13: Dump stacks: the dump arrives in the log; Pause stays; the note goes once the worker took it
    d.find_element(By.ID, "stack").click()
    until(d, 60, lambda d: "Thread" in text(d, "#log") or "py-spy" in text(d, "#log"), "no stack dump in the log")
    until(d, 30, lambda d: not d.find_element(By.ID, "reason").is_displayed(), "'stack requested' note stays")
    assert d.find_element(By.ID, "pause").is_displayed() and d.find_element(By.ID, "stack").is_enabled()
    shot(d, "job-log", full=True)
    # 14: paused and cancelled say so, at the step they stopped
    d.find_element(By.ID, "pause").click()
    until(d, 60, lambda d: text(d, "#job-state") == "paused", "not paused")
    until(d, 10, lambda d: re.fullmatch(r"paused at step [\d,]+/2,000 · checkpoint saved; Resume continues from it",
                                        text(d, "#phase-text")), "paused phase line")
    assert text(d, "#elapsed-label") == "Ran for"
    d.find_element(By.ID, "resume").click()
    until(d, 120, lambda d: text(d, "#job-state") == "running" and text(d, "#phase-text").startswith("training"),
          "not training after resume")
    d.find_element(By.ID, "cancel").click()
    d.find_element(By.ID, "cancel-confirm").click()
    until(d, 60, lambda d: text(d, "#job-state") == "cancelled", "not cancelled")
    until(d, 10, lambda d: re.fullmatch(r"cancelled at step [\d,]+/2,000", text(d, "#phase-text")),
          "cancelled phase line")
    shot(d, "job-cancelled-final")
    assert not console_errors(d), console_errors(d)


def test_a_nan_and_an_inf_loss_are_named_above_the_charts_live_and_after_a_reload(server_factory, browser, tmp_path):
    """Issue 35: a non-finite value is stored and shown, never a silent gap in the line."""
    run = FakeRun(server_factory, browser, tmp_path, "nonfinite")
    d = run.d
    assert not d.find_element(By.ID, "nonfinite-note").is_displayed()
    run.post([("metrics", {"step": 81, "values": {"loss": "nan", "lr": 1e-4}}, run.t0 + 81),
              ("metrics", {"step": 82, "values": {"loss": "inf"}}, run.t0 + 82),
              ("metrics", {"step": 83, "values": {"loss": 2.5}}, run.t0 + 83)])
    said = "loss was NaN at step 81, inf at step 82"
    until(d, 20, lambda d: said in text(d, "#nonfinite-note"), "the live NaN/inf not named")
    assert attr(d, "#chart-loss", "data-points") == "83"  # stored and placed, drawn as a gap
    d.refresh()  # the REST read: the series' nonfinite map
    until(d, 20, lambda d: said in text(d, "#nonfinite-note"), "the stored NaN/inf not named after a reload")
    assert not console_errors(d)
