"""Held-out evaluation: eval loss and perplexity beside train loss, and fixed prompts' generations.

The eval set is either a fraction of the training examples held out by seed (the same split on every
attempt and resume, so the curve is comparable across them) or a separate dataset with the same
fields. Loss is the token-weighted mean over the whole eval set (not a mean of batch means), so it
does not depend on how the examples are batched.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable, Optional

import numpy as np
import torch

from tokenpulse.errors import SpecError
from tokenpulse.protocol import JobSpec

from .distributed import Dist, sum_over_ranks
from .loop import forward_loss, to_device
from .packing import Layout, collate, epoch_batches
from .precision import autocast
from .prepare import load_tokenized
from .tokenization import Tokenized

SPLIT_SALT = 0xE7A1  # the held-out split's own random stream, independent of the shuffle's


def subset(data: Tokenized, idx: np.ndarray) -> Tokenized:
    """The examples at `idx` (ascending), as their own Tokenized (vectorized: no per-example loop)."""
    idx = np.asarray(idx, dtype=np.int64)
    keep = np.zeros(data.n, dtype=bool)
    keep[idx] = True
    owner = np.repeat(np.arange(data.n), data.lengths)  # example index of every token
    lens = data.lengths[idx]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return Tokenized(data.tokens[keep[owner]], offsets, data.prompt_lens[idx])


def hold_out(data: Tokenized, fraction: float, seed: int) -> tuple[Tokenized, Tokenized]:
    """(train, eval): `fraction` of the examples held out, chosen by seed; both keep file order."""
    if data.n < 2:
        raise SpecError("eval_fraction", f"eval_fraction needs at least 2 examples; the dataset has {data.n}")
    n_eval = min(data.n - 1, max(1, int(round(fraction * data.n))))
    perm = np.random.default_rng([seed, SPLIT_SALT]).permutation(data.n)
    return subset(data, np.sort(perm[n_eval:])), subset(data, np.sort(perm[:n_eval]))


def cap(data: Tokenized, limit: int, seed: int) -> Tokenized:
    """At most `limit` examples (a fixed random choice), so an eval's cost is bounded."""
    if data.n <= limit:
        return data
    pick = np.random.default_rng([seed, SPLIT_SALT, 1]).choice(data.n, limit, replace=False)
    return subset(data, np.sort(pick))

def split_eval(spec: JobSpec, data: Optional[Tokenized], tokenizer, em, cache_dir,
               should_stop: Callable[[], bool]) -> tuple[Optional[Tokenized], Optional[Tokenized]]:
    """(training examples, eval examples): held out from `data` by seed, or a separate dataset (a local
    file, or another split of the same one), capped at eval_max_examples; (data, None) without eval."""
    if spec.eval_fraction is not None and data is not None:
        data, ev = hold_out(data, spec.eval_fraction, spec.seed)
        why = f"{spec.eval_fraction:g} of the examples held out (chosen by seed {spec.seed})"
    elif spec.eval_dataset or spec.eval_split:
        # a separate local file, or another split of the same dataset
        change = ({"dataset": spec.eval_dataset, "dataset_config": None, "dataset_split": None,
                   "dataset_revision": None} if spec.eval_dataset else {"dataset_split": spec.eval_split})
        field = "eval_dataset" if spec.eval_dataset else "eval_split"
        try:
            ev, _ = load_tokenized(spec.model_copy(update=change), tokenizer, em, cache_dir, should_stop=should_stop)
        except SpecError as e:
            raise SpecError(field if e.field in ("dataset", "dataset_split") else e.field, e.message) from e
        if ev.n == 0:
            raise SpecError(field, "the evaluation data has no examples")
        why = (f"separate dataset {spec.eval_dataset}" if spec.eval_dataset else
               f"split {spec.eval_split!r} of the dataset")
    else:
        return data, None
    eval_data = cap(ev, spec.eval_max_examples, spec.seed)
    em.info(eval_examples=eval_data.n, eval_held_out=ev.n, eval_every=spec.eval_every,
            eval_every_min=spec.eval_every_min,
            reason=why + (f"; evaluating on {eval_data.n:,} of them (eval_max_examples)"
                          if eval_data.n < ev.n else ""))
    return data, eval_data


