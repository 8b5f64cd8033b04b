"""A multi-node stall seen whole: each agent reads only its own ranks' stacks, so node rank 0's
agent, which reports the job, asks the other nodes' agents for theirs (through the server: their
next heartbeat reply says `stack`), they send them once with their rank rows (the server keeps them
in job_ranks), and it merges every node's stacks into one verdict naming the odd rank across the
gang. The merge stays with the agents, beside the rest of the diagnosis (py-spy,
grouping, naming); the server only stores and hands the stacks on."""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Optional

from worker.agent.gangwatch import GangState
from worker.agent.ranks import Rank, RankBoard

GATHER_S = 20.0  # how long node rank 0 waits for the other nodes' stacks (a heartbeat or two, a py-spy dump)


def share(g: GangState, stacks: dict[int, str]) -> None:
    """Node rank > 0, asked: this node's ranks' stacks ride on its next heartbeat's rank rows."""
    for r, text in stacks.items():
        if r in g.board.ranks:
            g.board.ranks[r].stack = text[-100_000:]


def sent(g: GangState) -> None:
    """A heartbeat carried them: not again (the next ask gets fresh ones)."""
    for rk in g.board.ranks.values():
        rk.stack = None


async def gather(fetch: Callable[[], Awaitable[Optional[list[dict]]]], mine: dict[int, str], world: int,
                 wait_s: float = GATHER_S) -> list[dict]:
    """The other nodes' stacks (rows of rank, host, pid, stack), polled until every rank of the
    world has one, or wait_s passed: a verdict with the ranks at hand beats none."""
    deadline = time.monotonic() + wait_s
    rows: list[dict] = []
    while True:
        got = await fetch()
        if got is not None:
            rows = [x for x in got if x.get("stack") and x["rank"] not in mine]
        if len(mine) + len(rows) >= world or time.monotonic() >= deadline:
            return rows
        await asyncio.sleep(1.0)


def merged(g: GangState, mine: dict[int, str], text: str, remote: list[dict]) -> tuple[dict[int, str], str, RankBoard]:
    """Every node's stacks by rank, one text with a header per rank, and a board naming every rank
    (host, pid) for diagnose()."""
    board = RankBoard(ranks=dict(g.board.ranks))
    stacks = dict(mine)
    parts = [text] if text else []
    for x in sorted(remote, key=lambda x: x["rank"]):
        board.ranks[x["rank"]] = Rank(rank=x["rank"], host=x.get("host"), pid=x.get("pid"))
        stacks[x["rank"]] = x["stack"]
        parts.append(f"==== rank {x['rank']} ({x.get('host')}, pid {x.get('pid')}) ====\n{x['stack']}")
    return stacks, "\n".join(parts), board
