"""Preflight analysis of token lengths: what max_seq_length to use and what each padding layout costs."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from .packing import pack_rows

SAMPLE_ABOVE = 20_000  # examples; above this the analysis tokenizes a random sample
ROWS_PER_STEP = 16  # rows per step used to compare layouts (JobSpec's default effective batch)


def round_up(x: float, multiple: int = 8) -> int:
    return int(math.ceil(max(x, 1) / multiple) * multiple)


# Covering the longest example instead of the coverage percentile is worth it when the few examples
# beyond the percentile cost little: at most this many more tokens over the whole data ...
COVER_ALL_EXTRA_TOKENS = 0.01
# ... and a longest row at most this much longer (memory and attention grow with the longest row).
COVER_ALL_MAX_RATIO = 1.25


def recommend_max_len(lengths: np.ndarray, coverage: float, model_max: Optional[int] = None,
                      pad_all: bool = False) -> int:
    """Smallest multiple of 8 covering `coverage`% of examples, or every example when that costs
    little (p99.9 = 1,427 but max = 1,481: 1,488 cuts nothing for ~1% more tokens, where 1,440 would
    cut 8 examples); never above the model's limit. pad_all: every row is padded to the length
    (padding=max_length), so covering more costs every row, and only the percentile is used."""
    lengths = np.asarray(lengths)
    if len(lengths) == 0:
        return 8
    want = round_up(np.percentile(lengths, coverage, method="higher"))
    full = round_up(lengths.max())
    if full > want and not pad_all and full <= COVER_ALL_MAX_RATIO * want:
        kept = float(np.minimum(lengths, want).sum())
        extra = float(np.minimum(lengths, full).sum()) - kept
        if extra <= COVER_ALL_EXTRA_TOKENS * kept:
            want = full
    return min(want, model_max) if model_max else want


def histogram(lengths: np.ndarray, bins: int = 20) -> list[dict]:
    if len(lengths) == 0:
        return []
    hi = int(lengths.max())
    edges = np.unique(np.linspace(0, hi + 1, bins + 1).astype(int))
    counts, _ = np.histogram(lengths, bins=edges)
    return [{"lo": int(a), "hi": int(b), "count": int(c)} for a, b, c in zip(edges[:-1], edges[1:], counts)]


def layout_costs(lengths: np.ndarray, max_len: int, rows: int = ROWS_PER_STEP, seed: int = 0,
                 step_tokens: Optional[float] = None, group_by_length: bool = False) -> dict:
    """Predicted cost of each layout at the SAME real (non-padding) tokens per optimizer step, as
    training runs them (the step is a token budget, not a row count): padding waste, the tokens
    computed per step padding included, computed tokens per real token, and compute relative to
    padding every row to max_length. A layout that packs more rows per step is not counted as a
    speed-up: only the padding it saves is. Dynamic padding is estimated on micro-batches of `rows`
    rows (sorted by length in mega-batches with group_by_length, as training does)."""
    lens = np.minimum(lengths, max_len)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lens))
    mean = float(lens.mean()) if len(lens) else 0.0
    step = float(step_tokens) if step_tokens else rows * mean
    waste = {"max_length": 1 - mean / max_len}
    if group_by_length:
        mega = 50 * rows
        order_d = np.concatenate([c[np.argsort(-lens[c], kind="stable")]
                                  for c in np.array_split(order, max(1, -(-len(order) // mega)))])
    else:
        order_d = order
    real = padded = 0
    for k in range(0, len(order_d), rows):
        b = lens[order_d[k:k + rows]]
        real += int(b.sum())
        padded += int(b.max()) * len(b)
    waste["dynamic"] = 1 - real / max(padded, 1)
    row_len = max(max_len, 256)
    packed = pack_rows(lens, order, row_len)
    # packed rows are padded to the fullest row of a micro-batch (a multiple of 8), not to row_len
    used = np.array([int(lens[r].sum()) for r in packed] or [0])[rng.permutation(max(1, len(packed)))]
    widths = [-(-int(used[k]) // 8) * 8 * len(used[k:k + rows]) for k in range(0, len(used), rows)]
    waste["pack"] = 1 - float(used.sum()) / max(1, sum(widths))
    out = {}
    for name, w in waste.items():
        w = min(max(w, 0.0), 1.0 - 1e-9)
        out[name] = {"padding_frac": w, "real_tokens_per_step": step, "padded_tokens_per_step": step / (1 - w),
                     "computed_per_real_token": 1 / (1 - w),
                     "compute_vs_max_length": (1 - waste["max_length"]) / (1 - w)}
    out["pack"]["row_len"] = row_len
    return out


def analyze_lengths(lengths: np.ndarray, coverage: float, model_max: Optional[int] = None,
                    max_seq_length: Optional[int] = None, n_total: Optional[int] = None,
                    tokens_per_batch: Optional[int] = None, group_by_length: bool = False,
                    pad_all: bool = False) -> dict:
    lengths = np.asarray(lengths)
    rec = recommend_max_len(lengths, coverage, model_max, pad_all)
    use = max_seq_length or rec
    trunc = int((lengths > use).sum())
    pct = {f"p{p:g}": float(np.percentile(lengths, p)) if len(lengths) else 0.0 for p in (50, 90, 99, 99.9)}
    n = len(lengths)
    mean_used = float(np.minimum(lengths, use).mean()) if n else 0.0
    step = tokens_per_batch or int(round(ROWS_PER_STEP * mean_used))  # what training uses (session.py)
    return {
        "examples": n_total if n_total is not None else n,
        "sampled": n_total is not None and n_total > n, "sample_size": n,
        "tokens": int(lengths.sum()), "mean": float(lengths.mean()) if n else 0.0,
        "percentiles": {**pct, "max": int(lengths.max()) if n else 0},
        "histogram": histogram(lengths),
        "length_coverage": coverage, "recommended_max_seq_length": rec, "max_seq_length": use,
        "model_max_length": model_max,
        "truncated": trunc, "truncated_frac": trunc / n if n else 0.0,
        "rows_per_step": ROWS_PER_STEP,
        "real_tokens_per_step": step,
        "real_tokens_per_step_from": ("tokens_per_batch" if tokens_per_batch else
                                      f"{ROWS_PER_STEP} examples of mean length"),
        "layouts": layout_costs(lengths, use, step_tokens=step, group_by_length=group_by_length) if n else {},
    }
