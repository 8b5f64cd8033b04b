"""Where a metric came from, best first, and the per-job switch of each source.

A metric is read from the best source the script gives: its explicit `tokenpulse.log` or a Trainer's
callback ("api"), the logging calls it already makes ("logger": wandb, TensorBoard, MLflow, Lightning,
Accelerate, trackio), the scalar it calls `.backward()` on ("backward"), or its printed lines
("printed", parsed by the agent). A metrics event's data carries `sources: {name: label}`, the label
being a source, optionally with what said it after a colon ("logger:wandb.log"). A name reported by a
better source is never overwritten by a worse one. TOKENPULSE_CAPTURE_<SOURCE>=0 (the job's env)
switches a source off.
"""
from __future__ import annotations

import os
import threading

SOURCES = ("api", "logger", "backward", "printed")  # best first
CAPTURE_ENV = "TOKENPULSE_CAPTURE_"
OFF = ("0", "false", "no", "off")


def kind(label: str) -> str:
    """The source of a label: 'logger:wandb.log' -> 'logger'."""
    return label.split(":", 1)[0]


def rank(label: str) -> int:
    """Lower is better; an unknown label ranks last."""
    k = kind(label)
    return SOURCES.index(k) if k in SOURCES else len(SOURCES)


def describe(label: str) -> str:
    """For people: 'logger:wandb.log' -> 'wandb.log', 'printed' -> 'printed lines'."""
    k, _, detail = label.partition(":")
    words = {"api": "tokenpulse.log / Trainer", "backward": ".backward()", "printed": "printed lines"}
    return detail or words.get(k, k)


def enabled(source: str, env=None) -> bool:
    env = os.environ if env is None else env
    return str(env.get(CAPTURE_ENV + kind(source).upper(), "1")).strip().lower() not in OFF


class Owners:
    """Which source reported each metric name so far (in one process, or the agent for a job)."""

    def __init__(self) -> None:
        self.by_name: dict[str, str] = {}
        self._lock = threading.Lock()

    def claim(self, name: str, label: str) -> bool:
        """Whether this label may report this name: no better source has reported it."""
        with self._lock:
            have = self.by_name.get(name)
            if have is not None and rank(have) < rank(label):
                return False
            self.by_name[name] = label if have is None or rank(label) < rank(have) else have
            return True


OWNERS = Owners()  # this process's
