"""The pure parts of gang supervision added beside worker/agent/ranks.py and gangwatch.py: each
rank's exit for the rank table, and merging another node's stacks into one verdict. Real py-spy-
shaped dumps and a real torchrun failure summary as input."""
from __future__ import annotations

import asyncio

from test_ranks import SUMMARY, WAITING, board, dump

from tokenpulse.protocol import ExitVerdict
from worker.agent import gangstacks
from worker.agent.gangwatch import GangState, exits, judge


def test_each_rank_gets_its_exit_code_signal_state_or_stopped_by_gang():
    g = GangState(board=board(3))
    g.observe(0, "state", {"state": "failed", "failure": "crash", "reason": "Connection reset"}, 5.0, 5.0)
    judge(g, ExitVerdict(state="failed", failure="crash", exit_code=1), SUMMARY.splitlines())
    assert exits(g, SUMMARY.splitlines()) == {0: "exited with code 1", 1: "killed by SIGKILL", 2: "stopped by gang"}
    g = GangState(board=board(2))
    for r in (0, 1):
        g.observe(r, "state", {"state": "paused"}, 5.0, 5.0)
    assert exits(g, []) == {0: "paused", 1: "paused"}


def test_node_rank_0_merges_the_other_nodes_stacks_into_one_verdict():
    from worker.agent.ranks import diagnose
    g = GangState(board=board(1))  # node rank 0 sees rank 0 only, waiting in all_reduce
    mine = {0: dump(100, *WAITING)}
    remote_stack = dump(555, "_fault_hang (/w/worker/training/faults.py:60)", "run (/w/worker/training/loop.py:142)")
    calls = []

    async def fetch():  # the other node's stack arrives on the second poll
        calls.append(1)
        return [] if len(calls) < 2 else [{"rank": 1, "host": "h2", "pid": 555, "stack": remote_stack}]
    remote = asyncio.run(gangstacks.gather(fetch, mine, world=2, wait_s=10))
    assert len(calls) == 2 and [x["rank"] for x in remote] == [1]
    stacks, text, b = gangstacks.merged(g, mine, "==== rank 0 (h, pid 100) ====\n" + mine[0], remote)
    msg = diagnose(stacks, b)
    assert msg.startswith("rank 1 (h2, pid 555) at _fault_hang (/w/worker/training/faults.py:60); "), msg
    assert "rank 0 (h, pid 100) waiting in all_reduce at agree (/w/worker/training/distributed.py:111)" in msg, msg
    assert "==== rank 0 (h, pid 100) ====" in text and "==== rank 1 (h2, pid 555) ====" in text
    assert g.board.ranks.get(1) is None  # the node's own board (its heartbeat rows) keeps only its ranks


def test_gathering_gives_up_with_the_ranks_at_hand():
    async def fetch():
        return None  # the server did not answer
    assert asyncio.run(gangstacks.gather(fetch, {0: "x"}, world=2, wait_s=0)) == []


def test_a_node_sends_its_asked_for_stacks_once():
    g = GangState(board=board(2))
    gangstacks.share(g, {1: "stack of rank 1", 7: "not this node's"})
    assert g.board.ranks[1].stack == "stack of rank 1" and 7 not in g.board.ranks
    assert g.board.rows()[1]["stack"] == "stack of rank 1"  # rides on the heartbeat's rank rows
    gangstacks.sent(g)
    assert [r["stack"] for r in g.board.rows()] == [None, None]
