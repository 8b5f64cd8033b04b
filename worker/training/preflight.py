"""Preflight advice: what the analysis of a spec's data says is likely wrong, each with its fix.

Pure rules over the analysis dict (analysis.analyze_lengths) and the spec: no torch, no data. The
analyzer adds them to its output as `warnings`; the server returns them from a submit. They are
advice: the job runs as asked.
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
    n, cut, frac = a.get("examples", 0), a.get("truncated", 0), a.get("truncated_frac", 0.0)
    L, rec = a.get("max_seq_length"), a.get("recommended_max_seq_length")
    if frac > TRUNCATION_WARN:
        sample = " (in a sample)" if a.get("sampled") else ""
        field = "max_seq_length" if spec.max_seq_length != "auto" else "length_coverage"
        fix = (f"max_seq_length={rec} (covers {a.get('length_coverage', spec.length_coverage):g}% of examples whole)"
               if rec and L and rec > L else "shorten or split the longest examples (the model's limit)")
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