class Evaluator:
    """Runs one evaluation: `evaluating n/total batches`, then `eval/loss` + `eval/ppl` metrics at the
    step, then the prompts' greedy generations as an `info` event (eval_generations).

    Under torchrun each rank evaluates its share of the batches (every world-th one) and the loss
    sums meet in one all_reduce: an evaluation takes 1/world of the time, with the same result."""

    def __init__(self, spec: JobSpec, data: Tokenized, layout: Layout, tokenizer, device: torch.device,
                 precision: str, em, should_stop: Callable[[], bool] = lambda: False, ranks: Dist = Dist()):
        self.spec, self.tokenizer, self.device, self.precision, self.em = spec, tokenizer, device, precision, em
        self.data = data
        # Same row shape as training (packing when training packs), one micro-batch at a time, no grads.
        self.layout = replace(layout, step_tokens=0, grad_accum=1)
        self.ranks = ranks
        self.batches = epoch_batches(data, self.layout, spec.seed, 0)[ranks.rank::ranks.world]
        self.should_stop = should_stop
        self.last: Optional[dict] = None
        self._t = time.monotonic()

    def due(self, step: int, total: int) -> bool:
        """Every eval_every steps, every eval_every_min minutes, and at the last step."""
        s = self.spec
        if step >= total:
            return True
        if s.eval_every and step % s.eval_every == 0:
            return True
        return bool(s.eval_every_min and time.monotonic() - self._t >= 60 * s.eval_every_min)

    @torch.no_grad()
    def run(self, model, step: int) -> Optional[dict]:
        """Evaluate now; returns {"eval/loss", "eval/ppl"} (None if cancelled midway)."""
        em, total = self.em, len(self.batches)
        was_training = model.training
        model.eval()
        loss_sum, targets, last_tick = 0.0, 0, 0.0
        try:
            em.phase("evaluating", done=0, total=total, unit="batches", detail=f"at step {step}")
            pending = []
            for k, rows in enumerate(self.batches):
                b = collate(self.data, rows, self.layout, self.tokenizer.pad_token_id)
                targets += b["n_targets"]
                pending.append(forward_loss(model, to_device(b, self.device), self.precision, self.device))
                now = time.monotonic()
                if now - last_tick >= 0.5 or k + 1 == total:
                    loss_sum += float(torch.stack(pending).sum())  # one host sync per progress tick
                    pending = []
                    em.phase("evaluating", done=k + 1, total=total, unit="batches")
                    last_tick = now
                    # (under torchrun the ranks must all reach the all_reduce below: a stop waits
                    # for the end of this shard, a fraction of one evaluation)
                    if not self.ranks.on and self.should_stop():
                        return None
            if self.ranks.on:
                both = sum_over_ranks(self.ranks, torch.tensor([loss_sum, float(targets)], dtype=torch.float64,
                                                               device=self.device))
                loss_sum, targets = float(both[0]), int(both[1])
            loss = loss_sum / max(1, targets)
            vals = {"eval/loss": loss, "eval/ppl": math.exp(min(loss, 80.0))}
            em.metrics(step, **vals)
            if self.spec.eval_prompts and self.ranks.main:  # shown once: rank 0's
                em.info(eval_step=step, eval_generations=self.generate(model))
            self.last = {"step": step, **vals}
            return vals
        finally:
            self._t = time.monotonic()
            model.train(was_training)

    @torch.no_grad()
    def generate(self, model) -> list[dict]:
        """Greedy continuations of the fixed prompts (bounded new tokens each)."""
        tok, out = self.tokenizer, []
        for prompt in self.spec.eval_prompts:
            ids = tok(prompt, return_tensors="pt")["input_ids"].to(self.device)
            with autocast(self.device, self.precision):
                gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=self.spec.eval_max_new_tokens,
                                     pad_token_id=tok.pad_token_id, use_cache=True)
            out.append({"prompt": prompt, "output": tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)})
        return out
