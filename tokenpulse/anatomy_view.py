"""A job's step anatomy as a person reads it (the CLI's `ranks` and `show`): each rank's latest
seconds per step waiting for data, in forward+backward+optimizer and in collectives, from the metrics
`anatomy/r<rank>/data_s|compute_s|comm_s|step_s` the startup hook sends every few seconds
(tokenpulse/instrument/patch_torch.py). Stdlib only; the job page has its own copy in web/static/anatomy.js."""
from __future__ import annotations

import re

KEY = re.compile(r"^anatomy/r(\d+)/(data_s|comm_s|compute_s|step_s)$")
PREFIX = "anatomy/"


def latest(series: dict) -> dict[int, dict[str, float]]:
    """{rank: {part: seconds per step}} of each rank's newest window, from /api/jobs/{id}/metrics's series."""
    out: dict[int, dict[str, float]] = {}
    for name, s in series.items():
        m = KEY.match(name)
        values = (s or {}).get("value") or []
        if m and values and isinstance(values[-1], (int, float)):
            out.setdefault(int(m.group(1)), {})[m.group(2)] = float(values[-1])
    return {r: p for r, p in sorted(out.items()) if "step_s" in p}


def shares(parts: dict[str, float]) -> dict:
    """{"step_s", "data", "compute", "collectives"}: each part's share of the step, as '41%'."""
    step = parts.get("step_s") or 0.0

    def pct(k: str) -> str:
        return f"{(parts.get(k) or 0.0) / step:.0%}" if step > 0 else "?"
    return {"step_s": round(step, 4), "data": pct("data_s"), "compute": pct("compute_s"), "collectives": pct("comm_s")}
