"""Three of the slow detector's reasons (slow.py) as plain functions of what it observed: padding waste
named with its fix, periodic stalls every N steps, and a step time that grows steadily."""
from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import Optional


def padding_reason(info: dict, frac: float) -> str:
    """Padding waste, named with its fix in the job's own settings (its info events)."""
    mode = info.get("padding")
    L = info.get("max_seq_length")
    rec = info.get("recommended_max_seq_length")
    if rec is None and L:
        mean = (1 - frac) * L  # real tokens per row (max_length rows are one example each)
        rec = int(math.ceil(mean * 2 / 8) * 8)
        rec_s = f"max_seq_length around {rec} (about twice the mean example of {mean:.0f} tokens)"
    else:
        rec_s = f"max_seq_length={rec} (the recommended length for this data)" if rec else ""
    msg = f"padding waste: {frac:.0%} of every batch is pad tokens"
    if mode == "max_length":
        msg += f" (padding=max_length to max_seq_length={L})" if L else " (padding=max_length)"
        fix = "use padding=auto (packing) or dynamic"
        msg += f"; {fix}" + (f", or {rec_s}" if rec_s else "")
    elif mode == "dynamic":
        msg += "; use padding=auto (packing) or group_by_length=true"
        if rec_s and L and rec and rec < L:
            msg += f", and {rec_s}"
    elif rec_s:
        msg += f"; {rec_s}"
    return msg


def periodic_stalls(arrivals: list, pauses_at: dict, min_frac: float) -> Optional[str]:
    """Pauses every N steps (arrival gaps far above the typical one) costing at least min_frac of the
    time; arrivals: (t, step) of each metrics event; pauses_at: step -> phases seen after it."""
    found = periodic_share(arrivals, pauses_at, min_frac)
    return found[3] if found else None


def periodic_share(arrivals: list, pauses_at: dict, min_frac: float) -> Optional[tuple]:
    """periodic_stalls' measurements: (every n steps, the share of the time, the phases seen, its text)."""
    a = arrivals[-400:]
    if len(a) < 12:
        return None
    per = [((t2 - t1) / (s2 - s1), s2, t2 - t1) for (t1, s1), (t2, s2) in zip(a, a[1:]) if s2 > s1]
    typical = statistics.median(p for p, _, _ in per)
    if typical <= 0:
        return None
    spikes = [(s, dt) for p, s, dt in per if p > 4 * typical]
    if len(spikes) < 3:
        return None
    gaps = [b - a_ for (a_, _), (b, _) in zip(spikes, spikes[1:])]
    n, count = Counter(gaps).most_common(1)[0]
    if count < max(2, 0.6 * len(gaps)) or n < 2:
        return None
    lost = sum(dt - typical * 1 for _, dt in spikes)
    span = a[-1][0] - a[0][0]
    if span <= 0 or lost / span < min_frac:
        return None
    seen = set()
    for s, _ in spikes:
        for k in (s - 1, s - 2, s):
            seen |= pauses_at.get(k, set())
    cause = (f"during '{', '.join(sorted(seen))}'" if seen else
             "no phase reported: re-sorting or reloading data, evaluation, or checkpoints")
    each = statistics.median(dt for _, dt in spikes)
    return n, lost / span, seen, (f"periodic stalls every {n} steps ({each:.1f} s each, {lost / span:.0%} of "
                                  f"the time; {cause})")


def steady_growth(samples: list, factor: float) -> Optional[str]:
    """A step time that grows steadily over the last 12 samples (slow.Sample), by `factor` x at least:
    not one jump (that is a fall in throughput) and not noise that happens to drift."""
    xs = [s.step_time for s in samples[-12:]]
    if len(xs) < 9:
        return None
    k = len(xs) // 3
    m1, m2, m3 = statistics.median(xs[:k]), statistics.median(xs[k:2 * k]), statistics.median(xs[-k:])
    if not (m1 > 0 and m2 >= 1.15 * m1 and m3 >= 1.15 * m2 and m3 >= factor * m1):
        return None
    jump = max(b / a for a, b in zip(xs, xs[1:]) if a > 0)
    if math.log(jump) >= 0.5 * math.log(m3 / m1):
        return None  # one jump, not a steady climb
    ups = sum(b > a for a, b in zip(xs, xs[1:])) / (len(xs) - 1)
    if ups < 0.6:
        return None  # noise that happens to drift, not a climb
    first, last = samples[-len(xs)].step, samples[-1].step
    return (f"step time grows steadily: {m1:.2f} s -> {m3:.2f} s per step between steps {first} and "
            f"{last} (something accumulates: a leak, growing sequences, or state kept across steps)")
