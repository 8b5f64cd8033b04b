"""A small Python client for the REST API (what the CLI uses, and what scripts can use)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import httpx

DEFAULT_URL = "http://127.0.0.1:8765"


class ApiError(Exception):
    def __init__(self, status: int, detail: Any):
        self.status, self.detail = status, detail
        if isinstance(detail, dict):
            text = detail.get("message") or str(detail)
        else:
            text = str(detail)
        super().__init__(f"HTTP {status}: {text}")


def find_token(data_dir: Optional[Path] = None) -> str:
    token = os.environ.get("TOKENPULSE_TOKEN")
    if token:
        return token
    path = (data_dir or Path(os.environ.get("TOKENPULSE_DATA_DIR", "tokenpulse-data"))) / "token"
    if path.exists():
        return path.read_text().strip()
    raise SystemExit(f"no token: set TOKENPULSE_TOKEN or run where {path} exists (the server writes it)")


class Client:
    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, timeout: float = 60):
        self.url = (url or os.environ.get("TOKENPULSE_URL") or DEFAULT_URL).rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=timeout,
                                 headers={"Authorization": f"Bearer {token or find_token()}"})

    def request(self, method: str, path: str, **kw) -> Any:
        r = self.http.request(method, path, **kw)
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail")
            except ValueError:
                detail = r.text
            raise ApiError(r.status_code, detail)
        return r.json() if r.content else None

    def submit(self, spec: dict) -> dict:
        return self.request("POST", "/api/jobs", json=spec)

    def run(self, command, cwd: Optional[str] = None, env: Optional[dict] = None,
            secret_env: Optional[list] = None, name: Optional[str] = None, **settings) -> dict:
        """Submit a command job: `command` is an argv list (or a string, split like a shell would).
        env values are plain settings, shown on the job page; secret_env names variables the agent
        passes from its own environment (never sent here). Needs a token with the commands scope."""
        spec = {"command": command, "cwd": cwd, "env": env or {}, "secret_env": secret_env or [],
                "name": name, **settings}
        return self.submit_command({k: v for k, v in spec.items() if v is not None})

    def logs(self, job_id: int, grep: Optional[str] = None, regex: bool = False, after_seq: int = -1,
             limit: int = 1000) -> dict:
        """A job's log lines (all, or those matching grep):
        {"lines": [{seq, t, stream, line}], "matched", "last_seq"}."""
        params = {"after_seq": after_seq, "limit": limit, "regex": regex, **({"grep": grep} if grep else {})}
        return self.request("GET", f"/api/jobs/{job_id}/logs", params=params)

    def submit_command(self, spec: dict) -> dict:
        return self.request("POST", "/api/jobs/command", json=spec)

    def jobs(self, state: Optional[str] = None, q: Optional[str] = None, limit: int = 50,
             project: Optional[str] = None, tags: Optional[list[str]] = None) -> dict:
        params = {k: v for k, v in {"state": state, "q": q, "limit": limit, "project": project,
                                    "tag": tags or None}.items() if v is not None}
        return self.request("GET", "/api/jobs", params=params)

    def edit(self, job_id: int, **fields) -> dict:
        """A job's project, tags (tags, add_tags, remove_tags) or markdown note."""
        return self.request("PATCH", f"/api/jobs/{job_id}", json=fields)

    def projects(self) -> list:
        return self.request("GET", "/api/projects")

    def sweep(self, spec: dict) -> dict:
        return self.request("POST", "/api/sweeps", json=spec)

    def sweeps(self, project: Optional[str] = None) -> list:
        return self.request("GET", "/api/sweeps", params={"project": project} if project else None)

    def sweep_detail(self, sweep_id: int) -> dict:
        return self.request("GET", f"/api/sweeps/{sweep_id}")

    def sweep_action(self, sweep_id: int, action: str) -> dict:
        return self.request("POST", f"/api/sweeps/{sweep_id}/{action}")

    def job(self, job_id: int) -> dict:
        return self.request("GET", f"/api/jobs/{job_id}")

    def ranks(self, job_id: int) -> list:
        """A distributed job's rank table (empty for a one-process job)."""
        return self.request("GET", f"/api/jobs/{job_id}/ranks")

    def action(self, job_id: int, action: str) -> dict:
        return self.request("POST", f"/api/jobs/{job_id}/{action}")

    def fix(self, job_id: int, n: int = 1, alert_id: Optional[int] = None, kind: Optional[str] = None,
            revert: bool = False) -> dict:
        """Apply a verdict's fix (the n-th of the job's open fixes, or of one alert / alert kind), or
        revert the newest applied one: {"job", "change"}."""
        body: dict = {"revert": True} if revert else {"n": n}
        if alert_id is not None:
            body["alert_id"] = alert_id
        if kind is not None:
            body["kind"] = kind
        return self.request("POST", f"/api/jobs/{job_id}/fix", json=body)

    def changes(self, job_id: int) -> list:
        return self.request("GET", f"/api/jobs/{job_id}/changes")

    def clone(self, job_id: int, changes: Optional[dict] = None) -> dict:
        return self.request("POST", f"/api/jobs/{job_id}/clone", json={"changes": changes or {}})

    def metrics(self, job_id: int, keys: Optional[list[str]] = None, max_points: int = 1000) -> dict:
        return self.request("GET", f"/api/jobs/{job_id}/metrics", params={"keys": keys or [], "max_points": max_points})

    def events(self, job_id: int, after_seq: int = -1, kinds: Optional[list[str]] = None) -> dict:
        return self.request("GET", f"/api/jobs/{job_id}/events",
                            params={"after_seq": after_seq, "kinds": kinds or []})

    def analyze(self, spec: dict, measure: float = 0) -> dict:
        return self.request("POST", "/api/datasets/analyze", json=spec, timeout=1200,
                            params={"measure": measure} if measure else None)

    def alerts(self, **filters) -> list:
        return self.request("GET", "/api/alerts", params={k: v for k, v in filters.items() if v is not None})

    def tokens(self) -> list:
        return self.request("GET", "/api/tokens")

    def create_token(self, name: str, role: str = "user", allow_commands: bool = False, gang: bool = False) -> dict:
        """A new token (its secret in "token", shown this once). Only an admin creates admin, agent
        and metrics tokens; `gang` (agent tokens) lets its agent join multi-node jobs."""
        return self.request("POST", "/api/tokens", json={"name": name, "role": role,
                                                         "allow_commands": allow_commands, "gang": gang})

    def revoke_token(self, token_id: int) -> dict:
        return self.request("POST", f"/api/tokens/{token_id}/revoke")

    def me(self) -> dict:
        """The calling token: role, rights, and whose jobs are its own."""
        return self.request("GET", "/api/tokens/me")

    def agents(self) -> list:
        return self.request("GET", "/api/agents")
