"""One training run from spec to saved model: every automatic choice made here is emitted with its reason."""
from __future__ import annotations

import itertools
import math
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from tokenpulse.errors import SpecError
from tokenpulse.protocol import LAYOUT_FRESH, AlertKind, Failure, FixKind, JobSpec, Phase

from . import checkpoint as ckpt, losshead
from .analysis import recommend_max_len
from .autotune import autotune
from .controls import Controls
from .diskspace import looks_like_disk_full
from .distributed import broadcast, env_ranks, rank_info, setup, wrap
from .errors import EXIT_NAN, EXIT_OK, EXIT_PREEMPTED, DiskFull, is_disk_full
from .evaluation import Evaluator, cap, hold_out
from .faults import Faults
from .hub import fetch_model
from .loop import LoopState, Telemetry, linear_schedule, make_optimizer, run
from .memory import apply_test_headroom
from .modeling import count_params, load_model, load_tokenizer, supports_packing
from .packing import Layout, collate, epoch_batches, epoch_steps
from .precision import measure_peak_flops, pick_device, pick_precision
from .prepare import load_tokenized, stream_chunks
from .tokenization import Tokenized

DEFAULT_ROWS_PER_STEP = 16  # JobSpec: tokens_per_batch defaults to 16 examples' worth of real tokens
TRUNCATION_ALERT_FRAC = 0.01  # more examples cut than this is an alert, not just an info line


