"""Issue 22 (5): `tokenpulse mcp` through the official SDK's own stdio client against a real server and
agent: the tools listed, each called, and the caller's token is all it has (another user's job cannot
be cancelled)."""
from __future__ import annotations

import json
import os
import sys

import anyio
import pytest

mcp = pytest.importorskip("mcp")
from conftest import ROOT, wait_for  # noqa: E402
from mcp import ClientSession  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402

TOOLS = {"list_jobs", "get_job", "job_metrics", "why_slow", "where_stuck", "ranks", "job_logs", "submit",
         "clone_job", "cancel", "pause", "resume", "edit_job", "get_sweep"}


def answer(result) -> object:
    """A tool's answer: its structured content, else its text parsed as JSON (or the text)."""
    sc = getattr(result, "structured_content", None) or getattr(result, "structuredContent", None)
    if sc is not None:
        return sc.get("result", sc) if isinstance(sc, dict) and set(sc) == {"result"} else sc
    text = "".join(getattr(c, "text", "") for c in result.content)
    try:
        return json.loads(text)
    except ValueError:
        return text


async def session_calls(server, token: str, calls):
    params = StdioServerParameters(command=sys.executable, args=["-m", "tokenpulse.cli", "mcp"], cwd=str(ROOT),
                                   env={**os.environ, "TOKENPULSE_URL": server.url, "TOKENPULSE_TOKEN": token})
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as s:
            await s.initialize()
            return await calls(s)


def test_mcp_tools_against_a_real_server(server_factory, tmp_path):
    server = server_factory()
    server.start_agent("mcp", "--allow-commands")
    work = tmp_path / "w"
    work.mkdir()
    (work / "loop.py").write_text("import time\nfor i in range(600):\n    print('tick', i, flush=True)\n    "
                                  "time.sleep(0.1)\n")
    with server.client() as c:
        other = c.post("/api/tokens", json={"name": "someone", "role": "user"}).json()["token"]

    async def calls(s):
        out = {}
        tools = await s.list_tools()
        out["tools"] = {t.name for t in tools.tools}
        r = await s.call_tool("submit",
                              {"spec": {"command": [sys.executable, "loop.py"], "cwd": str(work), "name": "mcp-loop"}})
        assert not r.is_error, r
        jid = answer(r)["id"]
        out["jid"] = jid
        await anyio.to_thread.run_sync(lambda: wait_for(
            lambda: server.client().get(f"/api/jobs/{jid}").json()["state"] == "running", 90, "running"))
        await anyio.to_thread.run_sync(lambda: wait_for(
            lambda: server.client().get(f"/api/jobs/{jid}/logs", params={"grep": "tick"}).json()["matched"] > 0, 30,
            "ticks"))
        await anyio.to_thread.run_sync(lambda: wait_for(lambda: server.client().get(
            f"/api/jobs/{jid}/metrics", params={"prefix": "sys/"}).json()["series"], 30, "system metrics"))
        for name, args in [("list_jobs", {"query": "mcp-loop"}), ("get_job", {"job_id": jid}),
                           ("job_metrics", {"job_id": jid}), ("why_slow", {"job_id": jid}),
                           ("where_stuck", {"job_id": jid}), ("ranks", {"job_id": jid}),
                           ("job_logs", {"job_id": jid, "grep": "tick", "limit": 3})]:
            r = await s.call_tool(name, args)
            assert not r.is_error, (name, r)
            out[name] = answer(r)
        r = await s.call_tool("edit_job", {"job_id": jid, "add_tags": ["mcp"], "note": "watched by an agent"})
        assert not r.is_error, r
        out["edit_job"] = answer(r)
        out["by_tag"] = answer(await s.call_tool("list_jobs", {"tag": "mcp", "project": "default"}))
        r = await s.call_tool("pause", {"job_id": jid})  # a command that never said it can pause: refused, in words
        out["pause"] = (r.is_error, "".join(getattr(c, "text", "") for c in r.content))
        r = await s.call_tool("clone_job", {"job_id": jid, "changes": {"name": "mcp-loop-2"}})
        assert not r.is_error, r
        out["clone"] = answer(r)
        for j in (jid, out["clone"]["id"]):
            r = await s.call_tool("cancel", {"job_id": j})
            assert not r.is_error, r
        await anyio.to_thread.run_sync(lambda: server.wait_job(jid, timeout=60))
        r = await s.call_tool("resume", {"job_id": jid})  # a cancelled job is over: refused, in words
        out["resume"] = (r.is_error, "".join(getattr(c, "text", "") for c in r.content))
        return out

    out = anyio.run(session_calls, server, server.token, calls)
    assert out["tools"] == TOOLS, out["tools"]
    jid = out["jid"]
    assert [j["id"] for j in out["list_jobs"]["jobs"]] == [jid]
    assert out["edit_job"]["tags"] == ["mcp"] and out["edit_job"]["note"] == "watched by an agent"
    assert [(j["id"], j["tags"]) for j in out["by_tag"]["jobs"]] == [(jid, ["mcp"])]
    assert out["get_job"]["state"] == "running" and out["get_job"]["spec"]["command"][1] == "loop.py"
    assert "sys/cpu_pct" in out["job_metrics"] and "sys/cpu_pct" in out["why_slow"]["system_now"]
    assert out["why_slow"]["state"] == "running" and "verdicts" in out["why_slow"]
    assert out["where_stuck"]["stalled"] is False
    assert out["ranks"] == {"ranks": []}  # one process, no rank table
    assert len(out["job_logs"]["lines"]) == 3 and all("tick" in x for x in out["job_logs"]["lines"])
    assert out["pause"][0] and "pause" in out["pause"][1].lower(), out["pause"]
    assert out["clone"]["parent_id"] == jid
    assert out["resume"][0] and "409" in out["resume"][1], out["resume"]

    # another user's token: it reads, but cannot cancel a job it does not own
    async def as_other(s):
        r = await s.call_tool("get_job", {"job_id": jid})
        assert not r.is_error
        r = await s.call_tool("cancel", {"job_id": out["clone"]["id"]})
        return r.is_error, "".join(getattr(c, "text", "") for c in r.content)
    refused, text = anyio.run(session_calls, server, other, as_other)
    assert refused and "403" in text, text
