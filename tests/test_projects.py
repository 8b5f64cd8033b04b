"""Projects, tags and notes: set at submit (REST, CLI), edited later (owner only), listed and filtered."""
from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from tests.conftest import ROOT

PY = sys.executable
QUEUED = {"max_steps": 1, "device": "cpu"}  # never claimed here (no agent): queued is all these tests need


def cli(server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "tokenpulse.cli", "--url", server.url, *args], capture_output=True, text=True,
                          cwd=ROOT, env={**server.env, "TOKENPULSE_TOKEN": server.token, "COLUMNS": "250"}, timeout=120)


@pytest.mark.shared_server
def test_projects_tags_and_notes_through_rest_and_the_cli(server, tmp_path):
    project = f"p-{uuid.uuid4().hex[:8]}"  # the shared server holds other tests' jobs
    with server.client() as c:
        a = c.post("/api/jobs", json={**QUEUED, "project": project, "tags": ["baseline", "lr"]}).json()
        assert (a["project"], a["tags"]) == (project, ["baseline", "lr"])
        b = c.post("/api/jobs", json=QUEUED).json()
        assert b["project"] == "default" and b["tags"] == []

        spec = tmp_path / "job.yaml"
        spec.write_text("max_steps: 1\ndevice: cpu\ntags: [from-file]\n")
        out = cli(server, "submit", str(spec), "--project", project, "--tag", "cli")
        assert out.returncode == 0, out.stderr
        cli_id = int(out.stdout.split("job ")[1].split()[0])
        assert c.get(f"/api/jobs/{cli_id}").json()["tags"] == ["from-file", "cli"]

        edited = c.patch(f"/api/jobs/{b['id']}", json={"project": project, "add_tags": ["lr", "rerun"],
                                                        "note": "# why\nthe **lr** was too high"}).json()
        assert (edited["project"], edited["tags"], edited["note"]) == (project, ["lr", "rerun"],
                                                                       "# why\nthe **lr** was too high")
        out = cli(server, "edit", str(b["id"]), "--untag", "rerun", "--tag", "keep")
        assert out.returncode == 0, out.stderr
        assert c.get(f"/api/jobs/{b['id']}").json()["tags"] == ["lr", "keep"]

        def ids(**params):
            return sorted(j["id"] for j in c.get("/api/jobs", params=params).json()["jobs"])
        assert ids(project=project) == sorted([a["id"], b["id"], cli_id])
        assert ids(project=project, tag="lr") == sorted([a["id"], b["id"]])
        assert ids(project=project, tag=["lr", "baseline"]) == [a["id"]]
        assert ids(project=project, tag="l") == []  # a tag matches whole, never a piece of another
        listed = {p["project"]: p for p in c.get("/api/projects").json()}
        assert listed[project]["jobs"] == 3 and "default" in listed
        out = cli(server, "jobs", "--project", project, "--tag", "cli")
        assert out.returncode == 0 and f"{cli_id}" in out.stdout and "from-file" in out.stdout, out.stdout

        bad = c.post("/api/jobs", json={**QUEUED, "project": "bad\nname"})
        assert bad.status_code == 422 and bad.json()["detail"]["field"] == "project"
        bad = c.patch(f"/api/jobs/{a['id']}", json={"add_tags": ["no spaces"]})
        assert bad.status_code == 422 and bad.json()["detail"]["field"].startswith("add_tags")


@pytest.mark.shared_server
def test_only_the_owner_or_an_admin_edits_a_job(server):
    with server.client() as admin:
        bob = admin.post("/api/tokens", json={"name": f"bob-{uuid.uuid4().hex[:6]}", "role": "user"}).json()
        job = admin.post("/api/jobs", json=QUEUED).json()
    with server.client(bob["token"]) as b:
        refused = b.patch(f"/api/jobs/{job['id']}", json={"note": "mine now"})
        assert refused.status_code == 403, refused.text
        own = b.post("/api/jobs", json=QUEUED).json()
        assert b.patch(f"/api/jobs/{own['id']}", json={"note": "mine"}).json()["note"] == "mine"
    with server.client() as admin:
        assert admin.get(f"/api/jobs/{job['id']}").json()["note"] == ""
        assert admin.patch(f"/api/jobs/{own['id']}", json={"tags": ["seen"]}).json()["tags"] == ["seen"]
