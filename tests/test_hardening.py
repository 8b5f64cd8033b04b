"""Issue 34 (Hardening 4): each attack of its table, replayed with a plain user token against one
real server for the module (its limits set low so a test reaches them in a few requests, and one
loopback address, 127.0.0.2, allowed for webhooks so a receiver can count what reaches it while
127.0.0.1 stays internal). Each test failed before the fix; bench/hardening.py times the same attacks.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from conftest import make_server, wait_for

ALLOWED = "127.0.0.2"  # a loopback address the module server's admin allowed (webhook_allow)
RULES_PER_USER = 12
NAMES_PER_JOB = 50


class Receiver:
    """A webhook receiver: every POST's path and JSON body."""

    def __init__(self, host: str = ALLOWED):
        got = self.got = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                got.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *a):
                pass
        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.port = self.httpd.server_port
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, path: str = "/") -> str:
        return f"http://{ALLOWED}:{self.port}{path}"

    def close(self) -> None:
        self.httpd.shutdown()


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hardening")
    (tmp / "roots").mkdir()
    s = make_server(tmp, webhook_allow=[ALLOWED], rules_per_user=RULES_PER_USER,
                    metric_names_per_job=NAMES_PER_JOB, path_roots=[str(tmp / "roots")], alert_reopen_s=0).start()
    yield s
    s.kill()


@pytest.fixture(scope="module")
def users(srv):
    """Plain user tokens (no commands scope), made by the admin, by name."""
    made = {}
    with srv.client() as admin:
        for name in ("alice", "bob", "mallory", "carol", "dave"):
            r = admin.post("/api/tokens", json={"name": name, "role": "user"})
            assert r.status_code in (200, 201), r.text
            made[name] = r.json()["token"]
    return made


def external_run(srv, token: str, name: str) -> tuple[int, httpx.Client]:
    """A script's run (the user's own job) and a client posting its events with its report token."""
    with srv.client(token) as c:
        r = c.post("/api/jobs/external", json={"name": name}).json()
    run = httpx.Client(base_url=srv.url, timeout=60, headers={"Authorization": f"Bearer {r['report_token']}"})
    return r["id"], run


def post(run: httpx.Client, job_id: int, events: list[dict], first_seq: int = 0) -> None:
    batch = [{"job_id": job_id, "seq": first_seq + i, "t": time.time(), **e} for i, e in enumerate(events)]
    r = run.post(f"/api/jobs/{job_id}/events", json={"events": batch})
    assert r.status_code == 200, r.text


def metrics(step: int, **values) -> dict:
    return {"kind": "metrics", "data": {"step": step, "values": values}}


def field_of(r: httpx.Response) -> str:
    return r.json()["detail"]["field"]


# ---- 1: a regular expression that backtracks ------------------------------------------------------

def test_1_log_regex_runs_in_linear_time_and_the_server_keeps_answering(srv, users):
    job, run = external_run(srv, users["mallory"], "redos")
    post(run, job, [{"kind": "log", "data": {"line": "a" * 40 + "!"}}, {"kind": "log", "data": {"line": "aaa"}}])
    with srv.client(users["mallory"]) as c:
        t0 = time.perf_counter()
        r = c.get(f"/api/jobs/{job}/logs", params={"grep": "(a+)+$", "regex": "true"}, timeout=20)
        took = time.perf_counter() - t0
        assert r.status_code == 200 and [x["line"] for x in r.json()["lines"]] == ["aaa"], r.text
        assert took < 5, f"{took:.1f} s"  # Python's re: 2^40 steps with the GIL held
        r = c.get(f"/api/jobs/{job}/logs", params={"grep": r"(a)\1", "regex": "true"})
        assert r.status_code == 422 and field_of(r) == "grep" and "backreferences" in r.text
        assert c.get(f"/api/jobs/{job}/logs", params={"grep": "A!"}).json()["matched"] == 1  # substring, any case


# ---- 2 and 6: how many rules and channels ---------------------------------------------------------

