"""A verdict's measurements turned into its fix as a change (tokenpulse/protocol.py FixKind: the shape
server/fixes.py applies) and its cost in time. Pure functions of what the detectors observed.

- a training job's slow reasons (slow.py) -> a JobSpec diff: padding (packing, max_seq_length from the
  data), a crawling step (a smaller micro-batch, more accumulation: the same effective batch),
  precision (bf16 on a GPU that has it), periodic evaluations/checkpoints (less often), the CPU while a
  GPU waits (device=auto);
- a command job's first-steps verdicts (advice.py) -> its argv with the Trainer argument changed, only
  where the command line already carries TrainingArguments flags (HfArgumentParser reads them): else
  there is no saying, without guessing, what would change, and the verdict stays prose;
- costs: each cause's share of the step time (padding, input wait, periodic pauses) priced against
  the remaining ETA: "input wait costs 31% of each step = 2.4 h of the remaining ETA".
Reasons without a fix (throughput fell, the projection, growth, memory, an idle GPU) carry none.
"""
from __future__ import annotations

import math
import statistics
from typing import Optional

from tokenpulse.protocol import LAYOUT_FRESH, FixKind, Phase

LESS_OFTEN = 4  # evaluations / checkpoints that stall the run: this many times fewer
SMALLER = 4  # a crawling micro-batch: this many times fewer rows, as many more accumulation steps
ARGV_FRESH = ("the Trainer resumes a checkpoint by counting batches already seen: with another batch "
              "layout that count points elsewhere in the data, so the command starts again from step 0")


def _hours(frac: float, eta_s: Optional[float]) -> str:
    if not eta_s:
        return f"{frac:.0%} of each step"
    return f"{frac:.0%} of each step = {frac * eta_s / 3600:.1f} h of the remaining ETA"


# ---- a training job (JobSpec) ------------------------------------------------------------------

def padding_fix(info: dict, frac: float) -> Optional[dict]:
    """padding measured at frac of the batch tokens -> packing (or grouping by length where the model
    cannot pack) and the length the data needs."""
    mode, L = info.get("padding"), info.get("max_seq_length")
    rec = info.get("recommended_max_seq_length")
    if rec is None and isinstance(L, int):
        rec = int(math.ceil((1 - frac) * L * 2 / 8) * 8)
    changes: dict = {}
    if mode == "max_length":
        changes["padding"] = ["max_length", "auto"]
    elif mode == "dynamic" and not info.get("group_by_length"):
        changes["group_by_length"] = [False, True]
    if isinstance(L, int) and isinstance(rec, int) and 8 <= rec < L:
        changes["max_seq_length"] = [L, rec]
    if not changes:
        return None
    ratio = 1 / max(1 - frac, 0.05)
    what = "pack examples into rows" if "padding" in changes else "batch similar lengths together"
    return {"kind": FixKind.PADDING, "reason": "padding",
            "title": what + (f", max_seq_length {L} -> {rec}" if "max_seq_length" in changes else ""),
            "changes": changes, "ratio": round(ratio, 2),
            "effect": f"up to {ratio:.1f}x real tokens/s: {frac:.0%} of each batch is padding now",
            "resume": "fresh", "why_fresh": LAYOUT_FRESH}


