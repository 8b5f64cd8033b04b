"""The on-disk layout of a checkpoint directory, torch-free: the training process writes it, the agent
reads it (to pick where an attempt resumes, and to prune stale ones) without importing torch.

    <out>/checkpoints/step-0000120/          complete: renamed into place only once fully written
                      ├── model/             save_pretrained (weights, config, tokenizer)
                      ├── trainer_state.pt   optimizer, scheduler, RNG, data position, step
                      └── meta.json          {"step": 120, "complete": true}
    <out>/checkpoints/.tmp-step-0000130-PID/ being written; nobody reads it
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

CHECKPOINTS_DIR = "checkpoints"
MODEL_DIR = "model"
STATE_FILE = "trainer_state.pt"
META_FILE = "meta.json"
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"


def checkpoints_root(out_dir: Path) -> Path:
    return out_dir / CHECKPOINTS_DIR


def step_dir(out_dir: Path, step: int) -> Path:
    return checkpoints_root(out_dir) / f"{STEP_PREFIX}{step:07d}"


def tmp_dir(out_dir: Path, step: int, pid: int) -> Path:
    return checkpoints_root(out_dir) / f"{TMP_PREFIX}{STEP_PREFIX}{step:07d}-{pid}"


def is_step_dir(path: Path) -> bool:
    return path.name.startswith(STEP_PREFIX)


def is_tmp_dir(path: Path) -> bool:
    return path.name.startswith(TMP_PREFIX)


def step_from_name(path: Path) -> Optional[int]:
    """The step a `step-NNNNNNN` name promises (whether or not the directory is complete)."""
    name = path.name.removeprefix(STEP_PREFIX)
    return int(name) if is_step_dir(path) and name.isdigit() else None


def write_meta(ckpt: Path, step: int) -> None:
    (ckpt / META_FILE).write_text(json.dumps({"step": step, "complete": True}))


def checkpoint_step(path: Path) -> Optional[int]:
    """The step of a complete checkpoint directory (written whole, then renamed), else None."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not meta.get("complete") or not (path / STATE_FILE).is_file() or not (path / MODEL_DIR).is_dir():
        return None
    return int(meta.get("step", -1))


def list_checkpoints(out_dir: Path) -> list[Path]:
    """Every `step-*` directory holding a state file, oldest first."""
    root = checkpoints_root(out_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if is_step_dir(p) and (p / STATE_FILE).exists())