def test_2_6_rules_per_user_and_channels_per_rule_are_limits_that_name_themselves(srv, users):
    with srv.client(users["dave"]) as c:
        hooks = [{"url": f"http://{ALLOWED}:9/{i}"} for i in range(11)]
        r = c.post("/api/rules", json={"name": "many", "condition": "state", "state": "failed", "channels": hooks})
        assert r.status_code == 422 and field_of(r) == "channels" and "TOKENPULSE_CHANNELS_PER_RULE" in r.text
        for i in range(RULES_PER_USER):
            r = c.post("/api/rules", json={"name": f"j{i}", "condition": "jump", "metric": "loss", "sigmas": 3})
            assert r.status_code == 201, r.text
        r = c.post("/api/rules", json={"name": "one more", "condition": "jump", "metric": "loss", "sigmas": 3})
        assert r.status_code == 409 and "rules_per_user" in r.text and "TOKENPULSE_RULES_PER_USER" in r.text


# ---- 3 and 10: where a webhook may post ----------------------------------------------------------

INTERNAL = ["http://169.254.169.254/latest/meta-data/", "http://127.0.0.1:8765/", "http://[::1]:22/",
            "http://localhost:5432/", "http://0x7f000001:8765/", "http://2130706433/", "http://127.1/",
            "http://[::ffff:127.0.0.1]/", "http://10.1.2.3/", "http://192.168.0.1/", "http://[fd00::1]/",
            "http://0.0.0.0/", "http://[::]/", "http://metadata.google.internal/", "https://x.localhost/"]
BROKEN = ["http://127.0.0.1:99999/x", "http://[::1/x", "http://example.com:port/"]


@pytest.mark.parametrize("url", INTERNAL + BROKEN)
def test_3_10_internal_or_unparsable_webhooks_are_refused_naming_the_field(srv, users, url):
    with srv.client(users["mallory"]) as c:
        r = c.post("/api/rules", json={"name": "ssrf", "condition": "state", "state": "failed",
                                       "channels": [{"url": "https://hooks.example.com/ok"}, {"url": url}]})
        assert r.status_code == 422 and field_of(r) == "channels.1.url", (url, r.text)


def test_3_a_name_that_resolves_inside_is_refused_when_the_alert_is_sent(srv, users):
    """The name passes at save time (it is no address); at send time it resolves to this machine and
    nothing is posted. An allowed address (the admin's webhook_allow) is posted to."""
    name = socket.gethostname()
    addr = socket.gethostbyname(name)
    import ipaddress
    if ipaddress.ip_address(addr).is_global:
        pytest.skip(f"this machine's name resolves to a public address ({addr})")
    inside = Receiver("0.0.0.0")
    allowed = Receiver()
    try:
        job, run = external_run(srv, users["carol"], "rebind")
        with srv.client(users["carol"]) as c:
            r = c.post("/api/rules", json={"name": "loss high", "condition": "above", "metric": "loss", "threshold": 5,
                                           "scope": "job", "job_id": job, "channels": [
                                               {"url": f"http://{name}:{inside.port}/hook"},
                                               {"url": allowed.url("/hook"), "format": "json"}]})
            assert r.status_code == 201, r.text
        post(run, job, [metrics(1, loss=10.0)])
        wait_for(lambda: allowed.got, 30, "the allowed receiver's post")
        assert allowed.got[0][1]["job_id"] == job
        time.sleep(1.0)  # both sends are queued together: the refused one is not merely late
        assert inside.got == []
        assert "refused by this server" in srv.log_path.read_text()
    finally:
        inside.close()
        allowed.close()


# ---- 4: one failure, many posts --------------------------------------------------------------------

