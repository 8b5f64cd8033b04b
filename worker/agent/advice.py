"""Verdicts on a command job's first optimizer steps, each naming the fix in the script's own terms.

Pure logic over what the job's instrumentation reports (tokenpulse/instrument/firststeps.py: the
tokenizer calls and the lengths they made, the first batches' rows, the TrainingArguments; the
Trainer callback's per-step speed from step 1), with the clock passed in, so every rule is testable
without training anything. One alert per condition, opened once it is judged:

- padding      most of each batch is pad tokens: the tokenizer call (file:line) that pads to
               max_length, the length that covers the data (from the lengths seen), group by length;
- truncation   examples cut at max_length, counted (exactly where the tokenizer or TRL's max_length
               is seen, else rows arriving at exactly the widest width unpadded: likely cut), with the
               length/throughput comparison to choose from (`tokenpulse analyze --measure`);
- batch        optimizer steps so large they crawl (the ETA from step 1): smaller micro-batches with
               accumulation;
- dataloader   more DataLoader workers than cores (they only contend), or steps waiting for data;
- placement    training on the CPU on a machine with a GPU; precision: fp32 on a GPU with bf16;
- quiet        a finished phase and nothing since (quiet.py: the one verdict judged on silence, not on
               the first steps).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from worker.agent.first_steps import FIRST_STEPS, FirstSteps

ESTIMATE = "before its first step ended"  # a batch verdict judged from the first passes
OWNED = frozenset({"padding", "crawl"})  # the slow detector's generic reasons these verdicts replace


def ceil_to(n: float, m: int) -> int:
    return int(math.ceil(n / m) * m)


def _n(x) -> str:
    return f"{x:,.0f}" if isinstance(x, (int, float)) else str(x)


def _dur(s: float) -> str:
    if s >= 5400:
        return f"{s / 3600:.0f} h"
    if s >= 90:
        return f"{s / 60:.0f} min"
    return f"{s:.0f} s"


@dataclass
class Advisor(FirstSteps):
    """The verdicts, over the facts its FirstSteps gathered (first_steps.py)."""
    open: dict = field(default_factory=dict)  # kind -> message sent

    # ---- the verdicts ------------------------------------------------------------------------

    def verdicts(self) -> dict:
        """kind -> message, for every condition that holds now."""
        if not self.steps and not (self.script.get("batches") or {}).get("count") \
                and not (self.script.get("passes") or {}).get("forward_s") and self.running is None:
            return {}  # judged once training has begun: the first steps
        out = {}
        for kind, rule in (("padding", self._padding_verdict), ("truncation", self._truncation_verdict),
                           ("batch", self._batch_verdict), ("dataloader", self._dataloader_verdict),
                           ("placement", self._placement_verdict), ("precision", self._precision_verdict)):
            msg = rule()
            if msg:
                out[kind] = msg
        return out

    def _padding_verdict(self) -> Optional[str]:
        frac = self._padding()
        if frac is None or frac <= self.config.slow_padding_frac or (self.script.get("batches") or {}).get("packed"):
            return None
        L = self._lengths()
        longest = L.get("max")
        fit = ceil_to(longest, 8) if longest else None
        cover = ""
        if fit and longest:
            cover = f"max_length={fit} covers every example (the longest has {longest:,} tokens)"
            if fit > 512:
                cover += f", or {ceil_to(longest, 512)} for a round number"
        shape = (f"examples: median {L['p50']:,}, p99 {L['p99']:,}, longest {longest:,} tokens"
                 if L.get("p50") is not None else "")
        data = self._data_share()
        data_s = ""
        if data is not None:
            workers = self.args.get("dataloader_num_workers")
            data_s = (f"; data loading is {data:.0%} of each step" +
                      (f" (dataloader_num_workers={workers})" if workers is not None else ""))
        site = self._pad_site()
        if site and site.get("via"):  # a data collator pads every batch (tokenizer.pad)
            where, via = site.get("site") or "the training loop", site["via"]
            msg = (f"padding: {frac:.0%} of every batch is pad tokens: the data collator {via} called at {where} pads "
                   f"every batch to max_length={site.get('max_length')} (padding=\"max_length\")"
                   + (f"; {shape}" if shape else "") + data_s +
                   f"\nFix: drop padding=\"max_length\" from {via}(...) so it pads each batch to its longest "
                   f"example ({via}(tokenizer)), with {self._group_arg()} so similar lengths share a batch")
            return msg + (f"; {cover}" if cover else "")
        if site:
            where = site.get("site") or "the tokenize function"
            msg = (f"padding: {frac:.0%} of every batch is pad tokens: the tokenizer call at {where} pads every "
                   f"example to max_length={site.get('max_length')} (padding=\"max_length\")"
                   + (f"; {shape}" if shape else "") + data_s +
                   f"\nFix: drop padding=\"max_length\" at {where} and let the data collator pad each batch to "
                   f"its longest example (DataCollatorWithPadding / DataCollatorForLanguageModeling), with "
                   f"{self._group_arg()} in TrainingArguments so similar lengths share a batch, or pack")
            return msg + (f"; {cover}" if cover else "")
        msg = (f"padding: {frac:.0%} of every batch is pad tokens: batches are padded to their longest row and "
               f"the lengths vary" + (f" ({shape})" if shape else "") + data_s +
               f"\nFix: {self._group_arg()} in TrainingArguments so similar lengths share a batch, "
               f"or pack (packing=True in TRL's SFTConfig)")
        width = (self.script.get("batches") or {}).get("widths", {}).get("max")
        if fit and width and width > fit:
            msg += f"; {cover}"
        return msg

    def _truncation_verdict(self) -> Optional[str]:
        L = self._lengths()
        shape = (f"lengths: median {L['p50']:,}, p90 {L['p90']:,}, longest {L['max']:,} tokens"
                 if L.get("p50") is not None else "")
        over = self.script.get("over_limit") or {}
        site = self._cut_site()
        if over.get("n") and over.get("of"):
            limit, n, of, exact = over["max_length"], over["n"], over["of"], True
            where = "max_length in the trainer's config (TRL's SFTConfig)" if "max_length" in self.args \
                else "max_seq_length"
            arg = "max_length" if "max_length" in self.args else "max_seq_length"
        elif site:
            limit, n, of, exact = site.get("max_length"), site["cut"], site.get("texts", 0), True
            where, arg = f"the tokenizer call at {site.get('site') or 'the tokenize function'} (truncation=True)", \
                "max_length"
        else:
            b = self.script.get("batches") or {}
            if b.get("packed") or not b.get("full_at") or not (b.get("rows") or {}).get("n"):
                return None
            limit = self.args.get("max_length") or self.args.get("max_seq_length") or \
                max((s.get("max_length") or 0 for s in self.script.get("tokenizer") or []), default=0)
            if not limit:
                return None
            n, of, exact = b["full_at"].get(str(limit), 0), b["rows"]["n"], False
            where, arg = f"max_length={limit}", "max_length"
        if not of or n / of < 0.01:
            return None
        share = n / of
        cut_at = self.script.get("cut_at") or {}
        table = ", ".join(f"{k}: {v:.0%}" for k, v in cut_at.items() if 0 < int(k) <= 2 * (L.get("max") or limit))
        keep = ceil_to(L["max"], 8) if exact and L.get("max") else None
        keep99 = ceil_to(L["p99"], 8) if exact and L.get("p99") and L["p99"] > limit else None
        head = (f"truncation: {n:,} of {of:,} examples ({share:.0%}) are longer than max_length={limit} and are cut by "
                f"{where}" if exact else
                f"truncation: {n:,} of the first {of:,} rows ({share:.0%}) arrive at exactly max_length={limit} with "
                f"no padding: likely cut")
        if shape:
            head += f" ({shape})"
        if table:
            head += f"; share cut at each length: {table}"
        fix = (f"\nFix: {arg}={keep} keeps every example" if keep else
               f"\nFix: a larger {arg} keeps them")
        if keep and keep99 and keep99 < keep:
            fix += f" ({arg}={keep99} keeps 99% of them: the 99th percentile, rounded up)"
        fix += (" (longer rows: fewer tokens/s); to choose, measure length against throughput side by side: "
                "tokenpulse analyze --dataset <your data> --model " + (self.model or "<your model>") + " --measure 60")
        return head + fix

    def _batch_verdict(self) -> Optional[str]:
        st = self._step_time()
        if st is None or st < self._crawl_s():
            return None
        a = self.args
        loader = self._loader()
        rows = a.get("per_device_train_batch_size") or (loader or {}).get("batch_size")
        ga = a.get("gradient_accumulation_steps") or 1
        b = self.script.get("batches") or {}
        width = (b.get("widths") or {}).get("p50")
        # rows the model is handed per micro-batch: padding-free packing (TRL) flattens the rows into one
        per_batch = round(b["rows"]["n"] / b["count"]) if b.get("count") and (b.get("rows") or {}).get("n") else rows
        shape = ""
        if rows:
            acc = f" x {ga} accumulation" if ga > 1 else ""
            if width and per_batch and per_batch < rows:
                packed = f"{per_batch} row{'s' if per_batch > 1 else ''}"
                shape = (f" ({rows} rows{acc}, packed into {packed} of {width:,} "
                         f"tokens: {per_batch * ga * width:,} tokens a step)")
            else:
                tokens = f" x {width:,} tokens = {rows * ga * width:,} tokens a step" if width else ""
                shape = f" ({rows} rows{acc}{tokens})"
        params = a.get("parameters")
        dev = a.get("device")
        on_device = f" on the {dev.split(':')[0].upper()}" if dev else ""
        model = (f" for a {params / 1e6:.1f}M-parameter model" if params else "") + on_device
        etas = [s.eta_s for s in self.steps[:FIRST_STEPS] if s.eta_s]
        eta = f"; at this pace the run takes {_dur(etas[-1])} more (ETA from step {self.steps[0].step})" if etas else ""
        est = self._pass_estimate() if not self.steps else None
        took = (f"{st:.0f} s" if est is None else
                f"{'at least' if est[2] else 'about'} {st:.0f} s ({ESTIMATE}: {est[1]})")
        msg = f"batch: each optimizer step takes {took}{shape}{model}: the work per step is far too large{eta}"
        if rows and rows > 1 and "per_device_train_batch_size" not in a and loader:
            new_rows, new_ga = max(1, rows // 4), ga * 2
            msg += (f"\nFix: batch_size={new_rows} in the DataLoader at {loader.get('site') or 'the script'} with "
                    f"{new_ga} micro-batches accumulated a step "
                    f"({new_rows * new_ga} rows a step instead of {rows * ga})")
        elif rows and rows > 1:
            new_rows, new_ga = max(1, rows // 4), ga * 2
            msg += (f"\nFix: per_device_train_batch_size={new_rows}, gradient_accumulation_steps={new_ga} "
                    f"({new_rows * new_ga} rows a step instead of {rows * ga}: "
                    f"about {st * new_rows * new_ga / (rows * ga):.0f} s a step)")
        else:
            msg += "\nFix: a shorter max_length, or fewer tokens per step"
        return msg

    def _dataloader_verdict(self) -> Optional[str]:
        a = self.args
        workers, cores = a.get("dataloader_num_workers"), a.get("cores") or self.script.get("cores")
        loader = self._loader() if "dataloader_num_workers" not in a else None
        if loader:
            workers = loader.get("num_workers")
        if isinstance(workers, int) and cores and workers > cores:
            fix = (f"num_workers={cores} in the DataLoader at {loader.get('site') or 'the script'}" if loader
                   else f"dataloader_num_workers={cores}")
            return (f"dataloader: {workers} DataLoader workers on {cores} cores: workers beyond the cores only "
                    f"contend with the training for them\nFix: {fix}")
        share = self._data_share()
        if share is not None and share >= 0.3 and len(self.steps) >= 2:
            fix = f"dataloader_num_workers={min(2, cores or 2)}" if not workers else "pre-tokenize the data"
            return (f"dataloader: {share:.0%} of each step waits for its batches"
                    + (f" (dataloader_num_workers={workers})" if workers is not None else "")
                    + f"\nFix: {fix}")
        return None

    def _placement_verdict(self) -> Optional[str]:
        dev = str(self.args.get("device") or "")
        if self.gpu and (dev.startswith("cpu") or self.args.get("use_cpu")):
            return (f"placement: the model trains on the CPU although this machine has a GPU ({self.gpu})"
                    f"\nFix: drop use_cpu=True from TrainingArguments (and any .to(\"cpu\"))")
        return None

    def _precision_verdict(self) -> Optional[str]:
        a = self.args
        if self.gpu_bf16 and str(a.get("device") or "").startswith("cuda") and a.get("dtype") == "float32" \
                and not a.get("bf16") and not a.get("fp16"):
            return (f"precision: training in fp32 on a GPU with bf16 ({self.gpu})\nFix: bf16=True in "
                    f"TrainingArguments (typically 2-3x faster)")
        return None

    def _loader(self) -> Optional[dict]:
        """The script's own DataLoader (the one with the most workers) when it made any."""
        loaders = [x for x in self.script.get("loaders") or [] if isinstance(x.get("batch_size"), int)]
        return max(loaders, key=lambda x: x.get("num_workers") or 0) if loaders else None

    def check(self, now: Optional[float] = None) -> list[tuple[str, str]]:
        """(kind, message) for each verdict that is new or whose text changed; now: the agent's clock
        (a first pass still running is judged by its seconds so far)."""
        if now is not None:
            self.now = now
        out = []
        for kind, msg in self.verdicts().items():
            if kind in self.open and ESTIMATE in msg:
                continue  # a running pass's estimate grows each tick: sent once, then the measured step
            if self.open.get(kind) != msg and (kind not in self.open or _moved(self.open[kind], msg)):
                self.open[kind] = msg
                out.append((kind, msg))
        return out

def _moved(old: str, new: str) -> bool:
    """Re-send an open verdict only when its text changed beyond its numbers' noise: the first
    numbers differ by more than a few percent, or the words changed."""
    import re
    num = re.compile(r"[\d,]+(?:\.\d+)?")
    if num.sub("#", old) != num.sub("#", new):
        return True
    def numbers(text: str) -> list[float]:
        return [float(x.replace(",", "") or 0) for x in num.findall(text)]
    a, b = numbers(old), numbers(new)
    return any(abs(x - y) > 0.1 * max(abs(x), abs(y), 1) for x, y in zip(a, b))
