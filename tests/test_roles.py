"""Issue 24: roles that hold. Each attack of the adversarial pass is performed for real against a real
server (real uvicorn, real SQLite or PostgreSQL through the migrations): a plain user token
administering the tokens, a user becoming a command-taking agent, an untrusted agent joining a
multi-node job as its node rank 0, a plain user re-running another's command job, a user posting
events into another user's external job. Each must fail with a clear 401/403/409/422, and nothing
may have run, leaked or changed. The positive paths run too: an admin mints agent and commands
tokens, a user with `commands` runs, pauses and resumes their own command job (a real agent), a gang
of trusted agents trains (two real agents, torchrun)."""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
from conftest import ROOT, wait_for

from tests import pg

PY = sys.executable


def refused(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    for w in words:
        assert w in r.text, (w, r.text)


def mint(c: httpx.Client, name: str, role: str = "user", **rights) -> dict:
    r = c.post("/api/tokens", json={"name": name, "role": role, **rights})
    assert r.status_code == 201, r.text
    return r.json()


def fake_agent(srv, token: str, accepts_commands: bool = False) -> tuple[httpx.Client, httpx.Response]:
    """An agent speaking the real HTTP protocol, nothing else: register and claim by hand."""
    a = srv.client(token)
    return a, a.post("/api/agents", json={"name": "fake", "host": "attacker", "accepts_commands": accepts_commands})


def token_ids(srv) -> dict[str, int]:
    with srv.client() as c:
        return {t["name"]: t["id"] for t in c.get("/api/tokens").json()}


def test_a_plain_user_cannot_administer_tokens_and_a_metrics_token_only_reads_metrics(server):
    admin = server.client()
    ids = token_ids(server)
    bob = mint(admin, "bob")
    b = server.client(bob["token"])
    # 1. listing: bob sees himself only, never the admin's or the agents' tokens
    assert [t["id"] for t in b.get("/api/tokens").json()] == [bob["id"]]
    # minting: no agent, admin or metrics token, no right he lacks; nothing is created
    refused(b.post("/api/tokens", json={"name": "evil-agent", "role": "agent"}), 403, "only an admin", "agent")
    refused(b.post("/api/tokens", json={"name": "evil-admin", "role": "admin"}), 403, "only an admin")
    refused(b.post("/api/tokens", json={"name": "evil-metrics", "role": "metrics"}), 403, "only an admin")
    refused(b.post("/api/tokens", json={"name": "evil-cmd", "role": "user", "allow_commands": True}), 403, "commands")
    refused(b.post("/api/tokens", json={"name": "x", "role": "agent", "gang": True}), 403, "only an admin")
    # revoking: neither the operator's token nor the agents'
    for victim in (ids["initial admin"], ids["initial agent"]):
        refused(b.post(f"/api/tokens/{victim}/revoke"), 403, "not yours")
    refused(b.post("/api/tokens/999999/revoke"), 404, "does not exist")
    assert admin.get("/api/jobs").status_code == 200  # the operator still works
    agent, reg = fake_agent(server, server.agent_token)
    assert reg.status_code == 201, reg.text  # so do the agents
    listed = admin.get("/api/tokens").json()
    assert [t["name"] for t in listed] == ["initial admin", "initial agent", "bob"], listed
    assert all(t["revoked_at"] is None for t in listed)

    # what a user may do: a user token for itself (no more rights), listed and revoked by it; its
    # jobs are the user's; revoking the user ends the tokens it made
    ci = mint(b, "bob-ci")
    assert ci["role"] == "user" and ci["scopes"] == [] and ci["created_by"] == bob["id"]
    spare = mint(b, "bob-spare")
    assert {t["name"] for t in b.get("/api/tokens").json()} == {"bob", "bob-ci", "bob-spare"}
    with server.client(ci["token"]) as cic:
        job = cic.post("/api/jobs", json={"name": "bob's", "max_steps": 3}).json()
        assert job["owner"] == bob["id"], job
        assert cic.get("/api/tokens/me").json()["principal"] == bob["id"]
    refused(server.client(spare["token"]).post(f"/api/tokens/{ids['initial agent']}/revoke"), 403, "not yours")
    assert b.post(f"/api/tokens/{ci['id']}/revoke").json()["revoked_at"]
    refused(server.client(ci["token"]).get("/api/jobs"), 401, "invalid token")
    # an admin controls anyone's job and revokes anyone
    assert admin.post(f"/api/jobs/{job['id']}/cancel").json()["state"] == "cancelled"
    admin.post(f"/api/tokens/{bob['id']}/revoke").raise_for_status()
    refused(server.client(bob["token"]).get("/api/jobs"), 401)
    refused(server.client(spare["token"]).get("/api/jobs"), 401)  # bob's tokens went with him

    # metrics: a read-only token for Prometheus; it can do nothing else, and /metrics wants it (or admin)
    m = mint(admin, "prometheus", "metrics")
    with server.client(m["token"]) as mc:
        assert mc.get("/metrics").status_code == 200 and "tokenpulse_jobs" in mc.get("/metrics").text
        refused(mc.get("/api/jobs"), 403, "metrics token")
        refused(mc.post("/api/jobs", json={}), 403, "metrics token")
        refused(mc.post("/api/tokens", json={"name": "x", "role": "user"}), 403, "metrics token")
        refused(mc.post("/api/agents", json={"name": "a", "host": "h"}), 403, "agents")
    alice = mint(admin, "alice", allow_commands=True)
    refused(server.client(alice["token"]).get("/metrics"), 403, "metrics token")
    assert admin.get("/metrics").status_code == 200

    # the admin's own mistakes: a right a role cannot hold (422 naming it), the last admin token
    r = admin.post("/api/tokens", json={"name": "x", "role": "user", "gang": True})
    assert r.status_code == 422 and r.json()["detail"]["field"] == "gang", r.text
    r = admin.post("/api/tokens", json={"name": "x", "role": "metrics", "allow_commands": True})
    assert r.status_code == 422 and r.json()["detail"]["field"] == "allow_commands", r.text
    refused(admin.post(f"/api/tokens/{ids['initial admin']}/revoke"), 409, "last admin")
    assert admin.get("/api/jobs").status_code == 200

    # the CLI: an admin mints an agent token for commands and gangs
    env = {**server.env, "TOKENPULSE_URL": server.url, "TOKENPULSE_TOKEN": server.token}
    out = subprocess.run([PY, "-m", "tokenpulse.cli", "tokens", "create", "gpu-7", "--role", "agent",
                          "--allow-commands", "--gang"], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "takes command jobs, joins multi-node jobs" in out.stdout, out.stdout + out.stderr


def test_a_user_cannot_become_an_agent_that_takes_command_jobs(server, tmp_path):
    admin = server.client()
    alice = mint(admin, "alice", allow_commands=True)
    marker = tmp_path / "ran"
    with server.client(alice["token"]) as a:
        job = a.post("/api/jobs/command", json={"command": [PY, "-c", f"open({str(marker)!r}, 'w')"],
                                                "env": {"MY_SETTING": "alice-only"}}).json()
    # 2. an agent token minted without commands cannot register as a command agent (nor take the job)
    plain = mint(admin, "training-box", "agent")
    fake, reg = fake_agent(server, plain["token"], accepts_commands=True)
    refused(reg, 403, "accepts_commands", "--allow-commands", "--role agent --allow-commands")
    fake, reg = fake_agent(server, plain["token"])
    assert reg.status_code == 201 and reg.json()["accepts_commands"] is False
    assert fake.post(f"/api/agents/{reg.json()['id']}/claim").status_code == 204  # nothing for it
    detail = admin.get(f"/api/jobs/{job['id']}").json()
    assert detail["state"] == "queued" and detail["attempts"] == [] and detail["agent_id"] is None
    # a real agent started with --allow-commands on such a token stops at once, saying why
    out = subprocess.run([PY, "-m", "tokenpulse.cli", "agent", "--server", server.url, "--token", plain["token"],
                          "--work-dir", str(tmp_path / "w"), "--name", "real", "--allow-commands"],
                         env=server.env, capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert out.returncode != 0 and "accepts_commands refused" in out.stdout + out.stderr, out.stdout + out.stderr
    assert not marker.exists() and admin.get(f"/api/jobs/{job['id']}").json()["state"] == "queued"

    # the positive path: an admin mints a commands agent token; its agent takes the command job
    trusted = mint(admin, "cmd-box", "agent", allow_commands=True)
    assert trusted["scopes"] == ["commands"]
    agent, reg = fake_agent(server, trusted["token"], accepts_commands=True)
    assert reg.status_code == 201 and reg.json()["accepts_commands"] is True
    claim = agent.post(f"/api/agents/{reg.json()['id']}/claim").json()
    assert claim["job_id"] == job["id"] and claim["spec"]["env"] == {"MY_SETTING": "alice-only"}


PAUSABLE = """
    import signal, sys, time
    from tokenpulse.events import Emitter

    with open(sys.argv[1], "a") as f:
        f.write("started\\n")  # one line per start of the command
    e = Emitter()
    e.info(pausable=True)
    asked = []
    signal.signal(signal.SIGUSR2, lambda *_: asked.append(1))
    step = 0
    while not asked:
        step += 1
        e.metrics(step, loss=1.0 / step)
        time.sleep(0.1)
    e.emit("state", state="paused", reason="paused at step %d" % step)
    e.close()
"""


def test_jobs_belong_to_their_submitter_and_rerunning_a_command_needs_the_scope(server_factory, tmp_path):
    roots = tmp_path / "roots"
    (roots / "proj").mkdir(parents=True)
    (roots / "proj" / "pausable.py").write_text(textwrap.dedent(PAUSABLE))
    runs = roots / "proj" / "runs.txt"
    srv = server_factory(path_roots=[str(roots)])
    srv.start_agent("cmd", "--allow-commands")  # the first start's agent token: commands + gang
    admin = srv.client()
    alice = mint(admin, "alice", allow_commands=True)
    bob = mint(admin, "bob")
    a, b = srv.client(alice["token"]), srv.client(bob["token"])
    alice_view = mint(a, "alice-viewer")  # alice's own token, without the commands right
    av = srv.client(alice_view["token"])
    r = a.post("/api/jobs/command", json={"command": [PY, "pausable.py", str(runs)], "cwd": str(roots / "proj"),
                                          "instrument": False, "env": {"PYTHONPATH": str(ROOT)}})
    assert r.status_code == 201, r.text
    jid = r.json()["id"]
    assert r.json()["owner"] == alice["id"]
    wait_for(lambda: (a.get(f"/api/jobs/{jid}").json()["info"] or {}).get("pausable"), 120, "the job says it can pause",
             show=lambda: a.get(f"/api/jobs/{jid}").json())

    # 3. bob reads alice's job (a team dashboard) but cannot change its course
    assert b.get(f"/api/jobs/{jid}").status_code == 200 and b.get(f"/api/jobs/{jid}/events").status_code == 200
    for action in ("cancel", "pause", "stack"):
        refused(b.post(f"/api/jobs/{jid}/{action}"), 403, f"{action} refused", f"token {alice['id']}'s")
    refused(b.post(f"/api/jobs/{jid}/clone", json={"changes": {}}), 403, "clone refused")
    job = a.get(f"/api/jobs/{jid}").json()
    assert job["state"] == "running" and job["requested_action"] is None and not job["stack_requested"], job

    # alice pauses her own job: it checkpoints out and is paused, having run once
    assert a.post(f"/api/jobs/{jid}/pause").status_code == 200
    assert srv.wait_job(jid, timeout=120)["state"] == "paused"
    assert runs.read_text().count("started") == 1

    # 4. resuming (or cloning) a command job starts the command again: not without the commands right,
    # not on someone else's job; nothing ran again
    refused(b.post(f"/api/jobs/{jid}/resume"), 403, "resume refused")
    refused(av.post(f"/api/jobs/{jid}/resume"), 403, "commands", "resume a command job")
    refused(av.post(f"/api/jobs/{jid}/clone", json={"changes": {}}), 403, "commands", "clone a command job")
    assert av.post(f"/api/jobs/{jid}/stack").status_code == 409  # hers to ask, but a paused job has no process
    time.sleep(0.5)
    job = a.get(f"/api/jobs/{jid}").json()
    assert job["state"] == "paused" and len(job["attempts"]) == 1, job
    assert admin.get("/api/jobs").json()["total"] == 1  # no clone was made
    assert runs.read_text().count("started") == 1

    # alice resumes with her commands token: it runs again; then she cancels it
    assert a.post(f"/api/jobs/{jid}/resume").status_code == 200
    wait_for(lambda: runs.read_text().count("started") == 2, 120, "the command started again")
    assert a.post(f"/api/jobs/{jid}/cancel").status_code == 200
    assert srv.wait_job(jid, timeout=120)["state"] == "cancelled"


@pytest.mark.shared_server
def test_only_an_external_jobs_own_credential_posts_its_events(server):
    admin = server.client()
    alice, bob = mint(admin, "alice"), mint(admin, "bob")
    a, b = server.client(alice["token"]), server.client(bob["token"])
    made = b.post("/api/jobs/external", json={"name": "bob's run"}).json()
    jid, cred = made["id"], made["report_token"]
    other = a.post("/api/jobs/external", json={"name": "alice's run"}).json()
    assert made["job"]["owner"] == bob["id"] and cred.startswith("tpr_")

    # 9. alice sets bob's job to "completed, alice says so" and raises a critical alert on it
    t = time.time()
    forged = {"events": [
        {"kind": "alert", "job_id": jid, "seq": 0, "t": t,
         "data": {"kind": "pwned", "severity": "critical", "message": "alice was here"}},
        {"kind": "state", "job_id": jid, "seq": 1, "t": t, "data": {"state": "completed", "reason": "alice says so"}}]}
    for who, status in ((a, 403), (b, 403), (server.client(other["report_token"]), 401),
                        (httpx.Client(base_url=server.url), 401)):
        refused(who.post(f"/api/jobs/{jid}/events", json=forged), status)
    refused(a.post(f"/api/jobs/{jid}/events", json=forged), 403, "its own report token")
    job = admin.get(f"/api/jobs/{jid}").json()
    assert job["state"] == "starting" and job["reason"] is None, job
    assert admin.get(f"/api/jobs/{jid}/events").json()["events"] == []
    assert admin.get("/api/alerts", params={"job_id": jid}).json() == []
    # the credential does nothing else: it is no token of the API
    refused(server.client(cred).get("/api/jobs"), 401)
    refused(server.client(cred).post(f"/api/jobs/{other['id']}/events", json={"events": []}), 401)

    # its own credential reports; so may an admin
    ok = {"events": [{"kind": "metrics", "job_id": jid, "seq": 0, "t": t,
                      "data": {"step": 1, "values": {"loss": 2.0}}}]}
    assert server.client(cred).post(f"/api/jobs/{jid}/events", json=ok).json()["acked"] == {str(jid): 0}
    ok["events"][0]["seq"] = 1
    assert admin.post(f"/api/jobs/{jid}/events", json=ok).json()["acked"] == {str(jid): 1}
    # the owner cancels it; alice may not
    refused(a.post(f"/api/jobs/{jid}/cancel"), 403, "cancel refused")
    assert b.post(f"/api/jobs/{jid}/cancel").status_code == 200


GANG = {"max_steps": 2, "batch_size": 2, "max_seq_length": 64, "precision": "fp32", "torch_compile": "off",
        "seed": 3, "nproc_per_node": 1, "nnodes": 2, "stall": {"first_step_s": 120}}


def test_only_agents_trusted_for_gangs_join_a_multi_node_job(server_factory):
    srv = server_factory(gang_timeout_s=120)
    admin = srv.client()
    bob = mint(admin, "bob")
    # 3 (gang). an agent without the gang right offers to be node rank 0 (hosting the rendezvous):
    # it is not let in, even with the commands right, and the job waits for trusted agents
    untrusted = mint(admin, "box", "agent", allow_commands=True)
    fake, reg = fake_agent(srv, untrusted["token"])
    fid = reg.json()["id"]
    jid = srv.client(bob["token"]).post("/api/jobs", json={**GANG, "name": "gang"}).json()["id"]
    for _ in range(3):
        assert fake.post(f"/api/agents/{fid}/claim", json={"endpoint": "127.0.0.1:29999"}).status_code == 204
    assert srv.query("SELECT count(*) FROM gang_members")[0][0] == 0
    job = admin.get(f"/api/jobs/{jid}").json()
    assert job["state"] == "queued" and "agents trusted for multi-node jobs (0 online)" in job["reason"], job

    # two trusted agents (the first start's token has the gang right) form the gang and train
    for name in ("g1", "g2"):
        srv.start_agent(name, "--address", "127.0.0.1", env={"OMP_NUM_THREADS": "1"})  # 2 ranks, 2 shared cores
    job = srv.wait_job(jid, timeout=300)
    assert job["state"] == "completed", (job["reason"], job["attempts"])
    names = {x["id"]: x["name"] for x in admin.get("/api/agents").json()}
    members = {names[r[0]] for r in srv.query("SELECT agent_id FROM gang_members WHERE job_id = ?", (jid,))}
    assert members == {"g1", "g2"}, members


@pytest.mark.skipif(pg.enabled(), reason="builds an old SQLite file by hand")
def test_an_upgrade_keeps_tokens_working_and_says_who_is_admin(server_factory, tmp_path):
    """An installation from before roles: the first live user token becomes the admin (said in the
    server's output), the others stay users, agent tokens keep command and gang rights, old jobs are
    the admin's."""
    from alembic import command

    from server.auth import hash_token
    from server.db import alembic_config
    data = tmp_path / "s0" / "data"  # where server_factory's first server keeps its database
    data.mkdir(parents=True)
    db_file = data / "tokenpulse.db"
    command.upgrade(alembic_config(f"sqlite:///{db_file}"), "0008")
    with sqlite3.connect(db_file) as db:
        db.executemany("INSERT INTO tokens (name, role, hash, created_at, revoked_at, scopes) VALUES (?, ?, ?, 0, ?, "
                       "?)",
                       [("gone", "user", hash_token("tpu_gone"), 1.0, "commands"),
                        ("ops", "user", hash_token("tpu_ops"), None, "commands"),
                        ("box", "agent", hash_token("tpa_box"), None, ""),
                        ("carol", "user", hash_token("tpu_carol"), None, "")])
        db.execute("INSERT INTO jobs (name, state, spec, priority, created_at, attempt, next_seq) "
                   "VALUES ('old', 'queued', '{}', 0, 0, 0, 0)")
    (data / "token").write_text("tpu_ops\n")
    os.chmod(data / "token", 0o600)
    srv = server_factory()
    log = srv.log_path.read_text()
    assert "token 2 ('ops'), the first user token, is now the admin token" in log, log[-2000:]
    assert "agent tokens 3 keep taking command and multi-node jobs" in log
    with srv.client("tpu_ops") as ops:
        assert {t["name"]: t["role"] for t in ops.get("/api/tokens").json()} == {
            "gone": "user", "ops": "admin", "box": "agent", "carol": "user", "initial agent": "agent"}
        old = ops.get("/api/jobs").json()["jobs"][0]
        assert old["owner"] is None
    with srv.client("tpu_carol") as carol:
        assert carol.get("/api/jobs").status_code == 200  # still works, as a user
        refused(carol.post(f"/api/jobs/{old['id']}/cancel"), 403, "the admin's")
    with srv.client("tpa_box") as box:
        assert box.post("/api/agents", json={"name": "b", "host": "h", "accepts_commands": True}).status_code == 201
    with srv.client("tpu_ops") as ops:
        assert ops.post(f"/api/jobs/{old['id']}/cancel").json()["state"] == "cancelled"
