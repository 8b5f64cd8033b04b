"""Before a job's process starts: where it resumes from, what checkpoints of ours go, and a command
job's environment and working directory. Plain functions of their inputs, no agent state."""
from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path
from typing import Mapping, Optional

from tokenpulse.instrument.sources import OFF_ENV as CAPTURE_OFF_ENV, off_env_value
from tokenpulse.protocol import CommandSpec
from worker.checkpoint_layout import checkpoint_step, checkpoints_root, is_step_dir, is_tmp_dir, step_from_name


def pick_resume(recorded: Optional[str], roots: Optional[list[Path]] = None) -> tuple[Optional[Path], str]:
    """Where an attempt starts: the checkpoint the server recorded when it is complete here; else the
    newest complete one beside it that is not newer (a newer one's metrics may never have reached
    the server: resuming past them would leave a gap); else step 0. Never a half-written one, and
    never one outside `roots` (the directories this agent trusts to load checkpoints from)."""
    if not recorded:
        return None, "starting from step 0"
    path = Path(recorded)
    if roots is not None:
        real = path.resolve()
        if not any(real == r or r in real.parents for r in roots):
            return None, (f"checkpoint {recorded} is outside this agent's resume roots "
                          f"({', '.join(map(str, roots))}; add one with --resume-root): starting from step 0")
    step = checkpoint_step(path)
    if step is not None:
        return path, f"resuming from {path} (step {step})"
    limit = step_from_name(path)
    limit = -1 if limit is None else limit
    older = []
    if path.parent.is_dir():
        for p in path.parent.iterdir():
            st = checkpoint_step(p) if is_step_dir(p) else None
            if st is not None and st <= limit:
                older.append((st, p))
    if older:
        st, p = max(older)
        return p, f"checkpoint {recorded} is missing or incomplete here; resuming from {p} (step {st})"
    return None, f"checkpoint {recorded} is missing or incomplete here and none older is: starting from step 0"


def prune_own_checkpoints(out_dir: Path, resume: Optional[Path]) -> None:
    """Before an attempt, drop this job's checkpoints in our own output directory that are newer than
    where it resumes (all of them, from step 0) and half-written temp dirs: left there, a stale newer
    one would outrank the new run's checkpoints when only the newest K are kept."""
    root = checkpoints_root(out_dir)
    if not root.is_dir():
        return
    start = checkpoint_step(resume) if resume is not None else -1
    for p in root.iterdir():
        if resume is not None and p.resolve() == resume.resolve():
            continue
        if is_tmp_dir(p):
            shutil.rmtree(p, ignore_errors=True)
        elif is_step_dir(p) and start is not None:  # None: the resume point went incomplete; newer unknown
            st = checkpoint_step(p)
            if st is None or st > start:
                shutil.rmtree(p, ignore_errors=True)


# Inherited by a command job only when it names them in secret_env: tokenpulse's own variables (the
# agent's token among them) and anything whose name says it is a credential.
CREDENTIAL_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_?KEY|ACCESS_KEY|PRIVATE_KEY|AUTH",
                             re.IGNORECASE)


def instrumentation_dir() -> Optional[str]:
    """The startup-hook directory that makes a command job's Python processes report (Trainer
    callback, tqdm/datasets progress, alive thread): put first on the job's PYTHONPATH."""
    from tokenpulse.instrument import hook_dir  # stdlib only: the agent stays torch-free (tested)
    return hook_dir()


def command_env(base: Mapping[str, str], spec: CommandSpec, job_id: int, resume: Optional[str],
                hooks: Optional[str]) -> dict[str, str]:
    """A command job's environment: the agent's own, less credentials and tokenpulse's variables;
    then the job's plain settings (env), the secrets it names (secret_env, from `base`), and what
    the agent tells it (job id, event pipe, checkpoint to resume from, the instrumentation hook)."""
    env = {k: v for k, v in base.items() if not k.startswith("TOKENPULSE_") and not CREDENTIAL_NAME.search(k)}
    env.setdefault("PYTHONUNBUFFERED", "1")  # output as it happens, not in 8 KiB bursts
    env.setdefault("PYTHONFAULTHANDLER", "1")
    # `python`, `torchrun`, `accelerate`, `trl` as installed beside the agent (the environment its
    # instrumentation imports from): a venv's bin is often not on the PATH of whoever started it.
    # A job that sets PATH in its env decides for itself.
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bindir, *(p for p in env.get("PATH", "").split(os.pathsep) if p and p != bindir)])
    env.update(spec.env)
    env.update({name: base[name] for name in spec.secret_env if name in base})
    env["TOKENPULSE_JOB_ID"] = str(job_id)
    if resume:
        env["TOKENPULSE_RESUME_FROM"] = resume
    if hooks:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (hooks, env.get("PYTHONPATH")) if p)
    off = off_env_value(spec.capture)
    if off:
        env[CAPTURE_OFF_ENV] = off  # the sources this job does not read (tokenpulse/instrument/sources.py)
    return env


def confined_cwd(raw: str, roots: list[str]) -> tuple[Path, Optional[str]]:
    """A command's working directory resolved now (symlinks followed) and, when the server has path
    roots, checked against them: (the resolved directory the command runs in, why it may not run
    or None). The submit checked it too, but a directory swapped for a symlink since then would
    otherwise take the command anywhere."""
    try:
        real = Path(os.path.realpath(raw))
    except (OSError, ValueError) as e:
        return Path(raw), f"working directory {raw} cannot be resolved: {e}; nothing was run"
    if roots:
        allowed = [Path(os.path.realpath(r)) for r in roots]
        if not any(real == r or r in real.parents for r in allowed):
            return real, (f"working directory {raw} resolves to {real}, outside the server's path roots "
                          f"({', '.join(map(str, allowed))}): refused, nothing was run")
    return real, None


def command_resume(recorded: Optional[str], roots: list[Path], cwd: Path) -> tuple[Optional[str], str]:
    """The checkpoint a command job continues from (TOKENPULSE_RESUME_FROM): the one the server
    recorded, when it exists here and lies under the agent's resume roots or the job's own working
    directory (a Trainer's output_dir): never a path a report could point anywhere."""
    if not recorded:
        return None, "starting from the beginning"
    real = Path(recorded).resolve()
    allowed = [*roots, cwd.resolve()]
    if not any(real == r or r in real.parents for r in allowed):
        return None, (f"checkpoint {recorded} is outside this agent's resume roots and the job's working "
                      f"directory: starting from the beginning")
    if not real.exists():
        return None, f"checkpoint {recorded} does not exist here: starting from the beginning"
    return str(real), f"resuming from {real} (TOKENPULSE_RESUME_FROM)"
