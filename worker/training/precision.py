"""Device and precision choices, each measured or justified, plus a measured peak for MFU."""
from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import torch

from tokenpulse.errors import SpecError
from tokenpulse.protocol import JobSpec

from . import kept as keep

KEPT_AS = "precision"  # kept.py's kind: the CPU's bf16 measurement per matmul shape


def pick_device(spec: JobSpec) -> tuple[torch.device, str]:
    has_cuda = torch.cuda.is_available()
    if spec.device == "cuda" and not has_cuda:
        raise SpecError("device", "device=cuda but this worker has no CUDA GPU")
    if spec.device == "cpu" or not has_cuda:
        return torch.device("cpu"), "no accelerator found" if spec.device == "auto" else "asked for cpu"
    return torch.device("cuda"), f"accelerator found: {torch.cuda.get_device_name(0)}"


def _time_matmul(n: int, k: int, m: int, dtype: torch.dtype, device: torch.device, reps: int) -> float:
    """Seconds per (n,k)@(k,m) under autocast at dtype (fp32 = plain)."""
    a = torch.randn(n, k, device=device)
    b = torch.randn(k, m, device=device)
    ctx = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
    with ctx:
        for _ in range(2):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


PROBE = 256  # a matmul this small tells a CPU without native bf16 at once (see bf16_probe)
NO_FAST_BF16 = 0.5  # a probe ratio below this: bf16 is emulated here, not worth timing in full


def bf16_probe(device: torch.device) -> float:
    """fp32 time / bf16 time of a 256x256x256 matmul. A CPU without native bf16 (no AMX or
    AVX512-BF16) emulates it 20-50x slower than fp32: timing the model-shaped matmul there took a
    minute at hidden 256 (several for a 0.5B model) before the first step; this takes ~0.5 s."""
    f32 = _time_matmul(PROBE, PROBE, PROBE, torch.float32, device, 3)
    b16 = _time_matmul(PROBE, PROBE, PROBE, torch.bfloat16, device, 3)
    return f32 / b16


def measure_peak_flops(dtype: torch.dtype, device: torch.device) -> float:
    """Achieved FLOP/s of a large matmul: the denominator of MFU (a measured, not a datasheet, peak)."""
    n = 4096 if device.type == "cuda" else 1024
    s = _time_matmul(n, n, n, dtype, device, reps=10 if device.type == "cuda" else 3)
    return 2 * n ** 3 / s


def pick_precision(spec: JobSpec, device: torch.device, hidden: int,
                   cache_dir: Optional[Path] = None) -> tuple[str, str, dict]:
    """(precision, reason, measurements). CPU: bf16 only where a matmul shaped like the model's is
    faster; the ratio is kept in cache_dir (kept.py), so a relaunch or the next job of that width
    takes the same choice (and the same loss-head key) instead of timing again."""
    want = spec.precision
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 leftovers (e.g. the loss) run on tensor cores
        torch.backends.cudnn.allow_tf32 = True
        bf16_ok = torch.cuda.is_bf16_supported()
        if want == "auto":
            return ("bf16", "GPU supports bf16 (autocast), TF32 on", {}) if bf16_ok else \
                   ("fp16", "GPU lacks bf16: fp16 autocast with loss scaling, TF32 on", {})
        if want == "bf16" and not bf16_ok:
            raise SpecError("precision", "precision=bf16 but this GPU does not support bf16")
        return want, "asked for", {}
    if want == "fp16":
        raise SpecError("precision", "precision=fp16 needs a CUDA GPU; use bf16 or fp32 on CPU")
    if want == "bf16":
        ratio = bf16_probe(device)
        if ratio < NO_FAST_BF16:
            return want, (f"asked for, though this CPU has no native bf16: its matmul runs at {ratio:.2f}x "
                          "fp32 here (precision=auto would choose fp32)"), {"bf16_speedup": round(ratio, 2)}
    if want != "auto":
        return want, "asked for", {}
    # Shape like one MLP matmul of a few thousand tokens: what training spends its time on.
    n, k, m = 2048, max(hidden, 64), max(4 * hidden, 256)
    key = keep.key(matmul=[n, k, m], device=keep.device_name(device))
    kept = keep.load(cache_dir, KEPT_AS, key)
    how = "kept from an earlier measurement on this machine" if kept else "measured"
    if kept is None:
        try:
            ratio = bf16_probe(device)
            if ratio >= NO_FAST_BF16:  # worth timing at the model's own shape
                f32 = min(_time_matmul(n, k, m, torch.float32, device, 5) for _ in range(2))
                b16 = min(_time_matmul(n, k, m, torch.bfloat16, device, 5) for _ in range(2))
                ratio = f32 / b16
        except RuntimeError as e:
            return "fp32", f"bf16 autocast unavailable on this CPU ({e})", {}
        kept = {"bf16_speedup": round(ratio, 2)}
        keep.save(cache_dir, KEPT_AS, key, kept)
    ratio = kept["bf16_speedup"]
    meas = {"bf16_speedup": ratio, "precision_measured": how == "measured"}
    if ratio >= 1.2:
        return "bf16", f"{how}: bf16 matmul {ratio:.1f}x faster than fp32 on this CPU", meas
    if ratio < NO_FAST_BF16:
        return "fp32", f"{how}: this CPU has no native bf16 (its bf16 matmul runs at {ratio:.2f}x fp32)", meas
    return "fp32", f"{how}: bf16 matmul only {ratio:.2f}x fp32 on this CPU, not worth the precision", meas


def autocast(device: torch.device, precision: str):
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "fp16":
        return torch.autocast(device.type, dtype=torch.float16)
    return nullcontext()
