"""Full checkpoints (model, optimizer, scheduler, RNG, data position), written atomically.

A checkpoint is written into a hidden temp dir and renamed into place, so a directory named
step-NNNNNNN is always complete; a crash mid-write leaves only a temp dir nobody reads.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch

STATE_FILE = "trainer_state.pt"


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
    root = out_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:07d}"
    tmp = root / f".tmp-step-{step:07d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "rng": rng_state(), **state}, tmp / STATE_FILE)
    (tmp / "meta.json").write_text(json.dumps({"step": step, "complete": True}))
    if final.exists():  # same step saved twice (pause right after a periodic save): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    if keep is not None:
        for old in list_checkpoints(out_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(out_dir: Path) -> list[Path]:
    root = out_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith("step-") and (p / STATE_FILE).exists())


def load_state(ckpt: Path) -> dict:
    if not (ckpt / STATE_FILE).exists() or not (ckpt / "meta.json").exists():
        raise FileNotFoundError(f"{ckpt} is not a complete tokenpulse checkpoint")
    # weights_only=False: numpy RNG state is a tuple with an ndarray; the file is our own.
    return torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