def micro_batch_fix(info: dict, step_s: float) -> Optional[dict]:
    """A crawling optimizer step -> SMALLER x fewer rows per micro-batch, as many more accumulation
    steps: the same effective batch, each micro-batch's activations that much smaller. The autotune
    table (info 'measured') predicts the new pace when it measured that size."""
    rows, ga = info.get("batch_size"), info.get("grad_accum")
    if not isinstance(rows, int) or not isinstance(ga, int) or rows < 2:
        return None
    new = max(1, rows // SMALLER)
    new_ga = max(1, round(rows * ga / new))
    if new_ga > 65536:
        return None
    effect = (f"the same effective batch ({rows} x {ga} = {rows * ga} rows a step, now {new} x {new_ga}); each "
              f"micro-batch {rows / new:.0f}x smaller in memory, for a step that crawls ({step_s:.1f} s) "
              f"from memory pressure")
    ratio = None
    rates = {m.get("rows"): m.get("tokens_per_s") for m in info.get("measured") or [] if isinstance(m, dict)}
    r_new, r_old = rates.get(new), rates.get(rows)
    if isinstance(r_new, (int, float)) and isinstance(r_old, (int, float)) and r_old > 0:
        ratio = r_new / r_old
        effect += f"; autotune measured {ratio:.2f}x the tokens/s at {new} rows"
    return {"kind": FixKind.MICRO_BATCH, "reason": "crawl", "title": f"micro-batch {rows} -> {new}, "
            f"accumulation {ga} -> {new_ga}", "changes": {"batch_size": [rows, new], "grad_accum": [ga, new_ga]},
            "ratio": ratio, "effect": effect, "resume": "fresh", "why_fresh": LAYOUT_FRESH}


def precision_fix(info: dict, gpu: Optional[str]) -> dict:
    return {"kind": FixKind.PRECISION, "reason": "precision", "title": "precision fp32 -> bf16",
            "changes": {"precision": [info.get("precision") or "fp32", "bf16"]}, "ratio": None,
            "effect": f"bf16 matmuls on {gpu or 'this GPU'}: typically 2-3x the tokens/s, half the activation "
                      f"memory; the comparison after the relaunch says how much here",
            "resume": "checkpoint"}


def device_fix(gpu: Optional[str]) -> dict:
    return {"kind": "device", "reason": "cpu", "title": "device cpu -> auto",
            "changes": {"device": ["cpu", "auto"]}, "ratio": None,
            "effect": f"the model on the GPU ({gpu or 'this worker has one'}) instead of the CPU",
            "resume": "checkpoint"}


def periodic_fix(spec: dict, phases: set, frac: float) -> Optional[dict]:
    """Pauses every N steps during evaluations or checkpoint saves -> LESS_OFTEN x fewer of them."""
    for phase, name in ((Phase.EVALUATING, "eval_every"), (Phase.SAVING, "checkpoint_every")):
        every = spec.get(name)
        if phase in phases and isinstance(every, int):
            back = frac * (1 - 1 / LESS_OFTEN)
            return {"kind": FixKind.EVAL if name == "eval_every" else "checkpoint", "reason": "periodic",
                    "title": f"{name} {every} -> {every * LESS_OFTEN}",
                    "changes": {name: [every, every * LESS_OFTEN]}, "ratio": round(1 / max(1 - back, 0.05), 2),
                    "effect": f"'{phase}' takes {frac:.0%} of the time; {LESS_OFTEN}x less often gives back "
                              f"about {back:.0%}", "resume": "checkpoint"}
    return None


def for_slow(reasons: list, det, spec: Optional[dict]) -> dict:
    """A slow verdict's data: its fixes (one per reason that has one) and costs. det: the SlowDetector;
    spec: the job's JobSpec as a dict (None for a command job: its fixes come from advice.py)."""
    keys = {k for k, _ in reasons}
    fixes: list = []
    costs: list = []
    eta = det.eta_s
    pads = [s.padding for s in det.samples[-20:] if s.padding is not None][-3:]
    frac = statistics.median(pads) if pads else None
    if "padding" in keys and frac:
        costs.append({"cause": "padding", "frac": round(frac, 3), "text": f"padding costs {_hours(frac, eta)}"})
        if spec is not None:
            f = padding_fix(det.info, frac)
            if f and eta:
                f["effect"] += (f"; ETA {eta / 3600:.1f} h -> about {eta / f['ratio'] / 3600:.1f} h" if not
                                spec.get("max_steps") else
                                "; the ETA stays (max_steps fixes the step count), each step trains on more data")
            fixes += [f] if f else []
    if "input" in keys:
        share = det.anatomy.input_share()
        if share:
            costs.append({"cause": "input wait", "frac": round(share, 3),
                          "text": f"input wait costs {_hours(share, eta)}"})
    if "periodic" in keys and det.periodic:
        n, pfrac, phases = det.periodic
        costs.append({"cause": "periodic stalls", "frac": round(pfrac, 3),
                      "text": f"periodic stalls cost {_hours(pfrac, eta)}"})
        if spec is not None:
            f = periodic_fix(spec, phases, pfrac)
            fixes += [f] if f else []
    if spec is not None:
        if "crawl" in keys and det.samples:
            f = micro_batch_fix(det.info, statistics.median(s.step_time for s in det.samples[-3:]))
            fixes += [f] if f else []
        if "precision" in keys:
            fixes.append(precision_fix(det.info, det.gpu))
        if "cpu" in keys:
            fixes.append(device_fix(det.gpu))
    return {"fixes": fixes, "costs": costs}


# ---- a command job (its argv) -----------------------------------------------------------------

def set_flag(argv: list, args: dict, name: str, value: str) -> Optional[list]:
    """argv with --name set to value: replaced where given, added where the command line already
    passes the script's TrainingArguments (args: those the script reported) as flags; None: no
    saying how this command takes the setting."""
    flag = f"--{name}"
    out = list(argv)
    for i, a in enumerate(out):
        if a == flag and i + 1 < len(out) and not out[i + 1].startswith("--"):
            out[i + 1] = value
            return out
        if a.startswith(flag + "="):
            out[i] = f"{flag}={value}"
            return out
        if a == flag:  # a bare boolean flag
            out[i:i + 1] = [flag, value]
            return out
    if any(a.startswith("--") and a[2:].split("=")[0] in args for a in argv):
        return out + [flag, value]
    return None


def for_advice(kind: str, adv, argv: list) -> Optional[dict]:
    """A command job's first-steps verdict (advice.py kind) as its command line changed."""
    a = adv.args
    flags: dict = {}
    resume, title, effect = "checkpoint", "", ""
    if kind == "dataloader":
        workers, cores = a.get("dataloader_num_workers"), a.get("cores")
        if isinstance(workers, int) and cores and workers > cores:
            flags["dataloader_num_workers"] = [workers, cores]
            effect = f"{workers} workers on {cores} cores contend with the training; {cores} do not"
        elif not workers:
            new = min(4, cores or 2)
            flags["dataloader_num_workers"] = [workers or 0, new]
            share = adv._data_share()
            effect = (f"{share:.0%} of each step waits for data now; {new} workers prepare the next batches "
                      f"while the model trains (up to {1 / max(1 - share, 0.05):.1f}x)" if share else
                      f"{new} workers prepare batches while the model trains")
        fixkind = FixKind.WORKERS
    elif kind == "precision":
        flags["bf16"] = [a.get("bf16") or False, True]
        effect, fixkind = "bf16 matmuls: typically 2-3x the tokens/s on this GPU", FixKind.PRECISION
    elif kind == "padding" and not adv._pad_site():
        flags["group_by_length"] = [a.get("group_by_length") or False, True]
        frac = adv._padding()
        effect = (f"{frac:.0%} of each batch is padding now; batches of similar lengths pad little" if frac
                  else "batches of similar lengths pad little")
        fixkind, resume = FixKind.GROUP_BY_LENGTH, "fresh"
    elif kind == "batch":
        rows, ga = a.get("per_device_train_batch_size"), a.get("gradient_accumulation_steps") or 1
        if not isinstance(rows, int) or rows < 2:
            return None
        new = max(1, rows // SMALLER)
        new_ga = max(1, round(rows * ga / new))
        flags["per_device_train_batch_size"] = [rows, new]
        flags["gradient_accumulation_steps"] = [ga, new_ga]
        effect = (f"the same effective batch ({rows * ga} rows a step), each micro-batch {rows / new:.0f}x "
                  f"smaller in memory")
        fixkind, resume = FixKind.MICRO_BATCH, "fresh"
    else:
        return None
    new_argv: list = list(argv)
    for name, (_, value) in flags.items():
        changed = set_flag(new_argv, a, name, str(value))
        if changed is None:
            return None
        new_argv = changed
    title = ", ".join(f"--{k} {v[0]} -> {v[1]}" for k, v in flags.items())
    fix = {"kind": fixkind, "reason": kind, "title": title, "changes": {f"--{k}": v for k, v in flags.items()},
           "argv": [list(argv), new_argv], "effect": effect, "ratio": None, "resume": resume}
    if resume == "fresh":
        fix["why_fresh"] = ARGV_FRESH
    return fix
