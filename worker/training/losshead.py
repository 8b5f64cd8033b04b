"""The model and its loss as one module, with the output head and the loss compiled where it pays.

With a ~8k-token vocabulary and a small model, the output projection and the cross entropy (bf16
logits, cast to fp32, log-softmax, gather) are a third of a training step, and eager PyTorch writes
the whole fp32 logits tensor to memory and reads it back several times. torch.compile fuses the
head and the loss into a few kernels (dynamic shapes: micro-batches of any size, compiled once);
compiling the whole model adds little to that here and costs far more to compile.

Checked, not assumed, before it is used (`choose`):
  1. the model's logits are exactly its output embedding applied to its last hidden state (a model
     that scales or soft-caps its logits keeps the stock path);
  2. the compiled loss equals the eager one on a sample micro-batch (a compiler or toolchain
     problem, e.g. no C compiler for the CPU backend, keeps the stock path);
  3. forward+backward is measured faster on this device.
The measurement is kept in the agent's cache dir (kept.py): a relaunch, a retry or the next job
of the same model shape on this machine takes it as it is, with no compiling or timing before its
first step (an attempt's first step then compiles the kept choice alone, from inductor's cache).

`LossModel` is what DistributedDataParallel wraps, so the forward that DDP needs to see is this one.
"""
from __future__ import annotations

import time
import weakref
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from . import kept as keep
from .packing import IGNORE
from .precision import autocast

MIN_SPEEDUP = 1.05  # below this the compile time and a second code path are not worth it
MIN_RUN_S = 20.0  # compiling costs ~5-10 s on a small CPU: a shorter run would not earn it back


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy (targets already shifted, IGNORE left out), in fp32."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")


def head_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              targets: torch.Tensor) -> torch.Tensor:
    return cross_entropy_sum(F.linear(hidden, weight, bias), targets)


_compiled_head = None


def compiled_head():
    global _compiled_head
    if _compiled_head is None:  # one compiled function per process; dynamic: any micro-batch shape
        _compiled_head = torch.compile(head_loss, dynamic=True)
    return _compiled_head


