"""A restarted agent keeps its identity (issue 25, item 15): the workers list showed a dead embedded
worker as online for a minute after a restart and grew by one row per restart."""
from __future__ import annotations

import signal

from conftest import wait_for


def online(c) -> list[dict]:
    return [a for a in c.get("/api/agents").json() if a["state"] == "online"]


def test_a_restarted_agent_keeps_its_row_and_another_work_dir_is_another_agent(server):
    with server.client() as c:
        first = server.start_agent("a1")
        agent = wait_for(lambda: online(c), 60, "the agent online")[0]
        first.send_signal(signal.SIGKILL)  # no goodbye: the server still holds it online
        first.wait(30)
        server.start_agent("a1")  # the same work dir on the same host, the same token
        wait_for(lambda: (lambda a: a if a["seen_at"] > agent["seen_at"] else None)(c.get("/api/agents").json()[0]),
                 60, "the restarted agent's registration")
        agents = c.get("/api/agents").json()
        assert [a["id"] for a in agents] == [agent["id"]], agents  # one row, the same identity
        assert agents[0]["state"] == "online"

        server.start_agent("a2")  # another work dir: another agent
        both = wait_for(lambda: (lambda a: a if len(a) == 2 else None)(online(c)), 60, "a second agent")
        ids = {a["id"] for a in both}
        assert ids == {agent["id"], max(ids)} and len(ids) == 2
