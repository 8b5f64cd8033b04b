"""Full checkpoints (model, optimizer, scheduler, RNG, data position), written atomically.

A checkpoint is written into a hidden temp dir and renamed into place, so a directory named
step-NNNNNNN is always complete; a crash mid-write leaves only a temp dir nobody reads.
"""
from __future__ import annotations

import errno
import os
import random
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from worker.checkpoint_layout import (
    MODEL_DIR,
    STATE_FILE,
    checkpoint_step,
    list_checkpoints,
    step_dir,
    tmp_dir,
    write_meta,
)
from worker.training.diskspace import looks_like_disk_full
from worker.training.errors import DiskFull

__all__ = ["save", "save_final", "load_state", "list_checkpoints", "rng_state", "set_rng_state"]


def rng_state() -> dict:
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save(out_dir: Path, step: int, model, tokenizer, optimizer, scheduler, state: dict,
         keep: Optional[int] = None, scaler=None) -> Path:
    """Write checkpoints/step-{step}; keep only the newest `keep` (None keeps all)."""
    final, tmp = step_dir(out_dir, step), tmp_dir(out_dir, step, os.getpid())
    final.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp / MODEL_DIR)
        tokenizer.save_pretrained(tmp / MODEL_DIR)
        torch.save({"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "scaler": scaler.state_dict() if scaler is not None else None,
                    "rng": rng_state(), **state}, tmp / STATE_FILE)
        write_meta(tmp, step)
    except Exception as e:
        full = looks_like_disk_full(e, final.parent)  # judged before the cleanup frees space again
        shutil.rmtree(tmp, ignore_errors=True)  # half a checkpoint is useless; its space is not (a full disk)
        if full and not (isinstance(e, OSError) and e.errno == errno.ENOSPC):
            raise OSError(errno.ENOSPC, f"No space left on device ({type(e).__name__}: {str(e)[:300]})",
                          str(tmp)) from e
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # same step saved twice (pause right after a periodic save): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    if keep is not None:
        for old in list_checkpoints(out_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def save_final(out_dir: Path, model, tokenizer, merge_lora: bool = True) -> Path:
    """The trained model in out/final, written beside it first and renamed into place. A LoRA model
    (merge_lora): final/ is the merged model (loads with from_pretrained alone), the adapter beside it."""
    final = out_dir / "final"
    tmp = out_dir / ".tmp-final"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if hasattr(model, "merge_and_unload") and merge_lora:
            model.save_pretrained(tmp / "adapter")
            model.merge_and_unload().save_pretrained(tmp)
        else:
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    except Exception as e:
        full = looks_like_disk_full(e, out_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise DiskFull(out_dir, "saving the final model", e) from e
        raise
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def load_state(ckpt: Path) -> dict:
    if checkpoint_step(ckpt) is None:
        raise FileNotFoundError(f"{ckpt} is not a complete tokenpulse checkpoint")
    # weights_only=False: numpy RNG state is a tuple with an ndarray; the file is our own.
    return torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
