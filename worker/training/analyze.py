"""Preflight analysis CLI: `python -m worker.training.analyze --spec SPEC.json [--check-only] [--cache-dir DIR]`.

Prints one JSON object on stdout: the analysis, `{"ok": true}` (--check-only), or
`{"error": ..., "field": ...}` with exit code 2 for bad input. Progress events go to stderr (or the
event fd when TOKENPULSE_EVENT_FD is set), so stdout stays machine-readable.
"""
from __future__ import annotations

from tokenpulse.errors import SpecError

from .runtime import configure as _configure_runtime

_configure_runtime()  # before anything imports torch

import argparse
import json
import os
import sys
from pathlib import Path

from .errors import EXIT_CRASH, EXIT_OK, EXIT_SPEC


def check(spec, cache_dir=None) -> dict:
    """Fast submit-time validation: model config + tokenizer, dataset readable, fields present."""
    from . import data as D
    from .modeling import check_model
    check_model(spec)
    path = D.dataset_path(spec)
    fields = D.resolve_fields(spec, D.peek_columns(path, cache_dir, spec.dataset_config, spec.dataset_split))
    if fields.kind == "messages":  # chats need the tokenizer's chat template: say so before the run
        from .chat import require_template
        from .modeling import load_tokenizer
        require_template(load_tokenizer(spec), spec.model)
    return {"ok": True}


def analyze(spec, cache_dir=None, em=None, sample=None, measure_s: float = 0.0):
    """-> protocol.DatasetAnalysis"""
    from tokenpulse.protocol import DatasetAnalysis

    from .analysis import SAMPLE_ABOVE, analyze_lengths
    from .emit import Emitter
    from .modeling import load_tokenizer
    from .prepare import load_tokenized
    em = em or Emitter(alive_every=0)
    check(spec, cache_dir)
    tok = load_tokenizer(spec)
    data, info = load_tokenized(spec, tok, em, cache_dir, sample=sample or SAMPLE_ABOVE)
    model_max = _model_max(spec)
    fixed = spec.max_seq_length if spec.max_seq_length != "auto" else None
    out = analyze_lengths(data.lengths, spec.length_coverage, model_max, fixed, n_total=info["examples"],
                          tokens_per_batch=spec.tokens_per_batch, group_by_length=spec.group_by_length,
                          pad_all=spec.padding == "max_length")
    out["fields"] = {k: v for k, v in info["fields"].items() if v}
    out["tokenization_cache"] = "hit" if info["cache_hit"] else "miss"
    from tokenpulse.preflight import analysis_warnings, spec_warnings
    out["warnings"] = spec_warnings(spec) + analysis_warnings(spec, out)
    if measure_s > 0:
        out["memory"] = measure_fit(spec, tok, data, model_max, out["max_seq_length"], measure_s, em, cache_dir)
    return DatasetAnalysis(**out)


def measure_fit(spec, tok, data, model_max, seq_len, budget_s, em, cache_dir=None) -> dict:
    """Per candidate sequence length, the largest micro-batch that fits and its tokens/s (fit.py), at
    the precision a job would choose (its CPU timing kept in cache_dir for the jobs that follow)."""
    from .fit import fit_table
    from .modeling import load_model
    from .precision import pick_device, pick_precision
    device, _ = pick_device(spec)
    model = load_model(spec, tok, device)
    precision, _, _ = pick_precision(spec, device, getattr(model.config, "hidden_size", 256), cache_dir)
    from .memory import apply_test_headroom
    apply_test_headroom()  # test-only (env): real allocator failures at a known size

    def progress(k, n):
        em.phase("measuring memory", done=k, total=n, unit="lengths")
    table = fit_table(model, data, precision, device, model_max, (seq_len,), spec.seed, budget_s, progress)
    return {"device": str(device), "precision": precision, "budget_s": budget_s, "table": table}


def _model_max(spec):
    from tokenpulse.protocol import BUILTIN_MODEL
    if spec.model == BUILTIN_MODEL:
        from .modeling import builtin_config
        return builtin_config(2048).max_position_embeddings
    from transformers import AutoConfig

    from .modeling import model_dir
    cfg = AutoConfig.from_pretrained(str(model_dir(spec)), trust_remote_code=False)
    for k in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        v = getattr(cfg, k, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.training.analyze", description=__doc__)
    ap.add_argument("--spec", required=True, type=Path)
    ap.add_argument("--check-only", action="store_true", help="validate model, dataset and fields only")
    ap.add_argument("--cache-dir", type=Path)
    ap.add_argument("--sample", type=int, help="tokenize at most this many examples (default 20000)")
    ap.add_argument("--measure", type=float, default=0.0, metavar="SECONDS",
                    help="also measure, within about this many seconds, the largest micro-batch that fits "
                         "for each candidate sequence length and its tokens/s (loads the model)")
    args = ap.parse_args(argv)
    from .hub import use_shared_cache
    use_shared_cache(args.cache_dir)  # before huggingface_hub is imported
    try:
        from tokenpulse.protocol import JobSpec
        try:
            spec = JobSpec.model_validate_json(args.spec.read_text())
        except FileNotFoundError:
            raise SpecError("spec", f"spec file not found: {args.spec}") from None
        except Exception as e:
            raise SpecError("spec", f"invalid spec: {e}") from e
        out = (check(spec, args.cache_dir) if args.check_only
               else analyze(spec, args.cache_dir, sample=args.sample, measure_s=args.measure).model_dump(mode="json"))
        code = EXIT_OK
    except SpecError as e:
        out, code = e.as_json(), EXIT_SPEC
    except Exception as e:  # noqa: BLE001 -- the caller still gets one JSON object
        out, code = {"error": f"{type(e).__name__}: {e}", "field": None}, EXIT_CRASH
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    code = main()
    os._exit(code)
