"""batch_size="auto": time a few micro-batch shapes on the real data and keep the fastest that fits.

Only forward+backward is timed (the optimizer step costs the same whatever the shape, since the
effective batch is fixed); gradients are thrown away, so the model is unchanged.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable, Optional

import numpy as np
import torch

from .loop import forward_loss, to_device
from .memory import is_oom
from .packing import Layout, collate, epoch_batches, epoch_steps
from .tokenization import Tokenized


def _sample_micro_batches(data: Tokenized, layout: Layout, seed: int, n: int) -> list:
    if layout.mode == "pack" and layout.step_tokens:
        return [m for step in epoch_steps(data, layout, seed, 0)[:n] for m in step][:n]
    return epoch_batches(data, layout, seed, 0)[:n]


def measure(model, data: Tokenized, layout: Layout, pad_id: int, precision: str, device: torch.device,
            seed: int, steps: int = 2) -> Optional[float]:
    """Real tokens/s of forward+backward for this layout (None: does not fit in memory)."""
    batches = _sample_micro_batches(data, layout, seed, steps + 1)
    if len(batches) < 2:
        return None
    model.train()
    try:
        real, t0 = 0, None
        for k, rows in enumerate(batches):
            b = to_device(collate(data, rows, layout, pad_id), device)
            loss = forward_loss(model, b, precision, device) / max(1, b["n_targets"])
            loss.backward()
            model.zero_grad(set_to_none=True)
            if k == 0:  # first call of a shape pays for kernel selection and allocation
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            else:
                real += b["n_real"]
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        return real / dt if dt > 0 and real else None
    except Exception as e:
        if not is_oom(e):  # CUDA's OutOfMemoryError, or the CPU allocator's: does not fit
            raise
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None


def candidates(base: Layout, step_tokens: int, p90: int, max_micro_tokens: Optional[int] = None) -> list[Layout]:
    """Shapes worth timing.

    Packed rows: a few row lengths, since attention costs grow with the row (rows shorter than max_len
    are fine: the few longer examples get rows of their own), as long as 90% of examples fit a row.
    Each holds a whole optimizer step in one micro-batch when memory allows (halved on OOM).
    Dynamic padding: a few rows-per-micro-batch counts up to the examples one step holds.
    """
    if base.mode == "pack":
        lens = sorted({base.max_len} | {r for r in (128, 256, 512, 1024, 2048)
                                         if p90 <= r <= 4 * base.max_len and r != base.max_len})
        # packing a step's examples into rows wastes a little: leave room for it
        cap = max_micro_tokens or 1 << 62
        return [replace(base, row_len=r, rows=max(1, min(math.ceil(1.2 * step_tokens / r) + 1, cap // r)))
                for r in lens]
    return [replace(base, rows=r) for r in (4, 8, 16, 32, 64)]


def autotune(model, data: Tokenized, base: Layout, step_tokens: int, pad_id: int, precision: str,
             device: torch.device, seed: int, progress: Callable[[int, int], None]) -> tuple[Layout, list[dict]]:
    """The fastest fitting layout and the table of what was measured."""
    lengths = np.minimum(data.lengths, base.max_len)
    p90 = int(np.percentile(lengths, 90)) if data.n else 0
    # CPU: bounded micro-batches (the host may swap long before its allocator fails); GPU: try, halve on OOM
    cands = candidates(base, step_tokens, p90, 16384 if device.type == "cpu" else None)
    if base.mode != "pack":
        # more rows than one step's examples is pointless
        mean_len = max(1.0, float(lengths.mean())) if data.n else 1.0
        cands = [c for c in cands if c.rows <= max(4, step_tokens / mean_len)] or cands[:1]
    table, best, best_tps = [], None, 0.0
    for k, lay in enumerate(cands):
        progress(k, len(cands))
        tps = measure(model, data, lay, pad_id, precision, device, seed)
        while tps is None and lay.rows > 1:  # did not fit: try half the rows per micro-batch
            table.append({"row_len": lay.row_len, "rows": lay.rows, "tokens_per_s": 0.0, "fits": False})
            lay = replace(lay, rows=lay.rows // 2)
            tps = measure(model, data, lay, pad_id, precision, device, seed)
        table.append({"row_len": lay.row_len, "rows": lay.rows, "tokens_per_s": round(tps or 0, 1),
                      "fits": tps is not None})
        if tps is not None and tps > best_tps:
            best, best_tps = lay, tps
    progress(len(cands), len(cands))
    if best is None:
        raise torch.OutOfMemoryError("no micro-batch size fits in memory, even the smallest")
    return best, table
