"""`tokenpulse mcp`: the Model Context Protocol over stdio (the official SDK, `mcp`), so a coding agent
can look at and steer training jobs. Every tool is one or two REST calls made with the caller's own
token (TOKENPULSE_TOKEN, or the data dir's token file): the agent may do what that token may and
nothing more (a user token cannot cancel another user's job; a read-only question never writes).
stdout is the protocol's: nothing else is printed there."""
from __future__ import annotations

import json
from typing import Any, Optional

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from tokenpulse.client import ApiError, Client

SLOW_KINDS = {"slow", "contention", "straggler", "quiet"}  # plus a command job's first-steps verdicts


def _call(fn, *args, **kw) -> Any:
    try:
        return fn(*args, **kw)
    except ApiError as e:  # the server's refusal, in its own words (403 naming the owner, 422 naming the field)
        raise ToolError(str(e)) from None


def build(api: Client) -> MCPServer:
    app = MCPServer("tokenpulse", instructions=(
        "Training jobs on a tokenpulse server. Find a job with list_jobs, read it with get_job, ask "
        "why_slow or where_stuck when it misbehaves, read its log with job_logs; submit, clone_job with "
        "changes, cancel, pause and resume act with the user's own token. Jobs sit in projects with tags "
        "and a note (edit_job); a sweep's trials and best setting: get_sweep."))

    @app.tool()
    def list_jobs(state: Optional[str] = None, query: Optional[str] = None, limit: int = 20,
                  project: Optional[str] = None, tag: Optional[str] = None) -> dict:
        """Jobs, newest first. state: queued, starting, running, paused, completed, failed or cancelled;
        query: a name fragment or a job id ('#12'); project: only that project's; tag: only jobs with it."""
        params: dict = {"limit": max(1, min(limit, 200))}
        if state:
            params["state"] = state
        if query:
            params["q"] = query
        if project:
            params["project"] = project
        if tag:
            params["tag"] = tag
        r = _call(api.request, "GET", "/api/jobs", params=params)
        return {"total": r["total"],
                "jobs": [{k: j.get(k) for k in ("id", "name", "kind", "state", "step", "total_steps",
                                                "phase", "last", "project", "tags", "sweep_id",
                                                "created_at")} for j in r["jobs"]]}

    @app.tool()
    def get_job(job_id: int) -> dict:
        """A job's state, phase, step, latest metrics, its attempts (how each ended) and open alerts."""
        j = _call(api.job, job_id)
        alerts = _call(api.alerts, job_id=job_id, limit=50)
        return {**{k: j.get(k) for k in ("id", "name", "kind", "state", "phase", "step", "total_steps", "last",
                                         "reason", "failure", "agent_id", "checkpoint", "output_dir", "parent_id",
                                         "created_at", "started_at", "finished_at", "spec", "project", "tags",
                                         "note", "sweep_id")},
                "attempts": j.get("attempts"),
                "open_alerts": [{k: a[k] for k in ("kind", "severity", "message")} for a in alerts
                                if a["state"] != "cleared"]}

    @app.tool()
    def job_metrics(job_id: int, keys: Optional[list[str]] = None, max_points: int = 50) -> dict:
        """A job's metric series (downsampled to max_points): loss, lr, tokens_per_s, eval/loss... and
        the agent's system metrics (sys/cpu_pct, sys/rss_mb, sys/gpu0_util_pct...). Default: every series."""
        params: dict = {"max_points": max(2, min(max_points, 2000))}
        if keys:
            params["keys"] = keys
        return _call(api.request, "GET", f"/api/jobs/{job_id}/metrics", params=params)["series"]

    @app.tool()
    def why_slow(job_id: int) -> dict:
        """Why a job is slow: the agent's slow-job verdicts (throughput fell, padding, the GPU idle,
        input-bound, CPU contention, a straggler rank) and a command job's first-steps advice, each
        with its fix; and its latest system metrics."""
        j = _call(api.job, job_id)
        alerts = _call(api.alerts, job_id=job_id, limit=100)
        found = [{k: a[k] for k in ("kind", "severity", "state", "message")} for a in alerts
                 if a["kind"] in SLOW_KINDS
                 or (a["kind"] not in ("stalled", "crashed", "disk_full") and a["severity"] == "warning")]
        sys_now = {}
        series = _call(api.request, "GET", f"/api/jobs/{job_id}/metrics",
                       params={"prefix": "sys/", "max_points": 2})["series"]
        for k, s in series.items():
            if s["value"]:
                sys_now[k] = s["value"][-1]
        return {"state": j["state"], "step": j.get("step"), "last": j.get("last"),
                "verdicts": found or "no slow-job verdict: the agent found nothing holding this job back",
                "system_now": sys_now}

    @app.tool()
    def where_stuck(job_id: int) -> dict:
        """Where a job is stuck: the stall verdict (the user's innermost frame, the rank, what the others
        wait in) and every thread's stack, when the agent judged it stalled."""
        j = _call(api.job, job_id)
        stalls = _call(api.alerts, job_id=job_id, kind="stalled", limit=5)
        if not stalls:
            return {"state": j["state"], "stalled": False,
                    "verdict": "no stall: the job has not stopped making progress"}
        a = stalls[0]
        return {"state": j["state"], "stalled": a["state"] != "cleared", "verdict": a["message"],
                "stack": (a.get("stack") or "")[-20000:], "since": a["created_at"]}

    @app.tool()
    def ranks(job_id: int) -> dict:
        """A distributed job's ranks: host, pid, device, step, step time, own work, memory, exit
        (none for a one-process job)."""
        return {"ranks": _call(api.ranks, job_id)}

    @app.tool()
    def job_logs(job_id: int, grep: Optional[str] = None, limit: int = 200) -> dict:
        """A job's log: the last `limit` lines, or those containing grep (case-insensitive)."""
        r = _call(api.logs, job_id, grep=grep, limit=max(1, min(limit, 5000)))
        return {"matched": r["matched"], "lines": [f"{x['stream']}: {x['line']}" for x in r["lines"]]}

    @app.tool()
    def submit(spec: dict) -> dict:
        """Submit a job. A training job's spec: {"name", "model", "dataset", "max_steps", ...} (JobSpec);
        a command job's: {"command": ["python", "train.py"], "cwd", ...} (needs a token with commands)."""
        path = "/api/jobs/command" if "command" in spec else "/api/jobs"
        r = _call(api.request, "POST", path, json=spec)
        return {"id": r["id"], "state": r.get("state"), "warnings": r.get("warnings", [])}

    @app.tool()
    def clone_job(job_id: int, changes: Optional[dict] = None) -> dict:
        """Start a job again (a retry) with some settings changed, e.g. {"learning_rate": 1e-4}."""
        r = _call(api.clone, job_id, changes or {})
        return {"id": r["id"], "state": r.get("state"), "parent_id": job_id, "warnings": r.get("warnings", [])}

    @app.tool()
    def edit_job(job_id: int, project: Optional[str] = None, add_tags: Optional[list[str]] = None,
                 remove_tags: Optional[list[str]] = None, note: Optional[str] = None) -> dict:
        """Move a job to a project, add or remove its tags, or write its markdown note (your own jobs)."""
        fields: dict = {"add_tags": add_tags or [], "remove_tags": remove_tags or []}
        if project:
            fields["project"] = project
        if note is not None:
            fields["note"] = note
        j = _call(api.edit, job_id, **fields)
        return {k: j.get(k) for k in ("id", "name", "project", "tags", "note")}

    @app.tool()
    def get_sweep(sweep_id: int) -> dict:
        """A sweep: its state, objective, best trial so far and every trial (settings, state, objective,
        the step a pruned one stopped at, why), with each parameter's importance."""
        s = _call(api.sweep_detail, sweep_id)
        imp = _call(api.request, "GET", f"/api/sweeps/{sweep_id}/importance")
        return {**{k: s.get(k) for k in ("id", "name", "project", "state", "reason", "method", "objective",
                                         "best", "counts", "saved_hours")},
                "trials": [{k: t.get(k) for k in ("number", "job_id", "params", "state", "value", "pruned_step",
                                                  "reason")} for t in s["trials"]],
                "importance": imp["importance"]}

    def control(action: str, job_id: int) -> dict:
        r = _call(api.action, job_id, action)
        return {"id": r["id"], "state": r["state"], "requested_action": r.get("requested_action")}

    @app.tool()
    def cancel(job_id: int) -> dict:
        """Stop a job for good."""
        return control("cancel", job_id)

    @app.tool()
    def pause(job_id: int) -> dict:
        """Pause a job: it saves a checkpoint at the end of its step; resume continues from it."""
        return control("pause", job_id)

    @app.tool()
    def resume(job_id: int) -> dict:
        """Queue a paused (or failed) job again from its newest checkpoint."""
        return control("resume", job_id)

    return app


def serve(api: Client) -> None:
    build(api).run("stdio")


def dumps(x: Any) -> str:  # for a person reading a tool's answer in a log
    return json.dumps(x, indent=2, default=str)
