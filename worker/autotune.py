"""batch_size="auto": time a few micro-batch shapes on the real data and keep the fastest that fits.

Only forward+backward is timed (the optimizer step costs the same whatever the shape, since the
effective batch is fixed); gradients are thrown away, so the model is unchanged.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Optional

import numpy as np
import torch

from .loop import forward_loss, to_device
from .packing import Layout, collate, epoch_batches
from .tokenization import Tokenized


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(e).lower()


def measure(model, data: Tokenized, layout: Layout, pad_id: int, precision: str, device: torch.device,
            seed: int, steps: int = 2) -> Optional[float]:
    """Real tokens/s of forward+backward for this layout (None: does not fit in memory)."""
    batches = epoch_batches(data, layout, seed, 0)[: steps + 1]
    if not batches:
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
        if not _is_oom(e):
            raise
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None


def candidates(base: Layout, step_tokens: int, device: torch.device, p90: int = 0) -> list[Layout]:
    """Shapes worth timing. Packed rows: several row lengths (attention cost grows with the row) x a
    few micro-batch sizes, never more tokens per micro-batch than one optimizer step holds."""
    sizes = [2048, 4096, 8192] if device.type == "cpu" else [8192, 16384, 32768, 65536]
    cap = max(step_tokens, base.max_len)
    out = []
    if base.mode == "pack":
        # Rows shorter than max_len are allowed (longer examples get rows of their own) as long as
        # at least 90% of examples fit them; longer rows only cost more attention per token.
        lens = sorted({base.max_len} | {r for r in (128, 256, 512, 1024, 2048)
                                         if p90 <= r <= 4 * base.max_len and r != base.max_len})
        for row_len in lens:
            rows_opts = sorted({max(1, min(t, cap) // row_len) for t in sizes})
            for rows in rows_opts:
                out.append(replace(base, row_len=row_len, rows=rows))
    else:
        for rows in (4, 8, 16, 32, 64):
            out.append(replace(base, rows=rows))
    # de-duplicate (small caps collapse several choices into one)
    seen, uniq = set(), []
    for l in out:
        k = (l.row_len, l.rows)
        if k not in seen:
            seen.add(k)
            uniq.append(l)
    return uniq


def autotune(model, data: Tokenized, base: Layout, step_tokens: int, pad_id: int, precision: str,
             device: torch.device, seed: int, progress: Callable[[int, int], None]) -> tuple[Layout, list[dict]]:
    """The fastest fitting layout and the table of what was measured."""
    p90 = int(np.percentile(np.minimum(data.lengths, base.max_len), 90)) if data.n else 0
    cands = candidates(base, step_tokens, device, p90)
    if base.mode != "pack":
        # dynamic padding: more rows than the effective batch holds in examples is pointless
        mean_len = max(1.0, float(data.lengths.clip(max=base.max_len).mean()))
        cands = [c for c in cands if c.rows <= max(4, step_tokens / mean_len)] or cands[:1]
    table, best, best_tps = [], None, 0.0
    for k, lay in enumerate(cands):
        progress(k, len(cands))
        tps = measure(model, data, lay, pad_id, precision, device, seed)
        table.append({"row_len": lay.row_len, "rows": lay.rows, "tokens_per_s": round(tps or 0, 1),
                      "fits": tps is not None})
        if tps is not None and tps > best_tps:
            best, best_tps = lay, tps
    progress(len(cands), len(cands))
    if best is None:
        raise torch.OutOfMemoryError("no micro-batch size fits in memory, even the smallest")
    return best, table
