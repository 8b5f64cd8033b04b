"""Server-side downsampling of metric series, so a chart of a million points costs what one of a
thousand does. minmax keeps, per bucket, the first, last, minimum and maximum point (spikes
survive); lttb keeps the visually most significant point per bucket."""
from __future__ import annotations

from typing import Sequence


def columns(rows: Sequence[tuple]) -> dict:
    return {"step": [r[0] for r in rows], "t": [r[1] for r in rows], "value": [r[2] for r in rows]}


def downsample(rows: Sequence[tuple], max_points: int, mode: str = "minmax") -> dict:
    n = len(rows)
    if n <= max_points:
        out = columns(rows)
        out["downsampled"] = False
        return out
    picked = lttb(rows, max_points) if mode == "lttb" else minmax(rows, max_points)
    out = columns(picked)
    out["downsampled"] = True
    out["total_points"] = n
    return out


def minmax(rows: Sequence[tuple], max_points: int) -> list[tuple]:
    buckets = max(1, max_points // 4)
    size = len(rows) / buckets
    out: list[tuple] = []
    for b in range(buckets):
        lo, hi = int(b * size), int((b + 1) * size)
        if lo >= hi:
            continue
        chunk = rows[lo:hi]
        first, last = chunk[0], chunk[-1]
        mn = min(chunk, key=lambda r: r[2])
        mx = max(chunk, key=lambda r: r[2])
        # Keep step order; a point that is several of these at once is kept once.
        out.extend(sorted({first, mn, mx, last}, key=lambda r: r[0]))
    return out


def lttb(rows: Sequence[tuple], threshold: int) -> list[tuple]:
    """Largest-Triangle-Three-Buckets (Steinarsson 2013)."""
    n = len(rows)
    if threshold >= n or threshold < 3:
        return list(rows)
    every = (n - 2) / (threshold - 2)
    out = [rows[0]]
    a = 0
    for i in range(threshold - 2):
        s, e = int((i + 1) * every) + 1, min(int((i + 2) * every) + 1, n)
        avg_x = sum(r[0] for r in rows[s:e]) / max(1, e - s)
        avg_y = sum(r[2] for r in rows[s:e]) / max(1, e - s)
        lo, hi = int(i * every) + 1, int((i + 1) * every) + 1
        ax, ay = rows[a][0], rows[a][2]
        best, best_area = lo, -1.0
        for j in range(lo, hi):
            area = abs((ax - avg_x) * (rows[j][2] - ay) - (ax - rows[j][0]) * (avg_y - ay))
            if area > best_area:
                best, best_area = j, area
        out.append(rows[best])
        a = best
    out.append(rows[-1])
    return out
