"""Loss from a command job's printed lines, the last resort (tokenpulse/instrument/sources.py), and
where each of a job's metrics came from.

`loss 2.31`, `loss: 2.31`, `train_loss=2.31`, `'loss': 2.31`, `| loss 6.12 |`: a name ending in
"loss", then a number, with at most a colon or an equals sign (and quotes) between. A line that only
looks like one (`lossless 3`, `loss of signal 5`) is not. The step is the line's own when it says
one (`iter 10:`, `step 10`, `10/100` in a line that names no epoch), else the step the job has reached.
A name that a better source reported for this job (its metrics events) is never read from print.

The job's `metric_sources` (name -> source: api, logger, backward, printed) is kept here too, from the
`sources` of its metrics events and from print, with `metric_via` (name -> the logging call, from its
processes' info): the agent sends both as the job's info when they change (the job page and
`tokenpulse show` say where each metric came from). A value from a worse source than one another
process of the job already gave for that metric is dropped here.
"""
from __future__ import annotations

import math
import re
from typing import Mapping, Optional, Union

from tokenpulse.instrument import sources
from tokenpulse.protocol import metric_wire

PRINTED = "printed"
MAX_NAMES = 64  # a print-only script has a handful; past this, new printed names are not read
NUMBER = r"[-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf(?:inity)?)"
LOSS = re.compile(r"(?<![\w/.-])(?:(?P<pre>train|val|valid|validation|eval|test)\s+)?"
                  r"['\"]?(?P<name>(?:[A-Za-z][\w/.-]{0,50}?[_/.-])?loss)['\"]?"
                  r"(?:\s*[:=]\s*|\s+)(?:tensor\()?(?P<value>" + NUMBER + r")(?![\w.])", re.IGNORECASE)
STEP_WORD = re.compile(r"\b(?:global[_ ]step|step|iter(?:ation)?|it)\s*[:=#]?\s*(?P<n>\d+)\b", re.IGNORECASE)
FRACTION = re.compile(r"(?<![\w./])(?P<n>\d+)\s*/\s*\d+(?![\w./])")


def parse(line: str) -> tuple[dict[str, float], Optional[int]]:
    """The loss values a printed line says, and its step if it says one."""
    values: dict[str, float] = {}
    for m in LOSS.finditer(line):
        try:
            name = m["name"].lower() if m["name"].lower() == "loss" else m["name"]
            values[f"{m['pre'].lower()}_{name}" if m["pre"] else name] = float(m["value"])
        except ValueError:
            continue
    if not values:
        return {}, None
    return values, line_step(line)


def line_step(line: str) -> Optional[int]:
    m = STEP_WORD.search(line)
    if m:
        return int(m["n"])
    if "epoch" in line.lower():
        return None  # `| epoch 2 | 200/2983 batches |`: a count within the epoch, not the job's step
    m = FRACTION.search(line)
    return int(m["n"]) if m else None


class JobMetrics:
    """One job's printed-loss reading and where each of its metrics came from, across its processes."""

    def __init__(self, env: Optional[Mapping[str, str]] = None):
        self.printing = PRINTED not in sources.off_sources(dict(env or {}))
        self.claims = sources.Claims()  # every metric's best source so far (no `sources`: the API's)
        self.shown: dict[str, str] = {}  # name -> its source (sources.SOURCES), for the names a source was said for
        self.via: dict[str, str] = {}  # name -> the logging call that said it ('wandb.log', the process's info)
        self.step = 0  # the step the job has reached (its events)
        self.non_finite: set[str] = set()
        self.changed = False  # shown or via changed since they were last sent

    def observe(self, kind: str, data: dict) -> Optional[dict]:
        """An event from the job's processes; returns what of it goes on (a metrics event without its
        `sources`, which the job's info carries, and without a value from a worse source than one
        another of its processes already gave), or None when nothing of it goes on."""
        if kind == "alive" and isinstance(data.get("step"), int):
            self.step = max(self.step, data["step"])
        if kind == "info" and data.get("trainer"):
            self.printing = False  # a Trainer's callback gives what its log lines print ({'eval_loss': ...})
        if kind == "info" and "metric_via" in data:
            if isinstance(data["metric_via"], dict):
                self.via.update({str(k): str(v) for k, v in data["metric_via"].items()})
                self.changed = True
            rest = {k: v for k, v in data.items() if k != "metric_via"}
            return rest or None
        if kind != "metrics":
            return data
        said = data.get("sources") or {}
        values = {}
        for name, v in data.get("values", {}).items():
            if name.startswith(("sys/", "anatomy/")):
                values[name] = v
                continue
            source = said.get(name, "api")
            if not self.claims.allow(name, source):
                continue  # a better source gave it (in another process of the job)
            values[name] = v
            if name in said or name in self.shown:  # (a name printed before the Trainer's callback said it)
                self._show(name, source)
        if isinstance(data.get("step"), int) and not said:
            self.step = max(self.step, data["step"])
        if not values and data.get("values"):
            return None
        return {k: v for k, v in data.items() if k != "sources"} | {"values": values}

    def _show(self, name: str, source: str) -> None:
        if self.shown.get(name) != source:
            self.shown[name] = source
            self.changed = True

    def printed(self, line: str) -> list[tuple[str, dict]]:
        """The events a printed line's loss values make: a metrics event (a non-finite value as its
        word, protocol.metric_wire) and an alert for a value that turned non-finite (or cleared when
        finite again), as the Emitter does."""
        if not self.printing or "loss" not in line.lower():
            return []
        values, step = parse(line)
        at = step if step is not None else self.step
        keep: dict[str, Union[float, str]] = {}
        out: list[tuple[str, dict]] = []
        for name, v in values.items():
            if name not in self.shown and len(self.shown) >= MAX_NAMES:
                continue
            if not self.claims.allow(name, PRINTED):
                continue  # a better source reports it
            self._show(name, PRINTED)
            keep[name] = metric_wire(v)
            if math.isfinite(v):
                if name in self.non_finite:
                    self.non_finite.discard(name)
                    out.append(("alert", {"kind": f"non_finite:{name}"[:64], "clear": True, "severity": "critical",
                                          "message": f"{name} is finite again at step {at} (printed)"}))
            elif name not in self.non_finite:
                self.non_finite.add(name)
                out.append(("alert", {"kind": f"non_finite:{name}"[:64], "severity": "critical",
                                      "message": f"{name} is {v} at step {at} (printed)"}))
        if keep:
            out.insert(0, ("metrics", {"step": at, "values": keep}))
        return out

    def sources_info(self) -> Optional[dict]:
        """The job's info update when its metric sources changed since last time, else None:
        metric_sources {name: api | logger | backward | printed} and metric_via {name: 'wandb.log'}."""
        if not self.changed:
            return None
        self.changed = False
        via = {k: self.via[k] for k in sorted(self.shown) if self.shown[k] == "logger" and k in self.via}
        return {"metric_sources": dict(sorted(self.shown.items())), "metric_via": via}
