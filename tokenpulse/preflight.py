"""Preflight advice: what a spec and the analysis of its data say is likely wrong, each with its fix.

Pure rules over the spec and the analysis dict (worker.training.analysis.analyze_lengths): no torch,
no data, so both the analyzer (`python -m worker.training.analyze`, which adds them to its output as
`warnings`) and the server (submit) use them. They are advice: the job runs as asked.
"""
from __future__ import annotations

from tokenpulse.protocol import JobSpec

PADDING_WASTE_WARN = 0.2  # share of computed tokens that are padding
TRUNCATION_WARN = 0.01  # share of examples cut by max_seq_length


def warning(kind: str, field: str, message: str, fix: str) -> dict:
    return {"kind": kind, "field": field, "message": message, "fix": fix}


def spec_warnings(spec: JobSpec) -> list[dict]:
    """Advice that needs no data at all."""
    out = []
    if spec.streaming and spec.epochs is not None:
        if spec.max_steps is None:
            out.append(warning("streaming_epochs", "epochs",
                               "a stream's length is unknown, so epochs cannot be counted: the job will stop "
                               "at start with a spec error", "set max_steps instead of epochs"))
        else:
            out.append(warning("streaming_epochs", "epochs",
                               f"epochs is ignored when streaming (a stream's length is unknown); max_steps="
                               f"{spec.max_steps} decides how long it trains", "leave epochs out"))
    return out


def analysis_warnings(spec: JobSpec, a: dict) -> list[dict]:
    """Advice from the data's token lengths (padding waste, truncation)."""
    out = []
    frac = a.get("truncated_frac", 0.0)
    L, rec = a.get("max_seq_length"), a.get("recommended_max_seq_length")
    if frac > TRUNCATION_WARN:
        # The submit-time analysis tokenizes a sample; the job counts all the data at its start with the
        # same rule, so its number can differ a little: each says what it measured.
        n = a.get("sample_size")
        sample = (f" (in a sample of {n:,})" if a.get("sampled") and n else
                  " (in a sample)" if a.get("sampled") else "")
        field = "max_seq_length" if spec.max_seq_length != "auto" else "length_coverage"
        fix = (f"max_seq_length={rec} (covers {a.get('length_coverage', spec.length_coverage):g}% of examples whole"
               + (f" in a sample of {n:,}; the job recounts on all its data at start" if a.get("sampled") and n else "")
               + ")" if rec and L and rec > L else "shorten or split the longest examples (the model's limit)")
        if field == "length_coverage" and rec and L and rec <= L:
            fix = "length_coverage=99.9 (the default)"
        out.append(warning("truncation", field, f"{frac:.1%} of examples{sample} are longer than "
                                                f"max_seq_length={L} and would be cut", fix))
    layouts = a.get("layouts") or {}
    mode = spec.padding
    if mode in ("max_length", "dynamic") and mode in layouts:
        waste = layouts[mode]["padding_frac"]
        pack = layouts.get("pack", {}).get("padding_frac")
        if waste > PADDING_WASTE_WARN and (pack is None or pack < waste / 2):
            ratio = (1 - (pack or 0)) / (1 - waste)
            fix = (f"padding=auto (packing: {pack:.0%} padding, {ratio:.1f}x fewer tokens computed for the same data)"
                   if pack is not None else "padding=auto")
            if mode == "dynamic" and not spec.group_by_length:
                fix += " or group_by_length=true"
            out.append(warning("padding", "padding", f"padding={mode} wastes {waste:.0%} of the computed tokens "
                                                     f"on padding", fix))
    return out


BATCH_FAR = 4  # a micro-batch this many times off the measured best is "far"


def batch_size_warnings(spec: JobSpec, chosen: dict, job_id: int) -> list[dict]:
    """A fixed batch_size against what an earlier job on the same model and data measured
    (its autotune info: the rows it chose, row_len, and the table of measured shapes)."""
    if not isinstance(spec.batch_size, int) or not isinstance(chosen.get("batch_size"), int):
        return []
    best, bs = chosen["batch_size"], spec.batch_size
    table = chosen.get("measured") or []
    fitting = [m["rows"] for m in table if m.get("fits")]
    failed = [m["rows"] for m in table if not m.get("fits")]
    tps = max((m.get("tokens_per_s") or 0 for m in table), default=0)
    seen = (f"job #{job_id} measured {best} rows of {chosen.get('row_len')} tokens fastest on this model and "
            f"data" + (f" ({tps:,.0f} real tokens/s forward+backward)" if tps else ""))
    if failed and bs >= min(failed) and (not fitting or bs > max(fitting)):
        return [warning("batch_size", "batch_size", f"batch_size={bs} did not fit in memory when measured; {seen}",
                        f"batch_size={best} or batch_size=auto")]
    # compare tokens per micro-batch (rows x row length): the user's rows are max_seq_length long
    row_len = chosen.get("row_len") or 1
    seq_len = spec.max_seq_length if isinstance(spec.max_seq_length, int) else chosen.get("max_seq_length") or row_len
    mine = bs * seq_len
    if mine >= BATCH_FAR * best * row_len or mine * BATCH_FAR <= best * row_len:
        return [warning("batch_size", "batch_size", f"batch_size={bs} is far from what fits best: {seen}",
                        f"batch_size={best} or batch_size=auto (measures what fits and is fastest)")]
    return []
