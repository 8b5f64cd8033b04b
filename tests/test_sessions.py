"""Browser sessions: the login cookie holds a revocable, expiring session secret (never the API
token); failed logins are throttled; a cookie-authenticated websocket must come from our exact
origin, scheme included."""
from __future__ import annotations

import httpx
import pytest
from conftest import wait_for
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect


def log_in(srv, token=None) -> httpx.Response:
    return httpx.post(f"{srv.url}/login", data={"token": token or srv.token, "next": "/"})


def as_browser(srv, secret: str) -> httpx.Client:
    return httpx.Client(base_url=srv.url, cookies={"tokenpulse_session": secret})


def test_cookie_is_a_session_that_logout_revokes(server):
    r = log_in(server)
    secret = r.cookies["tokenpulse_session"]
    assert server.token not in r.headers["set-cookie"] and secret.startswith("tps_")
    raw = b"".join(p.read_bytes() for p in server.data_dir.glob("tokenpulse.db*"))
    assert secret.encode() not in raw  # stored hashed
    b = as_browser(server, secret)
    assert b.get("/api/jobs").status_code == 200
    assert b.get("/").status_code == 200
    out = b.get("/logout", follow_redirects=False)
    assert out.status_code == 303
    stolen = as_browser(server, secret)  # a copy of the cookie taken before logout
    assert stolen.get("/api/jobs").status_code == 401
    assert stolen.get("/", follow_redirects=False).status_code == 303  # back to the login page
    assert server.client().get("/api/jobs").status_code == 200  # the token itself still works


def test_session_expires(server_factory):
    srv = server_factory(session_ttl_s=3)
    b = as_browser(srv, log_in(srv).cookies["tokenpulse_session"])
    assert b.get("/api/jobs").status_code == 200
    wait_for(lambda: b.get("/api/jobs").status_code == 401, 60, "the session to expire")


def test_revoking_the_token_ends_its_sessions(server):
    with server.client() as c:
        bob = c.post("/api/tokens", json={"name": "bob", "role": "user"}).json()
        b = as_browser(server, log_in(server, bob["token"]).cookies["tokenpulse_session"])
        assert b.get("/api/jobs").status_code == 200
        c.post(f"/api/tokens/{bob['id']}/revoke").raise_for_status()
    wait_for(lambda: b.get("/api/jobs").status_code == 401, 30, "the revoked token's session to end")


def test_failed_logins_are_throttled(server):
    for _ in range(5):
        assert log_in(server, "tpu_wrong").status_code == 401
    r = log_in(server, "tpu_wrong")
    assert r.status_code == 429 and int(r.headers["retry-after"]) > 0
    assert "Too many failed logins" in r.text
    assert log_in(server).status_code == 429  # throttled per address, whatever is tried
    assert server.client().get("/api/jobs").status_code == 200  # API tokens are not affected


@pytest.mark.parametrize("origin, ok", [("http://127.0.0.1:{port}", True), ("https://127.0.0.1:{port}", False),
                                        ("null", False), ("http://127.0.0.1:{port}.evil.example", False)])
def test_websocket_origin_must_match_scheme_and_host(server, origin, ok):
    cookie = {"Cookie": f"tokenpulse_session={log_in(server).cookies['tokenpulse_session']}"}
    url = f"ws://127.0.0.1:{server.port}/ws?topics=jobs"
    if ok:
        with connect(url, additional_headers=cookie, origin=origin.format(port=server.port)) as ws:
            ws.send('{"subscribe": ["alerts"]}')
            assert '"subscribed"' in ws.recv(timeout=10)
    else:
        with pytest.raises(InvalidStatus):
            connect(url, additional_headers=cookie, origin=origin.format(port=server.port)).recv(timeout=5)
