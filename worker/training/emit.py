"""The training process's side of the event pipe: tokenpulse.events.Emitter, shared with command
jobs' instrumentation and the explicit API (tokenpulse.init/log), so every process of a job writes
the same lines. Run standalone (no agent), events are printed to stderr as readable lines, so
`python -m worker.training.train` is useful on its own."""
from tokenpulse.events import Emitter

__all__ = ["Emitter"]
