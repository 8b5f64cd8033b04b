"""What a Hugging Face script's first steps show, gathered in the script's own process for the agent's
verdicts (worker/agent/advice.py), so each verdict can name the fix in the script's own terms:

- every tokenizer call site (the user's file:line), with its padding, max_length and truncation, and
  the lengths of the examples it produced (the untruncated length of every example it cut: the
  cut ones are tokenized again without truncation, so the share cut is exact);
- the rows of the first batches handed to the model: real lengths, widths, and the rows that arrive
  at exactly the widest width with no padding (likely truncated);
- the TrainingArguments (TRL's SFTConfig included: max_length, packing) and the machine's cores;
- the lengths of every `input_ids` column a `datasets` map reads or makes (TRL tokenizes the full
  texts before its own truncation map; a cached map calls no tokenizer at all): the longest such
  column is the untruncated lengths, exact for every example;
- a data collator's `tokenizer.pad` (padding="max_length" from DataCollatorWithPadding), and each
  DataLoader the script makes (batch size, workers, file:line) for loops with no TrainingArguments;
- the first forward and backward passes timed as they happen (`passes`: those done, and the one
  running with its seconds so far), so a step that takes minutes is judged before it ends.

Sent as `info {"script": {...}}`: counts and percentiles, never the data. Stdlib only at import.
"""
from __future__ import annotations

import functools
import os
import sys
import sysconfig
import threading
import time
from typing import Optional

from tokenpulse import run

FIRST_BATCHES = 64  # micro-batches whose rows are measured (the first steps)
# Tokenizer calls are measured until the script has made this many optimizer steps; then the hook
# takes itself off (a loop that tokenizes in its collate function would pay for it every step, and
# the verdicts are made on the first steps).
TOKENIZER_UNTIL_STEPS = 16
MAX_LENGTHS = 200_000  # example lengths kept per process
FIRST_PASSES = 4  # forward/backward passes timed (the first micro-batches)
MAX_RECHECK = 5_000  # cut examples tokenized again without truncation to learn their length
SEND_EVERY_S = 2.0
ARG_NAMES = ("per_device_train_batch_size", "gradient_accumulation_steps", "dataloader_num_workers",
             "max_steps", "num_train_epochs", "use_cpu", "bf16", "fp16", "packing", "padding_free", "max_length",
             "max_seq_length", "group_by_length", "train_sampling_strategy", "logging_steps")

