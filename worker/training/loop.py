"""The training loop: one readable loop over prepared micro-batches, telemetry on logging steps only.

Loss is the sum of token losses over the optimizer step divided by the step's target-token count
(known on the host from the data), so gradient accumulation and padding never change the maths and
no device sync is needed to normalize it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import psutil
import torch

from tokenpulse.protocol import Failure, Phase

from .controls import Controls
from .distributed import Dist, agree, no_sync, shard, sum_over_ranks
from .faults import Faults
from .losshead import loss_model
from .precision import autocast

WARMUP_STEPS = 2  # steps after (re)start left out of speed figures: allocator, kernels, caches


def to_device(batch: dict, device: torch.device) -> dict:
    nb = device.type == "cuda"
    return {k: (v.to(device, non_blocking=nb) if torch.is_tensor(v) else v) for k, v in batch.items()}


def forward_loss(model, batch: dict, precision: str, device: torch.device) -> torch.Tensor:
    """Summed next-token cross entropy of one micro-batch (targets already shifted, -100 ignored).
    model: the plain model, its LossModel, or DDP around the LossModel (losshead.py)."""
    with autocast(device, precision):
        kw = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
        return loss_model(model)(input_ids=batch["input_ids"], targets=batch["targets"], **kw)


def linear_schedule(optimizer, warmup: int, total: int):
    """Linear warm-up then linear decay to 0 (the Hugging Face Trainer default)."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1) if warmup else 1.0
        return max(0.0, (total - step) / max(1, total - warmup))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, f)


def make_optimizer(model, lr: float, weight_decay: float, device: torch.device):
    params = [p for p in model.parameters() if p.requires_grad]
    # fused AdamW: one kernel per step on CUDA, and measured ~1.5x faster than foreach on CPU too
    # (it matters for small models, where the optimizer is a large share of the step).
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


@dataclass
class LoopState:
    step: int = 0  # optimizer steps done
    data_pos: int = 0  # plan steps consumed since the start (the data position)
    epoch: int = 0


@dataclass
class LoopResult:
    outcome: str  # completed | cancelled | paused | nan | exhausted
    step: int
    losses: list = field(default_factory=list)
    detail: str = ""
    timed: dict = field(default_factory=dict)  # after warm-up: seconds, real/padded tokens, steps


@dataclass
class Telemetry:
    """What metrics need besides the batches: emitter, FLOPs per token and the measured peak."""
    em: object
    flops_per_token: float = 0.0
    peak_flops: float = 0.0
    log_every: int = 1
    enabled: bool = True


