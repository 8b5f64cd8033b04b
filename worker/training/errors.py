"""Errors the training process and the analyzer turn into clear messages and exit codes (a spec the
user can fix is tokenpulse.errors.SpecError, shared with the server)."""
from __future__ import annotations

# Exit codes of `python -m worker.training.train` / `python -m worker.training.analyze` (the agent maps them to
# failures).
EXIT_OK, EXIT_CRASH, EXIT_SPEC, EXIT_FAULT_CRASH, EXIT_NAN, EXIT_OOM, EXIT_DISK_FULL = 0, 1, 2, 3, 4, 5, 6
# a SIGTERM the agent did not announce (a preemption): checkpointed where it could, state `queued`
EXIT_PREEMPTED = 7


def clip(text: str, limit: int = 8000) -> str:
    """Messages travel in events capped at 8,192 characters (a spec error can name 100k modules):
    keep the head, say how much was cut."""
    return text if len(text) <= limit else f"{text[:limit - 60]} ... ({len(text) - limit + 60:,} more characters)"


def root_cause(e: BaseException) -> str:
    """An exception's root cause first: libraries wrap the words a person needs (datasets'
    DatasetGenerationError hides pyarrow's "JSON parse error ... in row 1200" in its __cause__).
    Follows the explicit chain (`raise ... from`) to its end; the wrappers follow in brackets."""
    chain = [e]
    while chain[-1].__cause__ is not None and len(chain) < 10:
        chain.append(chain[-1].__cause__)
    root = chain[-1]
    words = f"{str(root).strip() or type(root).__name__} ({type(root).__name__}"
    wrappers = [f"{type(x).__name__}: {str(x).strip()}" for x in reversed(chain[:-1])]
    return words + (f"; reported as {' <- '.join(wrappers)})" if wrappers else ")")


class Cancelled(Exception):
    """SIGTERM arrived during a data phase: stop without training."""


class DiskFull(Exception):
    """No space left (ENOSPC/EDQUOT) while writing `path` during `doing` (e.g. "saving a checkpoint
    at step 40"): named with the filesystem it fills, never retried (the same disk would fill again)."""

    def __init__(self, path, doing: str, cause: OSError):
        from .diskspace import describe_fs
        self.path, self.doing = path, doing
        self.message = f"no space left on {describe_fs(path)} while {doing}"
        super().__init__(self.message)


def is_disk_full(e: BaseException) -> bool:
    import errno
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