_lock = threading.RLock()
_busy = threading.local()  # inside our own re-tokenization: not a call of the script's
_LIB_DIRS = tuple({p for p in (sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib")) if p})
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tokenpulse/


def _is_library(path: str) -> bool:
    return (not path or path.startswith("<") or "site-packages" in path or "dist-packages" in path
            or path.startswith(_OWN_DIR) or path.startswith(_LIB_DIRS))


def user_site(depth: int = 2) -> Optional[str]:
    """file:line of the innermost frame of the script's own code (not a library's) calling us."""
    f = sys._getframe(depth)
    while f is not None:
        path = f.f_code.co_filename
        if not _is_library(path):
            return f"{os.path.basename(path)}:{f.f_lineno}"
        f = f.f_back
    return None


def percentiles(xs: list) -> dict:
    if not xs:
        return {}
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]  # noqa: E731
    return {"n": len(s), "mean": round(sum(s) / len(s), 1), "p50": pick(0.5), "p90": pick(0.9),
            "p99": pick(0.99), "max": s[-1]}


class Facts:
    def __init__(self):
        self.sites: dict = {}  # (site, padding, max_length, truncation) -> counts
        self.lengths: list = []  # example lengths from the tokenizer, untruncated where it cut
        self.rows: list = []  # real lengths of the first batches' rows
        self.widths: list = []  # padded width of each of the first batches
        self.full: dict = {}  # width -> rows at exactly that width with no padding
        self.packed = False
        self.batches = 0
        self.args: dict = {}
        self.dataset_lengths: list = []  # the longest input_ids column a datasets map read or made
        self.loaders: list = []  # DataLoaders the script made: site, batch_size, workers
        self.passes: dict = {"forward_s": [], "backward_s": []}
        self.running: Optional[tuple] = None  # (stage, perf_counter at its start) of a timed pass
        self.dirty = False
        self.sent = 0.0

    # ---- the tokenizer -------------------------------------------------------------------------
    def tokenized(self, tok, orig, args, kwargs, out, site: Optional[str], via: Optional[str] = None) -> None:
        padding = kwargs.get("padding", False)
        padding = getattr(padding, "value", padding)  # a PaddingStrategy enum
        padding = padding if isinstance(padding, str) else ("longest" if padding is True else None)
        max_length = kwargs.get("max_length")
        trunc = kwargs.get("truncation")
        trunc = bool(trunc) and trunc not in ("do_not_truncate",)
        ids = out.get("input_ids") if hasattr(out, "get") else None
        if ids is None:
            return
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        mask = out.get("attention_mask")
        if hasattr(mask, "tolist"):
            mask = mask.tolist()
        rows = ids if ids and isinstance(ids[0], list) else [ids]
        masks = mask if mask and isinstance(mask[0], list) else ([mask] if mask else None)
        lens = [sum(m) for m in masks] if masks and len(masks) == len(rows) else [len(r) for r in rows]
        key = (site, str(padding) if padding else None, max_length, trunc)
        with _lock:
            s = self.sites.setdefault(key, {"site": site, "padding": key[1], "max_length": max_length,
                                            "truncation": trunc, "calls": 0, "texts": 0, "cut": 0,
                                            **({"via": via} if via else {})})
            s["calls"] += 1
            s["texts"] += len(lens)
            cut_idx = [i for i, n in enumerate(lens) if trunc and max_length and n >= max_length]
            if cut_idx:
                texts = args[0] if args else kwargs.get("text")
                full = self._untruncated(tok, orig, texts, cut_idx, kwargs) if s["cut"] < MAX_RECHECK else None
                for i, n in zip(cut_idx, full or [None] * len(cut_idx)):
                    if n is None or n > max_length:
                        s["cut"] += 1
                        if n is not None:
                            lens[i] = n
            if len(self.lengths) < MAX_LENGTHS:
                self.lengths.extend(lens[:MAX_LENGTHS - len(self.lengths)])
            self.dirty = True
        self.maybe_send()

    @staticmethod
    def _untruncated(tok, orig, texts, idx, kwargs) -> Optional[list]:
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, (list, tuple)) or any(i >= len(texts) for i in idx):
            return None
        kw = {k: v for k, v in kwargs.items() if k in ("add_special_tokens", "is_split_into_words")}
        _busy.on = True
        try:
            got = orig(tok, [texts[i] for i in idx], truncation=False, padding=False, **kw)
            return [len(x) for x in got["input_ids"]]
        except Exception:
            return None
        finally:
            _busy.on = False

    # ---- the batches handed to the model -------------------------------------------------------
    def batch(self, inputs) -> None:
        if self.batches >= FIRST_BATCHES:
            return
        ids = inputs.get("input_ids") if hasattr(inputs, "get") else None
        if ids is None or not hasattr(ids, "shape") or len(ids.shape) != 2:
            return
        mask, pos = inputs.get("attention_mask"), inputs.get("position_ids")
        width = int(ids.shape[1])
        with _lock:
            self.batches += 1
            if pos is not None and hasattr(pos, "shape") and tuple(pos.shape) == tuple(ids.shape) \
                    and int((pos == 0).sum()) > ids.shape[0]:
                self.packed = True  # several sequences per row: rows are full by design
            if mask is not None and hasattr(mask, "shape") and tuple(mask.shape) == tuple(ids.shape):
                lens = [int(x) for x in mask.sum(dim=1).tolist()]
            else:
                lens = [width] * int(ids.shape[0])
            self.rows.extend(lens)
            self.widths.append(width)
            n_full = sum(1 for n in lens if n == width)
            if n_full:
                self.full[width] = self.full.get(width, 0) + n_full
            self.dirty = True
        self.maybe_send()

    # ---- the run's settings --------------------------------------------------------------------
    def training_args(self, args, model=None) -> None:
        got = {}
        for name in ARG_NAMES:
            v = getattr(args, name, None)
            v = getattr(v, "value", v)
            if isinstance(v, (bool, int, float, str)) or v is None:
                if hasattr(args, name):
                    got[name] = v
        got["cores"] = _cores()
        if model is not None:
            try:
                p = next(model.parameters())
                got["device"], got["dtype"] = str(p.device), str(p.dtype).replace("torch.", "")
                got["parameters"] = sum(x.numel() for x in model.parameters())
            except Exception:
                pass
        with _lock:
            self.args = got
            self.dirty = True
        self.maybe_send(force=True)

    # ---- datasets, DataLoaders ----------------------------------------------------------------
    def dataset(self, ds) -> None:
        """A datasets.Dataset a map read or made: its input_ids lengths, kept when longer than those
        kept (the column before a truncation map is the longer one)."""
        names = getattr(ds, "column_names", None)
        if not isinstance(names, list) or "input_ids" not in names or getattr(ds, "_indices", None) is not None:
            return
        import pyarrow.compute as pc
        col = ds.data.column("input_ids")
        lens = pc.list_value_length(col.slice(0, MAX_LENGTHS)).to_pylist()
        lens = [n for n in lens if n is not None]
        with _lock:
            if lens and (not self.dataset_lengths or max(lens) > max(self.dataset_lengths)):
                self.dataset_lengths = lens
                self.dirty = True
        self.maybe_send()

    def loader(self, batch_size, num_workers, site: Optional[str]) -> None:
        with _lock:
            if len(self.loaders) < 8:
                self.loaders.append({"site": site, "batch_size": batch_size, "num_workers": num_workers})
                self.dirty = True

    # ---- the first passes, timed as they happen --------------------------------------------------
    def pass_begin(self, stage: str) -> None:
        if self.running is not None or len(self.passes[stage + "_s"]) >= FIRST_PASSES:
            return
        self.running = (stage, time.perf_counter())
        self.dirty = True
        self.maybe_send(force=True)  # the agent's clock times it from here: a pass of minutes is seen running

    def pass_end(self, stage: str) -> None:
        run_ = self.running
        if run_ is None or run_[0] != stage:
            return
        self.running = None
        self.passes[stage + "_s"].append(round(time.perf_counter() - run_[1], 3))
        self.dirty = True
        self.maybe_send(force=True)

    # ---- sending -------------------------------------------------------------------------------
    def summary(self) -> dict:
        with _lock:
            # every example's length where a dataset column holds them all (exact), else the tokenizer's
            lengths = self.dataset_lengths if len(self.dataset_lengths) >= len(self.lengths) else self.lengths
            out = {"tokenizer": [dict(s) for s in list(self.sites.values())[:20]],
                   "lengths": percentiles(lengths), "args": dict(self.args), "cores": _cores()}
            if lengths is self.dataset_lengths and lengths:
                out["lengths"]["from"] = "dataset"
            limit = self.args.get("max_length") or self.args.get("max_seq_length")
            if lengths and isinstance(limit, int) and not self.args.get("packing"):
                # the script's own limit (TRL's max_length): how many examples it cuts
                out["over_limit"] = {"max_length": limit, "n": sum(1 for n in lengths if n > limit),
                                     "of": len(lengths)}
            if lengths:  # the share cut at candidate lengths, for the length/throughput choice
                out["cut_at"] = {str(L): round(sum(1 for n in lengths if n > L) / len(lengths), 4)
                                 for L in (256, 512, 768, 1024, 1536, 2048, 4096)}
            if self.loaders:
                out["loaders"] = list(self.loaders)
            if self.passes["forward_s"] or self.running:
                out["passes"] = {**{k: list(v) for k, v in self.passes.items()},
                                 "running": self.running[0] if self.running else None,
                                 "running_s": round(time.perf_counter() - self.running[1], 3) if self.running else None}
            if self.rows:
                out["batches"] = {"count": self.batches, "rows": percentiles(self.rows),
                                  "widths": percentiles(self.widths), "packed": self.packed,
                                  "full_at": {str(w): n for w, n in sorted(self.full.items())[-10:]}}
            return out

    def maybe_send(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.dirty or (not force and now - self.sent < SEND_EVERY_S):
            return
        em = run.reporter(create=False)
        if em is None:
            return
        self.sent, self.dirty = now, False
        try:
            em.info(script=self.summary())
        except Exception:
            pass  # reporting must never break the script


FACTS = Facts()


def _cores() -> Optional[int]:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def _optimizer_steps() -> int:
    """The script's optimizer steps so far (patch_torch's count; 0 before torch's optimizer loaded)."""
    pt = sys.modules.get("tokenpulse.instrument.patch_torch")
    return pt.STATE.opt_steps if pt is not None else 0


def _measuring() -> bool:
    return _optimizer_steps() < TOKENIZER_UNTIL_STEPS


def install_tokenizer(module) -> None:
    """transformers.tokenization_utils_base: every tokenizer call of the script is seen, and every
    `pad` a data collator makes (DataCollatorWithPadding pads through it)."""
    cls = module.PreTrainedTokenizerBase
    if cls.__dict__.get("_tp_patched"):
        return
    cls._tp_patched = True
    orig, orig_pad = cls.__call__, cls.pad

    @functools.wraps(orig)
    def __call__(self, *args, **kwargs):
        if getattr(_busy, "on", False):
            return orig(self, *args, **kwargs)
        _busy.on = True  # a pad inside the call is the call's own
        try:
            out = orig(self, *args, **kwargs)
        finally:
            _busy.on = False
        if not _measuring():
            if cls.__call__ is __call__:
                cls.__call__, cls.pad = orig, orig_pad  # measured enough: the script's later calls cost nothing
                FACTS.maybe_send(force=True)
            return out
        try:
            FACTS.tokenized(self, orig, args, kwargs, out, user_site())
        except Exception:
            pass  # a measurement must never break the script's tokenization
        return out

    @functools.wraps(orig_pad)
    def pad(self, *args, **kwargs):
        out = orig_pad(self, *args, **kwargs)
        if getattr(_busy, "on", False) or not _measuring():
            return out
        try:
            kw = dict(kwargs)
            kw.setdefault("padding", args[1] if len(args) > 1 else True)
            kw.setdefault("max_length", args[2] if len(args) > 2 else None)
            FACTS.tokenized(self, orig, (), kw, out, user_site(), via=_collator())
        except Exception:
            pass
        return out
    cls.__call__, cls.pad = __call__, pad


def _collator() -> Optional[str]:
    """The class name of the data collator calling tokenizer.pad (the nearest `self` named *Collator*)."""
    f = sys._getframe(2)
    while f is not None:
        obj = f.f_locals.get("self")
        if obj is not None and "Collator" in type(obj).__name__:
            return type(obj).__name__
        f = f.f_back
    return None


def _observe_after(cls, name: str, observe) -> None:
    """cls.name wrapped once: the original runs, then observe(self, out) (never breaking the script)."""
    orig = getattr(cls, name)
    if getattr(orig, "_tp", False):
        return

    @functools.wraps(orig)
    def wrapper(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        try:
            observe(self, out)
        except Exception:
            pass  # a measurement must never break the script
        return out
    wrapper._tp = True  # type: ignore[attr-defined]
    setattr(cls, name, wrapper)


def install_datasets(module) -> None:
    """datasets.arrow_dataset: each map's input and output seen for an input_ids column (lengths)."""
    _observe_after(module.Dataset, "map", lambda ds, out: (FACTS.dataset(ds), FACTS.dataset(out)))


def install_dataloader(module) -> None:
    """torch.utils.data.dataloader: each DataLoader's batch size and workers, with the script's line."""
    _observe_after(module.DataLoader, "__init__", lambda dl, _: FACTS.loader(
        getattr(dl, "batch_size", None), getattr(dl, "num_workers", 0), user_site()))
