"""Where a command job's metric came from, and which source wins when several give the same one.

A script may give its loss several ways at once: the explicit API (`tokenpulse.log`), a logging
library it already calls (wandb, TensorBoard, MLflow, Lightning's self.log...), the scalar it calls
`.backward()` on, and the lines it prints. SOURCES lists them best first. A metric is taken from the
best source that has given it so far: once a better source gave a name, a worse one's values for it
are refused; a better one arriving later takes the name over.

Every training-loss name (`loss`, `train_loss`, `train/loss`...) is one metric here, so a script
that logs `train/loss` to wandb is not shown a second loss from its backward calls.

Each metrics event says its values' sources: data["sources"] = {name: source} (sources_data()).

A job switches a source off with `capture: {backward: false, printed: false, loggers: false}` in its
command spec; the agent passes that on as TOKENPULSE_CAPTURE_OFF="backward,printed,logger".

Stdlib only: imported into every process of a command job and by the agent.
"""
from __future__ import annotations

import os
import re
import threading
from typing import Iterable, Optional

SOURCES = ("api", "logger", "backward", "printed")  # best first
OFF_ENV = "TOKENPULSE_CAPTURE_OFF"
# the command spec's `capture` keys, as the user writes them -> our source names
CAPTURE_KEYS = {"api": "api", "logger": "logger", "loggers": "logger", "backward": "backward",
                "printed": "printed"}
_TRAIN_LOSS = re.compile(r"^(train(ing)?[/_.\- ]?)?loss(_step|_epoch)?$|^loss[/_.](train|step)$", re.I)


def rank(source: Optional[str]) -> int:
    """0 for the best source; an unknown source ranks below every known one."""
    try:
        return SOURCES.index(source or "")
    except ValueError:
        return len(SOURCES)


def better(a: Optional[str], b: Optional[str]) -> bool:
    """Whether source a is strictly better than source b."""
    return rank(a) < rank(b)


def off_sources(env: Optional[dict] = None) -> set[str]:
    raw = (env if env is not None else os.environ).get(OFF_ENV, "")
    return {CAPTURE_KEYS.get(w.strip().lower(), w.strip().lower()) for w in raw.split(",") if w.strip()}


def enabled(source: str) -> bool:
    """Whether this job captures metrics from this source (TOKENPULSE_CAPTURE_OFF)."""
    return source not in off_sources()


def off_env_value(capture: dict) -> str:
    """The TOKENPULSE_CAPTURE_OFF value for a command spec's `capture` mapping ({key: False} = off)."""
    return ",".join(sorted({CAPTURE_KEYS[k] for k, on in capture.items() if k in CAPTURE_KEYS and not on}))


def is_train_loss(name: str) -> bool:
    return bool(_TRAIN_LOSS.match(name.strip()))


def metric_key(name: str) -> str:
    """What a metric competes under: every training-loss name is the one `loss`."""
    return "loss" if is_train_loss(name) else name


class Claims:
    """The best source seen so far for each metric (per process, or per job in the agent)."""

    def __init__(self) -> None:
        self._best: dict[str, str] = {}
        self._lock = threading.Lock()

    def allow(self, name: str, source: str) -> bool:
        """Whether a value of `name` from `source` is taken: no better source has given it."""
        key = metric_key(name)
        with self._lock:
            cur = self._best.get(key)
            if cur is not None and better(cur, source):
                return False
            self._best[key] = source
            return True

    def source_of(self, name: str) -> Optional[str]:
        return self._best.get(metric_key(name))

    def names(self) -> list[str]:
        """The metrics given so far (every training-loss name as `loss`)."""
        return list(self._best)

    def filter(self, values: dict, source: str) -> dict:
        """The values this source may give (a better source's names left out)."""
        return {k: v for k, v in values.items() if self.allow(k, source)}


CLAIMS = Claims()  # this process's


def sources_data(names: Iterable[str], source: str) -> dict:
    """The metrics event's `sources` field for values all from one source."""
    return {n: source for n in names}
