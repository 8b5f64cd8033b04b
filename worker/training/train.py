"""The training process:
`python -m worker.training.train --spec SPEC.json --out OUTDIR [--resume CKPT] [--cache-dir DIR]`
(or `main` called in a standby forked from the agent's zygote: zygote.py, standby.py).

Exit codes: 0 completed / cancelled / paused, 1 crash, 2 bad spec or input, 3 injected crash,
4 non-finite loss, 5 out of memory, 6 disk full, 7 preempted (a SIGTERM its agent did not announce:
checkpointed, state `queued`). The last event is always a `state` (except for exit 3 and kills).
"""
from __future__ import annotations

from .runtime import configure as _configure_runtime

_configure_runtime()  # before anything imports torch

import argparse
import os
import sys
import traceback
from pathlib import Path

from tokenpulse.errors import SpecError
from tokenpulse.protocol import AlertKind, Failure, JobSpec

from .emit import Emitter
from .errors import (
    EXIT_CRASH,
    EXIT_DISK_FULL,
    EXIT_OK,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_SPEC,
    Cancelled,
    DiskFull,
    clip,
    is_disk_full,
)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m worker.training.train", description=__doc__)
    ap.add_argument("--spec", required=True, type=Path, help="JobSpec as JSON")
    ap.add_argument("--out", required=True, type=Path, help="output directory (checkpoints/, final/)")
    ap.add_argument("--resume", type=Path, help="checkpoint directory to continue from")
    ap.add_argument("--cache-dir", type=Path, help="tokenization cache (shared between jobs)")
    return ap.parse_args(argv)


def read_spec(path: Path) -> JobSpec:
    try:
        return JobSpec.model_validate_json(path.read_text())
    except FileNotFoundError:
        raise SpecError("spec", f"spec file not found: {path}") from None
    except Exception as e:
        raise SpecError("spec", f"invalid spec: {e}") from e


def disk_full(em: Emitter, e: DiskFull, out: Path) -> int:
    """Named, alerted, and final (never retried: the same disk would fill again); what is stored
    stays: the newest complete checkpoint is named so the run can go on from it once space is freed."""
    from worker.checkpoint_layout import checkpoint_step, list_checkpoints
    kept = [p for p in list_checkpoints(out) if checkpoint_step(p) is not None]
    keep = (f"; the newest complete checkpoint is kept: {kept[-1]} (step {checkpoint_step(kept[-1])})" if kept
            else "; no complete checkpoint yet")
    reason = f"{e.message}{keep}"
    em.log(reason)
    em.alert(AlertKind.DISK_FULL, reason[:2000], severity="critical")
    em.emit("state", state="failed", reason=reason[:8000], failure=Failure.DISK_FULL, exit_code=EXIT_DISK_FULL)
    return EXIT_DISK_FULL


def peak_memory_mb() -> float:
    """The peak memory this process reached (MiB): the GPU's allocator peak on CUDA, else peak RSS."""
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.max_memory_allocated() > 0:
            return round(torch.cuda.max_memory_allocated() / 2 ** 20, 1)
    except Exception:  # noqa: BLE001 -- a best-effort figure for the failure's reason
        pass
    import resource
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB on Linux


def overdue(em: Emitter, out: Path):
    """The requested checkpoint's bound passed without a step boundary (controls.py): say so, fall
    back to the newest checkpoint already saved, end the process."""
    def on_overdue(sig: str, waited: float) -> None:
        from worker.checkpoint_layout import checkpoint_step, list_checkpoints
        kept = [p for p in list_checkpoints(out) if checkpoint_step(p) is not None]
        back = (f"resumes from the newest saved checkpoint {kept[-1]} (step {checkpoint_step(kept[-1])})" if kept
                else "no checkpoint saved yet: it starts again from step 0")
        at = f" (stuck at step {em.step_done})" if getattr(em, "step_done", None) is not None else ""
        what = "preempted (SIGTERM not sent by its agent)" if sig == "SIGTERM" else f"checkpoint asked for ({sig})"
        reason = (f"{what}, but no step boundary was reached within {waited:.0f} s{at}: no new checkpoint; "
                  f"{back}")
        em.log(reason)
        if sig == "SIGTERM":
            em.emit("state", state="queued", failure=Failure.PREEMPTED, reason=reason, exit_code=EXIT_PREEMPTED)
        else:
            em.emit("state", state="paused", reason=reason)
        sys.stdout.flush()
        os._exit(EXIT_PREEMPTED if sig == "SIGTERM" else EXIT_OK)
    return on_overdue


def main(argv=None) -> int:
    args = parse_args(argv)
    from .hub import use_shared_cache
    use_shared_cache(args.cache_dir)  # one HF cache for all of the agent's jobs (before huggingface_hub loads)
    em = Emitter(narrate=True)  # stdout: a readable account, relayed by the agent as the job's log
    from .controls import Controls
    controls = Controls().install()
    controls.on_overdue = overdue(em, args.out)
    try:
        from .session import Session
        spec = read_spec(args.spec)
        session = Session(spec, args.out, em, controls, cache_dir=args.cache_dir, resume=args.resume)
        if spec.test_run and session.resume is None:
            from .quicktest import run_test  # the whole job on a few steps first, in Sessions of its own
            run_test(spec, session.out, em, controls, session.cache_dir)  # raises SpecError naming the check
        return session.run()
    except SpecError as e:
        em.log(clip(f"spec error ({e.field}): {e.message}"))
        em.emit("state", state="failed", reason=clip(e.message), failure=Failure.SPEC, exit_code=EXIT_SPEC)
        return EXIT_SPEC
    except DiskFull as e:
        return disk_full(em, e, args.out)
    except Cancelled:
        controls.boundary.set()
        if controls.preempt and not controls.cancel:
            em.emit("state", state="queued", failure=Failure.PREEMPTED, exit_code=EXIT_PREEMPTED,
                    reason="preempted (SIGTERM not sent by its agent) before training: nothing to save; requeued")
            return EXIT_PREEMPTED
        em.emit("state", state="cancelled", reason="cancelled (SIGTERM) before training")
        return EXIT_OK
    except BaseException as e:  # noqa: BLE001 -- the last word must be a state event
        from .memory import is_oom
        if is_oom(e):  # CUDA's OutOfMemoryError, MemoryError, or the CPU allocator's RuntimeError
            em.alert(AlertKind.OOM, clip(f"out of memory: {e}", 500), severity="critical")
            em.emit("state", state="failed", reason=clip(f"out of memory: {e}", 2000), failure=Failure.OOM,
                    exit_code=EXIT_OOM, peak_mb=peak_memory_mb())
            return EXIT_OOM
        if is_disk_full(e):  # a write elsewhere (tokenization cache, logs) found the disk full
            return disk_full(em, DiskFull(getattr(e, "filename", None) or args.out, "training", e), args.out)
        if isinstance(e, KeyboardInterrupt):
            em.emit("state", state="cancelled", reason="interrupted")
            return EXIT_OK
        tb = traceback.format_exc()
        sys.stderr.write(tb)
        em.log(tb[-8000:])
        em.emit("state", state="failed", reason=clip(f"{type(e).__name__}: {e}"), failure=Failure.CRASH,
                exit_code=EXIT_CRASH)
        return EXIT_CRASH
    finally:
        em.close()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: skip slow interpreter teardown of torch/datasets (seconds on small jobs).
    os._exit(code)