def run(model, optimizer, scheduler, steps: Iterator[tuple[int, list[dict]]], state: LoopState,
        total_steps: int, precision: str, device: torch.device, tel: Telemetry,
        controls: Controls, faults: Faults = Faults(), on_step: Optional[Callable[[LoopState], Optional[bool]]] = None,
        scaler=None, max_grad_norm: float = 1.0, ranks: Dist = Dist()) -> LoopResult:
    """Train from state.step to total_steps. `steps` yields (epoch, the step's collated micro-batches).
    on_step(state) runs after each step; a true return means it evaluated (left out of tokens/s).
    With several ranks (`ranks`, model wrapped in DDP) each runs its share of every step's
    micro-batches (distributed.shard); only rank 0 reports metrics."""
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    proc = psutil.Process()
    start_step = state.step
    pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, loss, grad_norm) not yet synced
    all_losses: list[float] = []
    win_t = None  # speed window start (after warm-up), counts since then
    win = dict(steps=0, real=0, padded=0, examples=0)
    timed = dict(steps=0, real=0, padded=0, t0=None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def flush(step: int) -> Optional[LoopResult]:
        nonlocal pending, win_t, win
        if not pending:
            return None
        # the one host sync per log interval (and, with ranks, one all_reduce: the step's loss is
        # the sum of every rank's share)
        losses = sum_over_ranks(ranks, torch.stack([loss for _, loss, _ in pending])).tolist()
        norms = torch.stack([g for _, _, g in pending]).float().tolist()
        steps = [s for s, _, _ in pending]
        pending = []
        for s, loss in zip(steps, losses):
            if not math.isfinite(loss):
                if tel.enabled and ranks.main:  # the point at the step its loss is logged at (sent as its
                    tel.em.emit("metrics", step=step, values={"loss": loss})  # word); the nan alert follows
                return LoopResult(Failure.NAN, s, all_losses, f"loss is {loss} at step {s}")
        all_losses.extend(losses)
        if not tel.enabled or not ranks.main:
            return None
        now = time.perf_counter()
        vals = dict(loss=sum(losses) / len(losses), lr=scheduler.get_last_lr()[0], grad_norm=norms[-1],
                    rss_mb=proc.memory_info().rss / 2 ** 20, epoch=state.epoch)
        if device.type == "cuda":
            vals["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20
        if win_t is not None and win["steps"] > 0:
            dt = now - win_t
            tps = win["real"] / dt
            vals.update(tokens_per_s=tps, padded_tokens_per_s=win["padded"] / dt,
                        padding_frac=1 - win["real"] / max(1, win["padded"]),
                        samples_per_s=win["examples"] / dt, step_time_s=dt / win["steps"],
                        eta_s=(total_steps - step) * dt / win["steps"])
            if tel.peak_flops:
                vals["mfu"] = tps * tel.flops_per_token / tel.peak_flops
            win_t, win = now, dict(steps=0, real=0, padded=0, examples=0)
        tel.em.metrics(step, **vals)
        tel.em.phase(Phase.TRAINING, done=step, total=total_steps, unit="steps")
        return None

    while state.step < total_steps:
        step = state.step  # 0-based index of the step about to run
        t_iter = time.perf_counter()
        faults.at("step", step)
        t_wait = time.perf_counter()
        # a preemption (an unannounced SIGTERM) stops as a pause does: checkpoint, then exit queued;
        # agreed on as its own flag, so rank 0 (which reports) knows when only another rank was signalled
        cancel, pause, preempt = agree(ranks, controls.cancel, controls.pause, controls.preempt)
        waited = time.perf_counter() - t_wait  # waiting for the other ranks is not this rank's work
        if cancel or pause or preempt:
            controls.cancel, controls.pause, controls.preempt = cancel, pause or preempt, preempt and not pause
            controls.boundary.set()  # at a step boundary: the requested checkpoint's bound is met
            r = flush(state.step)
            if r:
                return r
            return LoopResult("cancelled" if controls.cancel else "paused", state.step, all_losses)
        t0 = time.perf_counter()
        try:
            state.epoch, micro = next(steps)
        except StopIteration:
            micro = []
        if not micro:
            r = flush(step)
            return r or LoopResult("exhausted", step, all_losses)
        n_targets = max(1, sum(b["n_targets"] for b in micro))  # the whole step's, on every rank
        local, fillers = shard(ranks, micro)
        loss_acc = None
        for i, b in enumerate(local):
            b = to_device(b, device)
            with no_sync(model, last=i == len(local) - 1):
                loss = forward_loss(model, b, precision, device) / n_targets
                if i >= len(local) - fillers:
                    loss = loss * 0.0  # a filler: keeps DDP's backward count equal across ranks
                if faults.at("loss", step):
                    loss = loss * float("nan")
                # x world size: DDP averages gradients over ranks; the step's gradient is their sum
                t_back = time.perf_counter()
                (scaler.scale(loss * ranks.world) if scaler is not None else loss * ranks.world).backward()
                if ranks.on and i == len(local) - 1:  # the backward that waits for every rank's gradients
                    waited += time.perf_counter() - t_back
            loss_acc = loss.detach() if loss_acc is None else loss_acc + loss.detach()
        if scaler is not None:
            scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        tel.em.step_done = state.step  # the alive thread reports it: progress without a host sync
        if ranks.on:  # a straggler is the rank whose own work (waits left out) is far above the others'
            tel.em.rank_step = {"step_time_s": time.perf_counter() - t_iter,
                                "busy_s": time.perf_counter() - t_iter - waited}
        state.data_pos += 1
        pending.append((step, loss_acc, grad_norm.detach()))
        if state.step - start_step == WARMUP_STEPS:
            if device.type == "cuda":
                torch.cuda.synchronize()
            win_t = time.perf_counter()
            timed["t0"] = win_t
        elif win_t is not None:
            timed["steps"] += 1
            timed["real"] += sum(b["n_real"] for b in micro)
            timed["padded"] += sum(b["n_padded"] for b in micro)
            win["steps"] += 1
            win["real"] += sum(b["n_real"] for b in micro)
            win["padded"] += sum(b["n_padded"] for b in micro)
            win["examples"] += sum(b["n_examples"] for b in micro)
        faults.at("step_end", step, seconds=time.perf_counter() - t0)
        if state.step % tel.log_every == 0 or state.step == total_steps:
            r = flush(state.step)
            if r:
                return r
        if on_step is not None:
            t_cb = time.perf_counter()
            if on_step(state) and win_t is not None:
                # an evaluation ran: its time is not training time, keep it out of the speed figures
                spent = time.perf_counter() - t_cb
                win_t += spent
                timed["t0"] += spent
    r = flush(state.step)
    if device.type == "cuda":
        torch.cuda.synchronize()
    res = r or LoopResult("completed", state.step, all_losses)
    if timed["t0"] is not None:
        res.timed = dict(seconds=time.perf_counter() - timed["t0"], real=timed["real"],
                         padded=timed["padded"], steps=timed["steps"])
    return res
