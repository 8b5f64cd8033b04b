"""A process's children and descendants, read from Linux /proc: what child.py asks of a rank's
launcher and tree.py of a keeper's tree (keeper.py, stdlib-only and run isolated, keeps its own)."""
from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    """A process's direct children (Linux /proc); [] where it cannot say."""
    try:
        found = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(x) for x in (task / "children").read_text().split()]
        return found
    except (OSError, ValueError):
        return []


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, children first."""
    out: list[int] = []
    todo = [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out
