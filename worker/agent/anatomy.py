"""The anatomy of a step, per rank, as the startup hook measures it (tokenpulse/instrument/patch_torch.py):
seconds per step waiting for data, in collectives, and in forward+backward+optimizer, reported every
few seconds as metrics `anatomy/r<rank>/data_s|comm_s|compute_s|step_s`. From it, slow-job reasons
that name the cause and the fix (they join slow.py's): an input-bound rank, a straggler's cause,
memory creep. Pure logic, clock passed in."""
from __future__ import annotations

import re
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

KEY = re.compile(r"^anatomy/r(\d+)/(data_s|comm_s|compute_s|step_s|rss_mb)$")
PARTS = ("data_s", "comm_s", "compute_s", "step_s")


def parse(values: dict) -> dict[int, dict[str, float]]:
    """{rank: {part: seconds per step}} from one metrics event's values."""
    out: dict[int, dict[str, float]] = {}
    for k, v in values.items():
        m = KEY.match(str(k))
        if m and isinstance(v, (int, float)):
            out.setdefault(int(m.group(1)), {})[m.group(2)] = float(v)
    return out


@dataclass
class Anatomy:
    recent: dict = field(default_factory=dict)  # rank -> deque of its last windows ({part: s})
    rss: deque = field(default_factory=lambda: deque(maxlen=240))  # (t, step, MiB) of the job's process
    tree_rss: deque = field(default_factory=lambda: deque(maxlen=120))  # (t, MiB) of the job's process tree
    rank_rss: dict = field(default_factory=dict)  # rank -> deque of (t, MiB) of that rank's own process

    def observe(self, data: dict, now: float) -> None:
        values = data.get("values") or {}
        for r, parts in parse(values).items():
            if "rss_mb" in parts:
                self.rank_rss.setdefault(r, deque(maxlen=120)).append((now, parts["rss_mb"]))
            if all(p in parts for p in PARTS):
                self.recent.setdefault(r, deque(maxlen=5)).append(parts)
        if isinstance(values.get("rss_mb"), (int, float)):
            self.rss.append((now, int(data.get("step", 0)), float(values["rss_mb"])))

    def typical(self, r: int) -> Optional[dict]:
        """A rank's median of its last windows (one noisy window is not the rank)."""
        ws = self.recent.get(r)
        if not ws or len(ws) < 2:
            return None
        return {p: statistics.median(w[p] for w in ws) for p in PARTS}

    def input_share(self) -> Optional[float]:
        """The share of a step the worst rank waits for data (the input-bound reason's measurement)."""
        shares = [t["data_s"] / t["step_s"] for r in self.recent if (t := self.typical(r)) and t["step_s"] > 0]
        return max(shares) if shares else None

    # ---- reasons ----------------------------------------------------------------------------

    def reasons(self, input_frac: float, was_open: frozenset = frozenset()) -> list[tuple[str, str]]:
        out = []
        inp = self.input_bound(input_frac * (0.8 if "input" in was_open else 1.0))
        if inp:
            out.append(("input", inp))
        mem = self.memory_blowup() or self.memory_creep()
        if mem:
            out.append(("memory", mem))
        return out

    def input_bound(self, frac: float) -> Optional[str]:
        """'41% of each step waits for data: ...' for the rank that waits most, when it is over frac."""
        worst = None
        for r in self.recent:
            t = self.typical(r)
            if t and t["step_s"] > 0 and (worst is None or t["data_s"] / t["step_s"] > worst[1]):
                worst = (r, t["data_s"] / t["step_s"], t)
        if worst is None or worst[1] < frac:
            return None
        r, share, t = worst
        who = f"rank {r}: " if len(self.recent) > 1 else ""
        return (f"input-bound: {who}{share:.0%} of each step waits for data ({t['data_s']:.3g} s of "
                f"{t['step_s']:.3g} s): set num_workers (and pin_memory) on the DataLoader, or pre-tokenize "
                f"the dataset instead of tokenizing in the collate function")

    def observe_tree_rss(self, now: float, mb: float, step: Optional[int] = None) -> None:
        """The job's process tree's resident memory as the agent samples it from the job's start
        (sysmetrics.py, every few seconds): the baseline from before the first step."""
        self.tree_rss.append((now, mb, step))

    def memory_blowup(self, min_mb: float = 1024.0, factor: float = 2.0, min_steps: int = 3) -> Optional[str]:
        """The job's memory more than doubled, by at least min_mb, within its last minutes: a blow-up
        (a list that keeps every batch, a leak per step), seen before it takes the machine down."""
        pts = list(self.tree_rss)
        if len(pts) < 3:
            return None
        t1, last, step1 = pts[-1]
        window = [p for p in pts[1:-1] if t1 - p[0] <= 300]  # the first sample may precede the imports
        if step1 is not None:  # steps known: the memory after the first step (its working set) is the baseline
            window = [p for p in window if p[2] is not None and p[2] >= 1]
        if not window:
            return None
        t0, low, step0 = min(window, key=lambda p: p[1])
        if last - low < max(min_mb, (factor - 1) * low):
            return None
        if step1 is not None and step1 - (step0 or 0) < min_steps:
            return None  # grown within the first step or two: the working set (workers, activations), not a leak
        return (f"memory blow-up: the job's memory (RSS) grew from {low:,.0f} MiB to {last:,.0f} MiB in "
                f"{t1 - t0:.0f} s{self._growing_rank(t1)}: something keeps every batch or step alive (tensors "
                f"kept with their graph, a growing list or cache); it will run out of memory")

    def _growing_rank(self, t1: float) -> str:
        """', rank 1 (512 -> 4,100 MiB)' when several ranks report their memory and one grew most."""
        growth = {}
        for r, pts in self.rank_rss.items():
            recent = [m for t, m in pts if t1 - t <= 300]
            if len(recent) >= 2:
                growth[r] = (recent[-1] - min(recent), min(recent), recent[-1])
        if len(growth) < 2:
            return ""
        r, (g, lo, hi) = max(growth.items(), key=lambda kv: kv[1][0])
        return f", rank {r} ({lo:,.0f} -> {hi:,.0f} MiB)" if g >= 256 else ""

    def memory_creep(self, min_span_s: float = 60.0, min_growth: float = 0.25, min_mb: float = 256.0) -> Optional[str]:
        """The process's memory grows steadily step after step (not one jump after the first steps)."""
        pts = list(self.rss)
        if len(pts) < 8 or pts[-1][0] - pts[0][0] < min_span_s:
            return None
        half = pts[len(pts) // 4:]  # the first quarter is warm-up (allocator, caches, compilation)
        xs = [m for _, _, m in half]
        ups = sum(b > a for a, b in zip(xs, xs[1:])) / max(1, len(xs) - 1)
        grown = xs[-1] - xs[0]
        if ups < 0.7 or grown < max(min_mb, min_growth * xs[0]):
            return None
        s0, s1 = half[0][1], half[-1][1]
        per_k = grown / max(1, s1 - s0) * 1000
        return (f"memory creep: the process's memory grew steadily from {xs[0]:,.0f} MiB to {xs[-1]:,.0f} MiB "
                f"between steps {s0} and {s1} (+{per_k:,.0f} MiB per 1,000 steps): something is kept across "
                f"steps (losses kept as tensors with their graph, growing caches or lists)")


def straggler_cause(parts_by_rank: dict[int, dict], worst: int) -> str:
    """'; most of it in forward+backward (0.40 s against 0.12 s); the others wait 0.28 s per step in
    collectives' from the ranks' anatomy (rank table rows' data_s / compute_s / comm_s), or ''."""
    me = parts_by_rank.get(worst)
    others = [p for r, p in parts_by_rank.items() if r != worst]
    if not me or not others or any(me.get(k) is None for k in ("data_s", "compute_s")):
        return ""
    med = {k: statistics.median(o.get(k) or 0.0 for o in others) for k in ("data_s", "compute_s", "comm_s")}
    extra_data, extra_compute = me["data_s"] - med["data_s"], me["compute_s"] - med["compute_s"]
    if extra_data >= extra_compute:
        cause = f"it waits for data {me['data_s']:.3g} s per step against {med['data_s']:.3g} s: its input is slow"
    else:
        ratio = me["compute_s"] / max(med["compute_s"], 1e-9)
        cause = (f"it is {ratio:.1f}x slower in forward+backward ({me['compute_s']:.3g} s against "
                 f"{med['compute_s']:.3g} s per step)")
    wait = f"; the others wait {med['comm_s']:.3g} s per step in all_reduce" if med["comm_s"] > 0 else ""
    return f"; {cause}{wait}"