class Session:
    def __init__(self, spec: JobSpec, out: Path, em, controls: Controls, cache_dir: Optional[Path] = None,
                 resume: Optional[Path] = None, telemetry: bool = True, faults: Optional[Faults] = None):
        self.spec, self.out, self.em, self.controls = spec, Path(out), em, controls
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.resume = Path(resume) if resume else None
        self.telemetry = telemetry
        # Test-only faults come from TOKENPULSE_FAULT_PLAN, never from the spec.
        self.faults = faults if faults is not None else Faults.for_job(spec.name)
        self.result = None  # LoopResult, for callers in-process (tests, benchmark)
        self.ranks = env_ranks()  # rank 0 of 1 unless started by torchrun
        self.eval_data: Optional[Tokenized] = None  # held-out or separate eval examples
        self.evaluator: Optional[Evaluator] = None
        self.sample: Optional[int] = None  # tokenize only a sample of this many examples (the test run)

    # ---- setup -------------------------------------------------------------------------------
    def _model(self):
        spec, em = self.spec, self.em
        self.device, why = pick_device(spec)
        self.device = setup(self.ranks, self.device)  # joins the process group when there are ranks
        em.info(device=str(self.device), reason=why, torch_threads=torch.get_num_threads(),
                omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "default"))
        if self.ranks.on:
            em.info(**rank_info(self.ranks, self.device))  # each rank's identity, for the rank table
        fetch_model(spec, em)  # a Hub model downloads first, as its own phase with bytes done/total
        em.phase(Phase.LOADING_MODEL, detail=spec.model)
        self.tokenizer = load_tokenizer(spec)
        self.state_in = None
        weights = None
        if self.resume is not None:
            try:
                self.state_in = ckpt.load_state(self.resume)
            except FileNotFoundError as e:
                raise SpecError("resume", str(e)) from e
            weights = self.resume / "model"
        self.model = load_model(spec, self.tokenizer, self.device, weights_from=weights)
        total, trainable = count_params(self.model)
        cfg = (self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model).config
        self.cfg = cfg
        em.info(model=spec.model, params=total, trainable_params=trainable, architecture=cfg.model_type,
                attn_implementation=getattr(cfg, "_attn_implementation", None))
        em.phase(Phase.LOADING_MODEL, done=1, total=1, detail=f"{total:,} parameters")

    def _model_max(self) -> Optional[int]:
        for k in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            v = getattr(self.cfg, k, None)
            if isinstance(v, int) and v > 0:
                return v
        return None

    def _choose_max_len(self, lengths: np.ndarray) -> int:
        spec, em = self.spec, self.em
        model_max = self._model_max()
        rec = recommend_max_len(lengths, spec.length_coverage, model_max, pad_all=spec.padding == "max_length")
        if spec.max_seq_length != "auto":
            L = min(spec.max_seq_length, model_max) if model_max else spec.max_seq_length
            tr = int((lengths > L).sum())
            em.info(max_seq_length=L, reason="asked for" + (f" (clamped to the model's {model_max})"
                    if L != spec.max_seq_length else ""), truncated=tr, truncated_frac=tr / max(1, len(lengths)),
                    recommended_max_seq_length=rec)
        else:
            L = rec
            tr = int((lengths > L).sum())
            pct = float(np.percentile(lengths, spec.length_coverage)) if len(lengths) else 0
            longest = int(lengths.max()) if len(lengths) else 0
            cov = f"{spec.length_coverage:g}"
            if tr == 0 and longest > pct:
                reason = (f"covers every example: the longest has {longest} tokens and the few beyond "
                          f"p{cov} = {pct:.0f} cost little; rounded up to a multiple of 8")
            else:
                reason = (f"covers {cov}% of examples (p{cov} = {pct:.0f} tokens, rounded up to a multiple "
                          f"of 8); truncates {tr} of {len(lengths)}")
            em.info(max_seq_length=L, recommended_max_seq_length=L, truncated=tr,
                    truncated_frac=tr / max(1, len(lengths)), reason=reason)
        frac = tr / max(1, len(lengths))
        if frac > TRUNCATION_ALERT_FRAC:  # cutting many examples silently changes what the model learns
            fix = (f"max_seq_length={rec} keeps {spec.length_coverage:g}% of all {len(lengths):,} examples whole"
                   if rec > L else
                   f"the model takes at most {model_max} tokens: split or shorten the longest examples")
            em.alert("truncation", f"{tr:,} of {len(lengths):,} examples ({frac:.1%}) are longer than "
                     f"max_seq_length={L} and are cut; {fix}", severity="warning")
        return L

    def _choose_mode(self) -> str:
        spec, em = self.spec, self.em
        if spec.padding in ("dynamic", "max_length"):
            em.info(padding=spec.padding, reason="asked for")
            return spec.padding
        ok, why = supports_packing(self.model, self.device)
        if ok:
            em.info(padding="pack", reason=f"padding-free packing: {why}")
            return "pack"
        if spec.padding == "pack":
            em.alert(AlertKind.PADDING, f"packing was asked for but is unsafe for this model ({why}); "
                     "using dynamic padding", severity="warning")
        em.info(padding="dynamic", group_by_length=spec.group_by_length,
                reason=f"model cannot pack ({why}): dynamic padding (pad to the longest in each batch)")
        return "dynamic"

    def _layout(self, data: Tokenized, mode: str, max_len: int, precision: str) -> tuple[Layout, int]:
        """Micro-batch shape and grad_accum; measured when batch_size is auto."""
        spec, em = self.spec, self.em
        apply_test_headroom()  # test-only (env): real allocator failures for batches that do not fit
        lengths = np.minimum(data.lengths, max_len)
        mean = float(lengths.mean()) if len(lengths) else 1.0
        step_tokens = spec.tokens_per_batch or int(round(DEFAULT_ROWS_PER_STEP * mean))
        token_steps = mode == "pack" and spec.grad_accum == "auto"
        base = Layout(mode=mode, max_len=max_len, row_len=max_len, rows=1, group_by_length=spec.group_by_length,
                      step_tokens=step_tokens if token_steps else 0,
                      pad_multiple=8 if self.device.type == "cuda" else 1)
        why_tokens = ("asked for" if spec.tokens_per_batch else
                      f"{DEFAULT_ROWS_PER_STEP} examples of mean length {mean:.0f}")
        if spec.batch_size == "auto":
            def progress(k, n):
                em.phase(Phase.TUNING, done=k, total=n, unit="shapes")
            lay, table = autotune(self.model, data, base, step_tokens, self.tokenizer.pad_token_id,
                                  precision, self.device, spec.seed, progress)
            best = max(t["tokens_per_s"] for t in table)
            reason = (f"fastest of {len(table)} measured shapes ({best:,.0f} real tokens/s forward+backward)")
            em.info(batch_size=lay.rows, row_len=lay.row_len, reason=reason, measured=table)
        else:
            lay = replace(base, rows=spec.batch_size)
            em.info(batch_size=lay.rows, row_len=lay.row_len, reason="asked for")
        if token_steps:
            steps = epoch_steps(data, lay, spec.seed, 0)
            per_step = sum(len(st) for st in steps) / max(1, len(steps))
            lay.grad_accum = max(1, int(round(per_step)))
            em.info(grad_accum=lay.grad_accum, tokens_per_batch=step_tokens,
                    reason=f"each optimizer step takes the next ~{step_tokens:,} real tokens of examples "
                           f"({why_tokens}), packed into rows: {per_step:.2f} micro-batches per step on average")
        elif spec.grad_accum == "auto":
            mb = epoch_batches(data, lay, spec.seed, 0)
            fill = sum(int(lengths[i]) for b in mb for row in b for i in row) / max(1, len(mb))
            lay.grad_accum = max(1, int(round(step_tokens / max(fill, 1.0))))
            em.info(grad_accum=lay.grad_accum, tokens_per_batch=step_tokens,
                    reason=f"holds the effective batch at ~{step_tokens:,} real tokens per optimizer step "
                           f"({why_tokens}); {fill:,.0f} real tokens per micro-batch")
        else:
            lay.grad_accum = spec.grad_accum
            em.info(grad_accum=lay.grad_accum, reason="asked for")
        if mode == "max_length":
            waste = 1 - mean / max_len
            rec = recommend_max_len(data.lengths, spec.length_coverage, self._model_max())
            em.emit("alert", kind=AlertKind.PADDING, severity="warning",
                    message=f"padding every example to max_length={max_len} wastes {waste:.0%} of compute "
                    f"on pad tokens; use padding=auto (packing) or dynamic, or max_seq_length={rec} "
                    f"(covers {spec.length_coverage:g}% of examples)",
                    data={"fixes": [padding_fix(spec, max_len, mean, rec)],
                          "costs": [{"cause": "padding", "frac": round(waste, 3),
                                     "text": f"padding costs {waste:.0%} of each step"}]})
        return lay, step_tokens

    def _eval_split(self, data: Optional[Tokenized]) -> Optional[Tokenized]:
        """Set self.eval_data (held out from `data` by seed, or a separate dataset); returns the
        training examples."""
        spec, em = self.spec, self.em
        if spec.eval_fraction is not None and data is not None:
            data, ev = hold_out(data, spec.eval_fraction, spec.seed)
            why = f"{spec.eval_fraction:g} of the examples held out (chosen by seed {spec.seed})"
        elif spec.eval_dataset or spec.eval_split:
            # a separate local file, or another split of the same dataset
            change = ({"dataset": spec.eval_dataset, "dataset_config": None, "dataset_split": None,
                       "dataset_revision": None} if spec.eval_dataset else {"dataset_split": spec.eval_split})
            field = "eval_dataset" if spec.eval_dataset else "eval_split"
            try:
                ev, _ = load_tokenized(spec.model_copy(update=change), self.tokenizer, em, self.cache_dir,
                                       should_stop=self.controls.should_stop)
            except SpecError as e:
                raise SpecError(field if e.field in ("dataset", "dataset_split") else e.field, e.message) from e
            if ev.n == 0:
                raise SpecError(field, "the evaluation data has no examples")
            why = (f"separate dataset {spec.eval_dataset}" if spec.eval_dataset else
                   f"split {spec.eval_split!r} of the dataset")
        else:
            return data
        self.eval_data = cap(ev, spec.eval_max_examples, spec.seed)
        em.info(eval_examples=self.eval_data.n, eval_held_out=ev.n, eval_every=spec.eval_every,
                eval_every_min=spec.eval_every_min,
                reason=why + (f"; evaluating on {self.eval_data.n:,} of them (eval_max_examples)"
                              if self.eval_data.n < ev.n else ""))
        return data

    def _loss_head(self, precision: str, planned_tokens: int) -> None:
        """Rank 0 checks and measures the compiled output head and loss; every rank takes its choice."""
        fused = None
        if self.ranks.main:
            fused, why, meas = losshead.choose(self.model, precision, self.device, self.spec.torch_compile,
                                               planned_tokens)
            self.em.info(loss_head="compiled" if fused else "eager", reason=why, **meas)
        losshead.use(self.model, broadcast(self.ranks, fused))

    def _precision(self) -> str:
        if self.state_in is not None:
            p = self.state_in["precision"]
            asked = self.spec.precision
            if asked in ("bf16", "fp32") and asked != p and p != "fp16":
                # a fix changed it (server/fixes.py): the weights and optimizer state are fp32 either
                # way (autocast), so the checkpoint serves; fp16 has a loss scaler's state and stays
                self.em.info(precision=asked, reason=f"changed from {p} (the run being resumed) as the spec asks")
                return asked
            self.em.info(precision=p, reason="same as the run being resumed")
            return p
        p, why, meas = pick_precision(self.spec, self.device, getattr(self.cfg, "hidden_size", 256))
        self.em.info(precision=p, reason=why, **meas)
        return p

    # ---- run -----------------------------------------------------------------------------------
    def run(self) -> int:
        spec, em = self.spec, self.em
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()  # our phase events report progress; bars only clutter stderr
        self._model()
        if spec.streaming:
            return self._run_streaming()
        data, info = load_tokenized(spec, self.tokenizer, em, self.cache_dir, sample=self.sample,
                                    should_stop=self.controls.should_stop, faults=self.faults)
        em.info(tokenization_cache="hit" if info["cache_hit"] else "miss", examples=data.n,
                tokens=int(data.offsets[-1]), fields={k: v for k, v in info["fields"].items() if v})
        if data.n == 0:
            raise SpecError("dataset", "dataset has no examples")
        data = self._eval_split(data)
        precision = broadcast(self.ranks, self._precision() if self.ranks.main else None)
        if self.state_in is not None:
            lay = Layout(**self.state_in["layout"])
            em.info(padding=lay.mode, max_seq_length=lay.max_len, batch_size=lay.rows, row_len=lay.row_len,
                    grad_accum=lay.grad_accum, reason="same as the run being resumed")
        elif self.ranks.main:
            max_len = self._choose_max_len(data.lengths)
            mode = self._choose_mode()
            lay, _ = self._layout(data, mode, max_len, precision)
        else:
            lay = None
        # measured choices differ between processes: every rank takes rank 0's, so all build one plan
        lay = broadcast(self.ranks, lay, Layout)
        em.phase(Phase.PACKING, done=0, total=1, unit="epochs")
        per_epoch = len(epoch_steps(data, lay, spec.seed, 0))
        em.phase(Phase.PACKING, done=1, total=1, unit="epochs", detail=f"{per_epoch} optimizer steps per epoch")
        if spec.max_steps is not None and spec.epochs is None:
            total = spec.max_steps
        else:
            total = max(1, math.ceil((spec.epochs or 1) * per_epoch))
            if spec.max_steps:
                total = min(total, spec.max_steps)

        def plan() -> Iterator[tuple[int, Tokenized, list]]:
            for epoch in itertools.count():
                for step in epoch_steps(data, lay, spec.seed, epoch):
                    yield epoch, data, step

        return self._train(self._batches(plan(), lay), lay, precision, total, data)

    def _run_streaming(self) -> int:
        spec, em = self.spec, self.em
        if spec.epochs is not None and spec.max_steps is None:
            raise SpecError("max_steps", "streaming needs max_steps (the stream's length is unknown)")
        self._eval_split(None)
        precision = broadcast(self.ranks, self._precision() if self.ranks.main else None)
        chunk_tokens = 200_000

        def chunks():
            epoch = 0
            while True:
                got = False
                for c in stream_chunks(spec, self.tokenizer, em, chunk_tokens, self.cache_dir,
                                       self.controls.should_stop, faults=self.faults):
                    got = True
                    yield epoch, c
                if not got:
                    return
                epoch += 1

        it = chunks()
        try:
            epoch0, first = next(it)
        except StopIteration:
            raise SpecError("dataset", "dataset has no examples") from None
        if self.state_in is not None:
            lay = Layout(**self.state_in["layout"])
        elif self.ranks.main:
            max_len = self._choose_max_len(first.lengths)  # from the first chunk: all a stream offers
            lay, _ = self._layout(first, self._choose_mode(), max_len, precision)
        else:
            lay = None
        lay = broadcast(self.ranks, lay, Layout)

        def plan() -> Iterator[tuple[int, Tokenized, list]]:
            ci = 0
            for ep, c in itertools.chain([(epoch0, first)], it):
                em.phase(Phase.PACKING, detail=f"chunk {ci}: {c.n:,} samples")
                for step in epoch_steps(c, lay, spec.seed, ci):
                    yield ep, c, step
                ci += 1

        return self._train(self._batches(plan(), lay), lay, precision, spec.max_steps, first)

    def _batches(self, plan: Iterator[tuple[int, Tokenized, list]],
                 lay: Layout) -> Iterator[tuple[int, list[dict]]]:
        """(epoch, collated micro-batches) per optimizer step of the plan ((epoch, data, step rows) in
        order). Resuming, the same deterministic plan is walked to the saved position (data_pos steps),
        without collating the steps already trained."""
        skip = self.state_in["data_pos"] if self.state_in else 0
        pad = self.tokenizer.pad_token_id
        for k, (epoch, data, step) in enumerate(plan):
            if k >= skip:
                self.faults.at("collate", k)
                yield epoch, [collate(data, rows, lay, pad) for rows in step]

    def _train(self, batches, lay: Layout, precision: str, total: int, data: Tokenized) -> int:
        spec, em = self.spec, self.em
        model = self.model
        # the run's tokens (an upper bound without token-budget steps): does compiling pay for itself?
        self._loss_head(precision, total * (lay.step_tokens or lay.rows * lay.row_len * max(1, lay.grad_accum)))
        opt = make_optimizer(model, spec.learning_rate, spec.weight_decay, self.device)
        sched = linear_schedule(opt, spec.warmup_steps, total)
        scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
        state = LoopState()
        if self.state_in is not None:
            s = self.state_in
            opt.load_state_dict(s["optimizer"])
            sched.load_state_dict(s["scheduler"])
            if scaler is not None and s.get("scaler"):
                scaler.load_state_dict(s["scaler"])
            state = LoopState(step=s["step"], data_pos=s["data_pos"], epoch=s.get("epoch", 0))
            ckpt.set_rng_state(s["rng"])
            em.info(resumed_from=str(self.resume), step=state.step)
        else:
            torch.manual_seed(spec.seed)
        total_p, trainable = count_params(model)
        mean_len = float(np.minimum(data.lengths, lay.max_len).mean())
        n_layers = getattr(self.cfg, "num_hidden_layers", 0) or 0
        hidden = getattr(self.cfg, "hidden_size", 0) or 0
        # 6N per token (2N forward, 4N backward; frozen LoRA weights skip their weight grads: ~4N)
        # plus attention scores over the example's own context.
        fpt = (6 * total_p if trainable == total_p else 4 * total_p + 2 * trainable) + 6 * n_layers * hidden * mean_len
        peak = 0.0
        if self.telemetry and self.ranks.main:
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
            peak = measure_peak_flops(dtype, self.device)
            em.info(peak_flops=peak, flops_per_token=fpt, reason="MFU is measured against a large "
                    f"{precision} matmul on this device ({peak / 1e12:.2f} TFLOP/s)")
        tel = Telemetry(em, flops_per_token=fpt, peak_flops=peak, log_every=spec.log_every, enabled=self.telemetry)
        last_ckpt = {"t": time.monotonic()}
        ev = self.evaluator = Evaluator(spec, self.eval_data, lay, self.tokenizer, self.device, precision, em,
                                        self.controls.should_stop, self.ranks) if self.eval_data is not None else None

        def save(st: LoopState, requested: bool = False) -> Optional[Path]:
            if not self.ranks.main:
                return None  # only rank 0 saves: the ranks' weights and optimizer states are equal
            asked_by = {"SIGTERM": "preempted", "SIGUSR2": "asked for"}.get(self.controls.requested or "", "asked for")
            em.phase(Phase.SAVING, detail=f"checkpoint at step {st.step}" + (f" ({asked_by})" if requested else ""))
            try:
                p = ckpt.save(self.out, st.step, model, self.tokenizer, opt, sched,
                              {"data_pos": st.data_pos, "epoch": st.epoch, "layout": lay.to_dict(),
                               "precision": precision, "total_steps": total, "spec": spec.model_dump(mode="json")},
                              keep=spec.keep_checkpoints, scaler=scaler)
            except OSError as e:
                if is_disk_full(e):
                    raise DiskFull(self.out, f"saving a checkpoint at step {st.step}", e) from e
                raise
            asked = {}
            if requested and self.controls.requested_at is not None:  # measured: the signal to the saved checkpoint
                asked = {"requested": self.controls.requested, "request_s": round(self.controls.request_s() or 0.0, 3)}
            em.emit("checkpoint", step=st.step, path=str(p), final=False, **asked)
            last_ckpt["t"] = time.monotonic()
            return p

        def on_step(st: LoopState) -> bool:
            evaluated = ev is not None and ev.due(st.step, total)
            if evaluated:
                ev.run(model, st.step)
            due = spec.checkpoint_every and st.step % spec.checkpoint_every == 0
            due = due or (spec.checkpoint_every_min
                          and time.monotonic() - last_ckpt["t"] >= 60 * spec.checkpoint_every_min)
            if due and st.step < total:
                save(st)
            if (due or evaluated) and st.step < total:
                em.phase(Phase.TRAINING, done=st.step, total=total, unit="steps")
            return evaluated

        em.phase(Phase.TRAINING, done=state.step, total=total, unit="steps")
        res = run(wrap(self.ranks, losshead.loss_model(model), self.device), opt, sched, batches, state, total,
                  precision, self.device, tel, self.controls, self.faults, on_step=on_step, scaler=scaler,
                  ranks=self.ranks)
        self.result = res
        if res.outcome == Failure.NAN:
            em.alert(AlertKind.NAN, f"non-finite loss at step {res.step}: {res.detail}", severity="critical")
            em.emit("state", state="failed", reason=res.detail, failure=Failure.NAN, exit_code=EXIT_NAN)
            return EXIT_NAN
        if res.outcome == "cancelled":
            em.emit("state", state="cancelled", reason=f"cancelled (SIGTERM) at step {res.step}")
            return EXIT_OK
        if res.outcome == "paused":
            p = save(state, requested=True)
            took = self.controls.request_s()
            took_words = f", saved {took:.1f} s after the {self.controls.requested}" if took is not None else ""
            if self.controls.preempt:  # an unannounced SIGTERM: back to the queue, to resume from p
                em.emit("state", state="queued", failure=Failure.PREEMPTED, exit_code=EXIT_PREEMPTED,
                        reason=f"preempted: SIGTERM not sent by its agent (a scheduler's preemption, a node "
                               f"drain) at step {state.step}; checkpoint {p}{took_words}; requeued to resume from it")
                return EXIT_PREEMPTED
            em.emit("state", state="paused", reason=f"paused at step {state.step}; resume from {p}{took_words}")
            return EXIT_OK
        if ev is not None and (ev.last is None or ev.last["step"] != state.step):
            ev.run(model, state.step)  # the data ran out before the last planned step: the final eval
        if not self.ranks.main:  # rank 0 saves the final model
            em.emit("state", state="completed", reason=f"rank {self.ranks.rank}: trained {state.step} steps")
            return EXIT_OK
        em.phase(Phase.SAVING, detail="final model")
        final = self.out / "final"
        tmp = self.out / ".tmp-final"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            if hasattr(model, "merge_and_unload") and not (spec.lora and spec.lora.load_in_4bit):
                # LoRA: final/ is the merged model (loads with from_pretrained alone); the adapter beside it.
                model.save_pretrained(tmp / "adapter")
                model.merge_and_unload().save_pretrained(tmp)
            else:
                model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
        except Exception as e:
            full = looks_like_disk_full(e, self.out)
            shutil.rmtree(tmp, ignore_errors=True)
            if full:
                raise DiskFull(self.out, "saving the final model", e) from e
            raise
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        em.phase(Phase.SAVING, done=1, total=1, detail=str(final))
        em.emit("checkpoint", step=state.step, path=str(final), final=True)
        reason = f"trained {state.step} steps" + (" (data exhausted)" if res.outcome == "exhausted" else "")
        em.emit("state", state="completed", reason=reason)
        return EXIT_OK


def padding_fix(spec: JobSpec, max_len: int, mean: float, rec: int) -> dict:
    """padding=max_length measured: the fix as a spec change (packing, and the length the data needs),
    its effect the ratio of a row's tokens to its real ones (what packing recovers)."""
    changes: dict = {"padding": [spec.padding, "auto"]}
    if rec < max_len:
        changes["max_seq_length"] = [spec.max_seq_length, rec]
    ratio = max_len / max(mean, 1.0)
    return {"kind": FixKind.PADDING, "title": "pack examples into rows" + (
                f", max_seq_length {max_len} -> {rec}" if rec < max_len else ""),
            "changes": changes, "ratio": round(ratio, 2),
            "effect": f"about {ratio:.1f}x real tokens/s: {1 - mean / max_len:.0%} of each row is padding now "
                      f"(mean example {mean:.0f} of {max_len} tokens), packed rows are nearly all real tokens",
            "resume": "fresh", "why_fresh": LAYOUT_FRESH, "reason": "padding"}
