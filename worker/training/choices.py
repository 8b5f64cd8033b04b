"""The run's automatic choices, each emitted with its reason: max_seq_length from the data's lengths,
the padding mode (packing where the model can), the micro-batch layout and accumulation (measured
when batch_size is auto), the precision. The seam: the session (session.py) runs the steps in order;
this decides the shape they run with. Rank 0 chooses; the session broadcasts its choice."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

import numpy as np

from tokenpulse.protocol import LAYOUT_FRESH, AlertKind, FixKind, JobSpec, Phase

from .analysis import recommend_max_len
from .autotune import autotune
from .memory import apply_test_headroom
from .modeling import supports_packing
from .packing import Layout, epoch_batches, epoch_steps
from .precision import NO_FAST_BF16, pick_precision
from .tokenization import Tokenized

DEFAULT_ROWS_PER_STEP = 16  # JobSpec: tokens_per_batch defaults to 16 examples' worth of real tokens
TRUNCATION_ALERT_FRAC = 0.01  # more examples cut than this is an alert, not just an info line


class Choices:
    def __init__(self, spec: JobSpec, em, model, tokenizer, device, cfg, state_in: Optional[dict],
                 cache_dir: Optional[Path] = None):
        self.spec, self.em, self.model, self.tokenizer, self.device = spec, em, model, tokenizer, device
        self.cfg, self.state_in = cfg, state_in  # the model's config; the checkpoint resumed from
        self.cache_dir = cache_dir  # where measured choices are kept for the next attempt (kept.py)

    def model_max(self) -> Optional[int]:
        for k in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            v = getattr(self.cfg, k, None)
            if isinstance(v, int) and v > 0:
                return v
        return None

    def max_len(self, lengths: np.ndarray) -> int:
        spec, em = self.spec, self.em
        model_max = self.model_max()
        rec = recommend_max_len(lengths, spec.length_coverage, model_max, pad_all=spec.padding == "max_length")
        if spec.max_seq_length != "auto":
            L = min(spec.max_seq_length, model_max) if model_max else spec.max_seq_length
            tr = int((lengths > L).sum())
            em.info(max_seq_length=L, reason="asked for" + (f" (clamped to the model's {model_max})"
                    if L != spec.max_seq_length else ""), truncated=tr, truncated_frac=tr / max(1, len(lengths)),
                    recommended_max_seq_length=rec)
        else:
            L = rec
            tr = int((lengths > L).sum())
            pct = float(np.percentile(lengths, spec.length_coverage)) if len(lengths) else 0
            longest = int(lengths.max()) if len(lengths) else 0
            cov = f"{spec.length_coverage:g}"
            if tr == 0 and longest > pct:
                reason = (f"covers every example: the longest has {longest} tokens and the few beyond "
                          f"p{cov} = {pct:.0f} cost little; rounded up to a multiple of 8")
            else:
                reason = (f"covers {cov}% of examples (p{cov} = {pct:.0f} tokens, rounded up to a multiple "
                          f"of 8); truncates {tr} of {len(lengths)}")
            em.info(max_seq_length=L, recommended_max_seq_length=L, truncated=tr,
                    truncated_frac=tr / max(1, len(lengths)), reason=reason)
        frac = tr / max(1, len(lengths))
        if frac > TRUNCATION_ALERT_FRAC:  # cutting many examples silently changes what the model learns
            fix = (f"max_seq_length={rec} keeps {spec.length_coverage:g}% of all {len(lengths):,} examples whole"
                   if rec > L else
                   f"the model takes at most {model_max} tokens: split or shorten the longest examples")
            em.alert("truncation", f"{tr:,} of {len(lengths):,} examples ({frac:.1%}) are longer than "
                     f"max_seq_length={L} and are cut; {fix}", severity="warning")
        return L

    def mode(self) -> str:
        spec, em = self.spec, self.em
        if spec.padding in ("dynamic", "max_length"):
            em.info(padding=spec.padding, reason="asked for")
            return spec.padding
        ok, why = supports_packing(self.model, self.device)
        if ok:
            em.info(padding="pack", reason=f"padding-free packing: {why}")
            return "pack"
        if spec.padding == "pack":
            em.alert(AlertKind.PADDING, f"packing was asked for but is unsafe for this model ({why}); "
                     "using dynamic padding", severity="warning")
        em.info(padding="dynamic", group_by_length=spec.group_by_length,
                reason=f"model cannot pack ({why}): dynamic padding (pad to the longest in each batch)")
        return "dynamic"

    def layout(self, data: Tokenized, mode: str, max_len: int, precision: str) -> tuple[Layout, int]:
        """Micro-batch shape and grad_accum; measured when batch_size is auto."""
        spec, em = self.spec, self.em
        apply_test_headroom()  # test-only (env): real allocator failures for batches that do not fit
        lengths = np.minimum(data.lengths, max_len)
        mean = float(lengths.mean()) if len(lengths) else 1.0
        step_tokens = spec.tokens_per_batch or int(round(DEFAULT_ROWS_PER_STEP * mean))
        token_steps = mode == "pack" and spec.grad_accum == "auto"
        base = Layout(mode=mode, max_len=max_len, row_len=max_len, rows=1, group_by_length=spec.group_by_length,
                      step_tokens=step_tokens if token_steps else 0,
                      pad_multiple=8 if self.device.type == "cuda" else 1)
        why_tokens = ("asked for" if spec.tokens_per_batch else
                      f"{DEFAULT_ROWS_PER_STEP} examples of mean length {mean:.0f}")
        if spec.batch_size == "auto":
            def progress(k, n):
                em.phase(Phase.TUNING, done=k, total=n, unit="shapes")
            lay, table = autotune(self.model, data, base, step_tokens, self.tokenizer.pad_token_id,
                                  precision, self.device, spec.seed, progress)
            best = max(t["tokens_per_s"] for t in table)
            reason = (f"fastest of {len(table)} measured shapes ({best:,.0f} real tokens/s forward+backward)")
            em.info(batch_size=lay.rows, row_len=lay.row_len, reason=reason, measured=table)
        else:
            lay = replace(base, rows=spec.batch_size)
            em.info(batch_size=lay.rows, row_len=lay.row_len, reason="asked for")
        if token_steps:
            steps = epoch_steps(data, lay, spec.seed, 0)
            per_step = sum(len(st) for st in steps) / max(1, len(steps))
            lay.grad_accum = max(1, int(round(per_step)))
            em.info(grad_accum=lay.grad_accum, tokens_per_batch=step_tokens,
                    reason=f"each optimizer step takes the next ~{step_tokens:,} real tokens of examples "
                           f"({why_tokens}), packed into rows: {per_step:.2f} micro-batches per step on average")
        elif spec.grad_accum == "auto":
            mb = epoch_batches(data, lay, spec.seed, 0)
            fill = sum(int(lengths[i]) for b in mb for row in b for i in row) / max(1, len(mb))
            lay.grad_accum = max(1, int(round(step_tokens / max(fill, 1.0))))
            em.info(grad_accum=lay.grad_accum, tokens_per_batch=step_tokens,
                    reason=f"holds the effective batch at ~{step_tokens:,} real tokens per optimizer step "
                           f"({why_tokens}); {fill:,.0f} real tokens per micro-batch")
        else:
            lay.grad_accum = spec.grad_accum
            em.info(grad_accum=lay.grad_accum, reason="asked for")
        if mode == "max_length":
            waste = 1 - mean / max_len
            # the same length the job's info recommends (max_len): one recommended length everywhere
            rec = recommend_max_len(data.lengths, spec.length_coverage, self.model_max(), pad_all=True)
            em.emit("alert", kind=AlertKind.PADDING, severity="warning",
                    message=f"padding every example to max_length={max_len} wastes {waste:.0%} of compute "
                    f"on pad tokens; use padding=auto (packing) or dynamic, or max_seq_length={rec} "
                    f"(covers {spec.length_coverage:g}% of examples)",
                    data={"fixes": [padding_fix(spec, max_len, mean, rec)],
                          "costs": [{"cause": "padding", "frac": round(waste, 3),
                                     "text": f"padding costs {waste:.0%} of each step"}]})
        return lay, step_tokens

    def precision(self) -> str:
        if self.state_in is not None:
            p = self.state_in["precision"]
            asked = self.spec.precision
            if asked in ("bf16", "fp32") and asked != p and p != "fp16":
                # a fix changed it (server/fixes.py): the weights and optimizer state are fp32 either
                # way (autocast), so the checkpoint serves; fp16 has a loss scaler's state and stays
                self.em.info(precision=asked, reason=f"changed from {p} (the run being resumed) as the spec asks")
                return asked
            self.em.info(precision=p, reason="same as the run being resumed")
            return p
        p, why, meas = pick_precision(self.spec, self.device, getattr(self.cfg, "hidden_size", 256),
                                      self.cache_dir)
        self.em.info(precision=p, reason=why, **meas)
        if p == "bf16" and meas.get("bf16_speedup", 1.0) < NO_FAST_BF16:  # asked for: said, not overruled
            self.em.alert(AlertKind.PRECISION, f"precision=bf16 on a CPU without native bf16 (no AMX or "
                          f"AVX512-BF16): its matmul runs at {meas['bf16_speedup']:.2f}x fp32 here; "
                          "precision=auto or fp32 trains far faster on this worker", severity="warning")
        return p


def padding_fix(spec: JobSpec, max_len: int, mean: float, rec: int) -> dict:
    """padding=max_length measured: the fix as a spec change (packing, and the length the data needs),
    its effect the ratio of a row's tokens to its real ones (what packing recovers)."""
    changes: dict = {"padding": [spec.padding, "auto"]}
    if rec < max_len:
        changes["max_seq_length"] = [spec.max_seq_length, rec]
    ratio = max_len / max(mean, 1.0)
    return {"kind": FixKind.PADDING, "title": "pack examples into rows" + (
                f", max_seq_length {max_len} -> {rec}" if rec < max_len else ""),
            "changes": changes, "ratio": round(ratio, 2),
            "effect": f"about {ratio:.1f}x real tokens/s: {1 - mean / max_len:.0%} of each row is padding now "
                      f"(mean example {mean:.0f} of {max_len} tokens), packed rows are nearly all real tokens",
            "resume": "fresh", "why_fresh": LAYOUT_FRESH, "reason": "padding"}
