"""Issue 24 in the browser: a plain user's pages work (jobs list, job pages of everyone), and the job
page shows the controls of a job only to its owner or an admin (the server would refuse them)."""
from __future__ import annotations

from conftest import wait_for
from selenium.webdriver.common.by import By
from test_ui import browser, console_errors, shot, text, until, wait  # noqa: F401 (browser: a fixture)


def log_in_as(d, server, token: str) -> None:
    d.get(server.url + "/login")
    d.find_element(By.ID, "token").send_keys(token)
    d.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
    wait(d, 30).until(lambda d: d.current_url.rstrip("/") == server.url
                      and d.find_elements(By.CSS_SELECTOR, "#conn.on"))


def shown(d, element_id: str) -> bool:
    return d.find_element(By.ID, element_id).is_displayed()


def test_a_plain_user_sees_every_job_but_controls_only_their_own(server, browser):
    d = browser
    with server.client() as admin:
        bob = admin.post("/api/tokens", json={"name": "bob", "role": "user"}).json()
        theirs = admin.post("/api/jobs", json={"name": "admins-job", "max_steps": 3}).json()["id"]
    with server.client(bob["token"]) as b:
        mine = b.post("/api/jobs", json={"name": "bobs-job", "max_steps": 3}).json()["id"]
    log_in_as(d, server, bob["token"])
    wait_for(lambda: "admins-job" in d.page_source and "bobs-job" in d.page_source, 30, "both jobs listed")

    d.get(f"{server.url}/jobs/{mine}")
    until(d, 30, lambda d: text(d, "#job-state") == "queued" and shown(d, "cancel"), "Cancel on bob's own job")
    d.get(f"{server.url}/jobs/{theirs}")
    until(d, 30, lambda d: text(d, "#job-name") == "admins-job" and text(d, "#job-state") == "queued",
          "the admin's job shown")
    until(d, 30, lambda d: d.execute_script("return document.body.dataset.viewer") == "user",
          "the page knows who looks")
    assert not any(shown(d, x) for x in ("cancel", "pause", "resume", "stack")), "another's job shows controls"
    shot(d, "roles-others-job-read-only")
    assert not console_errors(d)
