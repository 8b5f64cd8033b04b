"""How a run that stopped before its planned end says so: a non-finite loss (failed, an alert), a
cancel (the agent's SIGTERM), a pause or a preemption (a checkpoint saved first, then paused, or
queued to resume from it). The state event and the process's exit code; None: the run was not stopped
(it completed or its data ran out, session.py saves the final model)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from tokenpulse.protocol import AlertKind, Failure

from .controls import Controls
from .errors import EXIT_NAN, EXIT_OK, EXIT_PREEMPTED
from .loop import LoopResult, LoopState


def stopped_early(em, controls: Controls, res: LoopResult, state: LoopState,
                  save: Callable[..., Optional[Path]]) -> Optional[int]:
    if res.outcome == Failure.NAN:
        em.alert(AlertKind.NAN, f"non-finite loss at step {res.step}: {res.detail}", severity="critical")
        em.emit("state", state="failed", reason=res.detail, failure=Failure.NAN, exit_code=EXIT_NAN)
        return EXIT_NAN
    if res.outcome == "cancelled":
        em.emit("state", state="cancelled", reason=f"cancelled (SIGTERM) at step {res.step}")
        return EXIT_OK
    if res.outcome == "paused":
        p = save(state, requested=True)
        took = controls.request_s()
        took_words = f", saved {took:.1f} s after the {controls.requested}" if took is not None else ""
        if controls.preempt:  # an unannounced SIGTERM: back to the queue, to resume from p
            em.emit("state", state="queued", failure=Failure.PREEMPTED, exit_code=EXIT_PREEMPTED,
                    reason=f"preempted: SIGTERM not sent by its agent (a scheduler's preemption, a node "
                           f"drain) at step {state.step}; checkpoint {p}{took_words}; requeued to resume from it")
            return EXIT_PREEMPTED
        em.emit("state", state="paused", reason=f"paused at step {state.step}; resume from {p}{took_words}")
        return EXIT_OK
    return None
