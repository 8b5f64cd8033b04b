"""The sequence-length vs micro-batch trade-off, measured: for each candidate max_seq_length, the
largest micro-batch of full rows that fits in memory and its tokens/s (forward+backward).

Runs in the analyzer (`python -m worker.training.analyze --measure`) on the worker's own device, on
rows packed full of the dataset's real tokens (the most memory a row of that length can take).
Rows double from 1 until a micro-batch runs out of memory (CUDA's error or the CPU allocator's),
reaches the cap, or the time budget is spent, so the whole table costs at most about `budget_s`.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from .loop import forward_loss
from .memory import is_oom
from .packing import IGNORE
from .tokenization import Tokenized

CANDIDATE_LENGTHS = (256, 512, 1024, 2048, 4096)
CPU_TOKENS_CAP = 16384  # tokens per micro-batch on a CPU (as autotune): host RAM swaps before it fails
MAX_ROWS = 256


def full_rows(data: Tokenized, rows: int, length: int, seed: int) -> dict:
    """`rows` rows of `length` tokens cut from the data's token stream (repeated if it is short)."""
    need = rows * length + 1
    rng = np.random.default_rng(seed)
    reps = -(-need // max(1, len(data.tokens)))
    stream = np.tile(data.tokens, reps) if reps > 1 else data.tokens
    start = int(rng.integers(0, max(1, len(stream) - need + 1)))
    chunk = torch.from_numpy(stream[start:start + need].astype(np.int64))
    ids, tgt = chunk[:-1].view(rows, length), chunk[1:].view(rows, length).clone()
    tgt[:, -1] = IGNORE
    return {"input_ids": ids, "targets": tgt}


def time_step(model, make_batch, precision: str, device: torch.device, reps: int = 2) -> Optional[float]:
    """Seconds per forward+backward of the micro-batch make_batch() builds (the first call warms up),
    None if it does not fit (building it included)."""
    try:
        b = {k: v.to(device) for k, v in make_batch().items()}
        dt = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            forward_loss(model, b, precision, device).backward()
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt.append(time.perf_counter() - t0)
        return min(dt[1:])
    except Exception as e:
        if not is_oom(e):
            raise
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None


def fit_table(model, data: Tokenized, precision: str, device: torch.device, model_max: Optional[int],
              extra_lengths=(), seed: int = 0, budget_s: float = 60.0, progress=None) -> list[dict]:
    lengths = sorted({L for L in (*CANDIDATE_LENGTHS, *extra_lengths) if L and (not model_max or L <= model_max)})
    cap = CPU_TOKENS_CAP if device.type == "cpu" else None
    deadline = time.monotonic() + budget_s
    per_length = budget_s / max(1, len(lengths))
    model.train()
    table = []
    for k, L in enumerate(lengths):
        if progress:
            progress(k, len(lengths))
        until = min(deadline, time.monotonic() + per_length)
        rows, best, why = 1, None, "time"
        while True:
            if time.monotonic() >= until:
                why = "time"
                break
            if cap and rows * L > cap:
                why = "cap"
                break
            if rows > MAX_ROWS:
                why = "cap"
                break
            dt = time_step(model, lambda: full_rows(data, rows, L, seed), precision, device)
            if dt is None:
                why = "memory"
                break
            best = {"rows": rows, "tokens_per_s": round(rows * L / dt, 1), "step_s": round(dt, 4)}
            rows *= 2
        # fits: True (max_rows fit), False (not even one row), None (no time left to try)
        table.append({"seq_len": L, "max_rows": best["rows"] if best else 0,
                      "tokens_per_s": best["tokens_per_s"] if best else 0.0,
                      "fits": True if best else (False if why == "memory" else None), "limited_by": why})
    if progress:
        progress(len(lengths), len(lengths))
    return table
