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


def recommend_max_len(lengths: np.ndarray, coverage: float, model_max: Optional[int] = None) -> int:
    """Smallest multiple of 8 covering `coverage`% of examples (never above the model's limit)."""
    if len(lengths) == 0:
        return 8
    want = round_up(np.percentile(lengths, coverage, method="higher"))
    return min(want, model_max) if model_max else want


def histogram(lengths: np.ndarray, bins: int = 20) -> list[dict]:
    if len(lengths) == 0:
        return []
    hi = int(lengths.max())
    edges = np.unique(np.linspace(0, hi + 1, bins + 1).astype(int))
    counts, _ = np.histogram(lengths, bins=edges)
    return [{"lo": int(a), "hi": int(b), "count": int(c)} for a, b, c in zip(edges[:-1], edges[1:], counts)]


def layout_costs(lengths: np.ndarray, max_len: int, rows: int = ROWS_PER_STEP, seed: int = 0) -> dict:
    """Predicted padding fraction and real tokens per step of `rows` rows, for each layout."""
    lens = np.minimum(lengths, max_len)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lens))
    mean = float(lens.mean()) if len(lens) else 0.0
    out = {"max_length": {"padding_frac": 1 - mean / max_len, "real_tokens_per_step": rows * mean,
                          "padded_tokens_per_step": rows * max_len}}
    real = padded = 0
    for k in range(0, len(order), rows):
        b = lens[order[k:k + rows]]
        real += int(b.sum())
        padded += int(b.max()) * len(b)
    nb = max(1, -(-len(order) // rows))
    out["dynamic"] = {"padding_frac": 1 - real / max(padded, 1), "real_tokens_per_step": real / nb,
                      "padded_tokens_per_step": padded / nb}
    row_len = max(max_len, 256)
    packed = pack_rows(lens, order, row_len)
    fill = float(lens.sum()) / max(1, len(packed) * row_len)
    out["pack"] = {"padding_frac": 1 - fill, "real_tokens_per_step": rows * row_len * fill,
                   "padded_tokens_per_step": rows * row_len, "row_len": row_len}
    return out


def analyze_lengths(lengths: np.ndarray, coverage: float, model_max: Optional[int] = None,
                    max_seq_length: Optional[int] = None, n_total: Optional[int] = None) -> dict:
    lengths = np.asarray(lengths)
    rec = recommend_max_len(lengths, coverage, model_max)
    use = max_seq_length or rec
    trunc = int((lengths > use).sum())
    pct = {f"p{p:g}": float(np.percentile(lengths, p)) if len(lengths) else 0.0 for p in (50, 90, 99, 99.9)}
    n = len(lengths)
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
        "layouts": layout_costs(lengths, use) if n else {},
    }