def _parts(model):
    """(the causal LM, its decoder body, its output embedding); a PEFT model's base model inside."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    return lm, lm.base_model, lm.get_output_embeddings()


class LossModel(torch.nn.Module):
    """forward(micro-batch) -> the summed token loss. fused: body, then the compiled head+loss."""

    def __init__(self, model, fused: bool = False):
        super().__init__()
        self.model = model
        self.fused = fused

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        kw = {"position_ids": position_ids} if position_ids is not None else {}
        if self.fused:
            _, body, out = _parts(self.model)
            hidden = body(input_ids=input_ids, use_cache=False, **kw).last_hidden_state
            return compiled_head()(hidden, out.weight, out.bias, targets)
        logits = self.model(input_ids=input_ids, use_cache=False, **kw).logits
        return cross_entropy_sum(logits, targets)


# The choice made for a model, so every caller holding the plain model (autotune, evaluation, the
# memory fit) computes its loss the same way as training does. Weak: a finished run's model is freed.
_fused: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def loss_model(model) -> torch.nn.Module:
    """The LossModel to call for `model` (a LossModel, or DDP around one, is returned as it is)."""
    if isinstance(model, LossModel) or isinstance(getattr(model, "module", None), LossModel):
        return model
    return LossModel(model, fused=_fused.get(model, False))


def use(model, fused: bool) -> None:
    """Take a choice made elsewhere (rank 0's, in a distributed run)."""
    _fused[model] = bool(fused)


def _sample(model, device: torch.device, rows: int, length: int) -> dict:
    lm, _, _ = _parts(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, lm.config.vocab_size, (rows, length), generator=g)
    targets = torch.roll(ids, -1, 1)
    targets[:, -1] = IGNORE
    return {"input_ids": ids.to(device), "targets": targets.to(device)}


@torch.no_grad()
def _logits_are_plain_head(model, device: torch.device) -> tuple[bool, str]:
    lm, body, out = _parts(model)
    if out is None or not isinstance(out, torch.nn.Linear):
        return False, "the model has no linear output embedding"
    was_training = model.training
    model.eval()
    try:
        b = _sample(model, device, 2, 16)
        logits = model(input_ids=b["input_ids"], use_cache=False).logits.float()
        mine = F.linear(body(input_ids=b["input_ids"], use_cache=False).last_hidden_state, out.weight, out.bias)
    except Exception as e:  # an architecture whose parts do not compose like this keeps the stock path
        return False, f"head and body do not compose ({type(e).__name__}: {e})"
    finally:
        model.train(was_training)
    diff = (logits - mine.float()).abs().max().item()
    if diff > 1e-5 * max(1.0, logits.abs().max().item()):
        return False, f"the model transforms its logits after the output embedding (diff {diff:.2g})"
    return True, ""


def _step_time(lm: LossModel, batch: dict, precision: str, device: torch.device, reps: int) -> tuple[float, float]:
    """(the best forward+backward seconds of `reps` calls after a first one that compiles or warms up,
    that first call's loss)."""
    best, first = float("inf"), float("nan")
    for k in range(reps + 1):
        t0 = time.perf_counter()
        with autocast(device, precision):
            loss = lm(**batch)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if k:
            best = min(best, time.perf_counter() - t0)
        else:
            first = loss.item()
    lm.model.zero_grad(set_to_none=True)
    return best, first


def _measure(model, precision: str, device: torch.device, batch: dict, eager_s: float,
             eager_loss: float) -> tuple[Optional[dict], str]:
    """Time the compiled head+loss against the eager one (the first compiled call, with gradients, is
    the one training compiles: one compile, and its loss checked equal to the eager loss).
    Returns (measurements, "") or (None, why the compiled path is not usable)."""
    fused = LossModel(model, fused=True)
    try:
        t_fused, b = _step_time(fused, batch, precision, device, reps=2)
    except Exception as e:  # e.g. no C compiler for the CPU backend: the stock path still trains
        model.zero_grad(set_to_none=True)
        return None, f"torch.compile failed ({type(e).__name__}: {str(e)[:200]})"
    if abs(eager_loss - b) > 1e-2 * max(1.0, abs(eager_loss)):
        return None, f"the compiled loss differs ({b:.4f} vs {eager_loss:.4f})"
    t_eager = min(eager_s, _step_time(LossModel(model), batch, precision, device, reps=1)[0])
    return {"speedup": round(t_eager / t_fused, 2), "eager_s_per_token": t_eager / batch["input_ids"].numel(),
            "probe": list(batch["input_ids"].shape)}, ""


KEPT_AS = "losshead"  # kept.py's kind: the directory under the cache dir


def head_key(config, classes: str, precision: str, device: torch.device) -> str:
    cfg = config.to_dict()
    cfg.pop("_name_or_path", None)  # where the weights came from does not change the speed
    return keep.key(config=cfg, classes=classes, precision=precision, device=keep.device_name(device))


def choose(model, precision: str, device: torch.device, wanted: str = "auto",
           planned_tokens: Optional[int] = None, probe_tokens: int = 2048,
           cache_dir: Optional[Path] = None) -> tuple[bool, str, dict]:
    """Decide (and remember for `loss_model`) whether `model` trains with the compiled head+loss.
    wanted: auto (where it repays compiling and is measured faster), on (wherever it is correct),
    off. planned_tokens: the run's tokens, to tell whether compiling can pay for itself. cache_dir:
    where the measurement is kept for the next attempt (kept.py); a kept one is taken as it is.
    Returns (fused, reason, measurements)."""
    _fused[model] = False
    if wanted == "off":
        return False, "torch_compile=off: eager output head and loss", {}
    ok, why = _logits_are_plain_head(model, device)
    if not ok:
        return False, f"eager output head and loss: {why}", {}
    lm, _, _ = _parts(model)
    key = head_key(lm.config, f"{type(model).__name__}/{type(lm).__name__}", precision, device)
    kept = keep.load(cache_dir, KEPT_AS, key)
    model.train()
    if kept is None:
        batch = _sample(model, device, max(1, probe_tokens // 256), 256)
        eager_s, eager_loss = _step_time(LossModel(model), batch, precision, device, reps=1)
        per_token = eager_s / batch["input_ids"].numel()
    else:
        per_token = kept["eager_s_per_token"]
    if wanted == "auto" and planned_tokens is not None:
        run_s = planned_tokens * per_token
        if run_s < MIN_RUN_S:
            return False, (f"eager output head and loss: the run (~{run_s:.0f} s of forward+backward) is too "
                           f"short to repay compiling"), {}
    if kept is None:
        kept, why = _measure(model, precision, device, batch, eager_s, eager_loss)
        if kept is None:
            return False, f"eager output head and loss: {why}", {}
        keep.save(cache_dir, KEPT_AS, key, kept)
        measured, how = True, "measured now"
    else:
        measured, how = False, "kept from an earlier measurement on this machine"
    speedup = kept["speedup"]
    meas = {"compiled_loss_speedup": speedup, "loss_head_measured": measured}
    if wanted == "auto" and speedup < MIN_SPEEDUP:
        return False, f"eager output head and loss: compiled only {speedup:.2f}x ({how})", meas
    _fused[model] = True
    rows, cols = kept["probe"]
    return True, (f"output head and loss compiled (torch.compile, {'asked for' if wanted == 'on' else 'measured'}): "
                  f"forward+backward {speedup:.2f}x the eager speed on a {rows}x{cols} micro-batch, same loss "
                  f"({how})"), meas