def test_4_one_failure_posts_to_one_receiver_at_most_a_few_times(srv, users):
    rx = Receiver()
    try:
        job, run = external_run(srv, users["alice"], "amplify")
        with srv.client(users["alice"]) as c:
            for i in range(5):
                hooks = [{"url": rx.url(f"/r{i}/c{k}")} for k in range(10)]
                r = c.post("/api/rules", json={"name": f"fail {i}", "condition": "state", "state": "failed",
                                               "scope": "job", "job_id": job, "channels": hooks})
                assert r.status_code == 201, r.text
        post(run, job, [{"kind": "state", "data": {"state": "failed", "reason": "boom"}}])
        # the cap's log line is written once the rest are dropped: every send is decided by then
        wait_for(lambda: "webhook_sends_per_event" in srv.log_path.read_text() and len(rx.got) >= 3, 30,
                 "three posts and the cap's word in the log", show=lambda: len(rx.got))
        assert len(rx.got) == 3, len(rx.got)  # webhook_sends_per_event (50 before)
    finally:
        rx.close()


# ---- 5: a run speaking for someone else's rule ---------------------------------------------------

def test_5_a_run_cannot_post_an_alert_of_a_rules_kind(srv, users):
    rx = Receiver()
    try:
        with srv.client(users["bob"]) as c:
            rule = c.post("/api/rules", json={"name": "victim", "condition": "above", "metric": "loss",
                                              "threshold": 1e9, "channels": [{"url": rx.url("/victim")}]}).json()
        job, run = external_run(srv, users["mallory"], "forger")
        post(run, job, [{"kind": "alert", "data": {"kind": f"rule:{rule['id']}", "severity": "critical",
                                                   "message": "click http://evil.example"}},
                        metrics(1, loss=1.0)])
        with srv.client(users["mallory"]) as c:
            wait_for(lambda: c.get(f"/api/jobs/{job}").json()["step"] == 1, 30, "the batch stored")
            assert c.get("/api/alerts", params={"kind": f"rule:{rule['id']}"}).json() == []
            kinds = [e["data"].get("kind") for e in c.get(f"/api/jobs/{job}/events").json()["events"]]
            assert f"rule:{rule['id']}" not in kinds
        time.sleep(0.5)
        assert rx.got == []
    finally:
        rx.close()


# ---- 7: a hundred thousand metric names ------------------------------------------------------------

def test_7_metric_names_per_job_are_limited_with_one_warning_and_reads_stay_the_jobs_own(srv, users):
    job, run = external_run(srv, users["mallory"], "names")
    post(run, job, [metrics(1, **{f"m{i}": float(i) for i in range(NAMES_PER_JOB + 10)})])
    post(run, job, [metrics(2, **{f"n{i}": 1.0 for i in range(20)}, m0=5.0)], first_seq=1)
    other, other_run = external_run(srv, users["alice"], "plain")
    post(other_run, other, [metrics(1, loss=2.0, acc=0.5)])
    with srv.client(users["alice"]) as c:
        series = c.get(f"/api/jobs/{job}/metrics").json()["series"]
        assert len(series) == NAMES_PER_JOB and series["m0"]["value"] == [0.0, 5.0]
        warned = c.get("/api/alerts", params={"job_id": job, "kind": "metric_names_limit"}).json()
        assert len(warned) == 1 and "TOKENPULSE_METRIC_NAMES_PER_JOB" in warned[0]["message"], warned
        assert len(c.get(f"/api/jobs/{job}").json()["last"]) == NAMES_PER_JOB + 1  # and its step
        assert set(c.get(f"/api/jobs/{other}/metrics").json()["series"]) == {"loss", "acc"}
        # a list's rows carry the listed metrics and the columns asked for, not every name
        page = c.get("/api/jobs", params={"q": "names", "columns": ["last:m7"], "names": "true"}).json()
        assert page["jobs"][0]["last"] == {"step": 2, "m7": 7.0}, page["jobs"][0]["last"]
        assert "m49" in page["metric_names"] and len(page["metric_names"]) == NAMES_PER_JOB
    with srv.ws("jobs", users["alice"]) as ws:  # and so does each live frame
        post(other_run, other, [metrics(2, loss=1.0, acc=0.7)], first_seq=1)
        deadline = time.time() + 30
        while time.time() < deadline:
            f = json.loads(ws.recv(timeout=30))
            if f.get("type") == "job" and f["job"]["id"] == other and f["job"]["step"] == 2:
                assert f["job"]["last"] == {"step": 2, "loss": 1.0}, f  # acc: not a listed metric
                break
        else:
            raise AssertionError("no job frame")


# ---- 8: a fix outside the path roots ---------------------------------------------------------------

def test_8_a_fix_passes_the_checks_a_submit_passes(srv, users):
    agent = httpx.Client(base_url=srv.url, timeout=30, headers={"Authorization": f"Bearer {srv.agent_token}"})
    aid = agent.post("/api/agents", json={"name": "fixer", "host": "h"}).json()["id"]
    with srv.client(users["alice"]) as c:
        job = c.post("/api/jobs", json={"name": "fix-me", "max_steps": 5}).json()["id"]
        assert agent.post(f"/api/agents/{aid}/claim").json()["job_id"] == job
        for field, value in (("dataset", "/etc"), ("eval_dataset", "/etc"), ("model", "/etc")):
            fix = {"kind": "data", "title": "move", "changes": {field: [None, value]}}
            batch = [{"kind": "alert", "job_id": job, "seq": 0, "t": time.time(),
                      "data": {"kind": f"verdict-{field}", "severity": "warning", "message": "m",
                               "data": {"fixes": [fix]}}}]
            seq = {"dataset": 0, "eval_dataset": 1, "model": 2}[field]
            batch[0]["seq"] = seq
            agent.post(f"/api/agents/{aid}/events", json={"events": batch}).raise_for_status()
            r = c.post(f"/api/jobs/{job}/fix", json={"kind": f"verdict-{field}"})
            assert r.status_code == 422 and field_of(r) == field and "outside the allowed roots" in r.text, r.text
        assert c.get(f"/api/jobs/{job}/changes").json() == []
    agent.close()


# ---- 9: other people's jobs and alerts -------------------------------------------------------------

def test_9_a_users_rule_acts_on_that_users_jobs_and_only_owners_acknowledge(srv, users):
    with srv.client(users["carol"]) as carol, srv.client(users["bob"]) as bob:
        rule = carol.post("/api/rules", json={"name": "all mine", "condition": "above", "metric": "acc",
                                              "threshold": 5, "severity": "critical"}).json()
        theirs, their_run = external_run(srv, users["bob"], "bobs")
        mine, my_run = external_run(srv, users["carol"], "carols")
        r = carol.post("/api/rules", json={"name": "x", "condition": "above", "metric": "acc", "threshold": 1,
                                           "scope": "job", "job_id": theirs})
        assert r.status_code == 403
        post(their_run, theirs, [metrics(1, acc=10.0)])
        post(my_run, mine, [metrics(1, acc=10.0)])  # judged after bob's: its alert means bob's was judged

        def fired():
            return carol.get("/api/alerts", params={"kind": f"rule:{rule['id']}"}).json()
        wait_for(fired, 30, "carol's rule on carol's job")
        assert [a["job_id"] for a in fired()] == [mine]
        alert = fired()[0]["id"]
        r = bob.post(f"/api/alerts/{alert}/ack")
        assert r.status_code == 403 and "owner" in r.text
        assert carol.post(f"/api/alerts/{alert}/ack").json()["state"] == "acked"


# ---- 11: control characters in a column key ---------------------------------------------------------

@pytest.mark.parametrize("params, field", [({"sort": "spec:a\x00b"}, "sort"), ({"filter": "last:lo\x00ss<1"}, "filter"),
                                           ({"filter": "spec:model~a\x00"}, "filter"), ({"q": "x\x00"}, "q")])
def test_11_a_nul_in_a_sort_or_filter_key_is_a_422_naming_it(srv, users, params, field):
    with srv.client(users["mallory"]) as c:
        r = c.get("/api/jobs", params=params)
        assert r.status_code == 422 and field_of(r) == field, r.text
