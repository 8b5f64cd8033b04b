"""One training run from spec to saved model: every automatic choice made here is emitted with its reason."""
from __future__ import annotations

import itertools
import math
import os
import time
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from tokenpulse.errors import SpecError
from tokenpulse.protocol import JobSpec, Phase

from . import checkpoint as ckpt, losshead
from .choices import Choices
from .controls import Controls
from .distributed import broadcast, env_ranks, rank_info, setup, wrap
from .errors import EXIT_OK, DiskFull, is_disk_full
from .evaluation import Evaluator, split_eval
from .faults import Faults
from .hub import fetch_model
from .loop import LoopState, Telemetry, linear_schedule, make_optimizer, run
from .modeling import count_params, flops_per_token, load_model, load_tokenizer
from .packing import Layout, collate, epoch_steps
from .precision import measure_peak_flops, pick_device
from .prepare import load_tokenized, stream_chunks
from .stopped import stopped_early
from .tokenization import Tokenized


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
        self.choices = Choices(spec, em, self.model, self.tokenizer, self.device, cfg, self.state_in,
                               self.cache_dir)

    def _eval_split(self, data: Optional[Tokenized]) -> Optional[Tokenized]:
        """Set self.eval_data (evaluation.split_eval); returns the training examples."""
        data, self.eval_data = split_eval(self.spec, data, self.tokenizer, self.em, self.cache_dir,
                                          self.controls.should_stop)
        return data

    def _loss_head(self, precision: str, planned_tokens: int) -> None:
        """Rank 0 checks and measures the compiled output head and loss; every rank takes its choice."""
        fused = None
        if self.ranks.main:
            fused, why, meas = losshead.choose(self.model, precision, self.device, self.spec.torch_compile,
                                               planned_tokens, cache_dir=self.cache_dir)
            self.em.info(loss_head="compiled" if fused else "eager", reason=why, **meas)
        losshead.use(self.model, broadcast(self.ranks, fused))

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
        precision = broadcast(self.ranks, self.choices.precision() if self.ranks.main else None)
        if self.state_in is not None:
            lay = Layout(**self.state_in["layout"])
            em.info(padding=lay.mode, max_seq_length=lay.max_len, batch_size=lay.rows, row_len=lay.row_len,
                    grad_accum=lay.grad_accum, reason="same as the run being resumed")
        elif self.ranks.main:
            max_len = self.choices.max_len(data.lengths)
            mode = self.choices.mode()
            lay, _ = self.choices.layout(data, mode, max_len, precision)
        else:
            lay = None
        # measured choices differ between processes: every rank takes rank 0's, so all build one plan
        lay = broadcast(self.ranks, lay, Layout)
        planning = Phase.layout(lay.mode)  # packing, batching or padding to max length
        em.phase(planning, done=0, total=1, unit="epochs")
        per_epoch = len(epoch_steps(data, lay, spec.seed, 0))
        em.phase(planning, done=1, total=1, unit="epochs", detail=f"{per_epoch} optimizer steps per epoch")
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
        precision = broadcast(self.ranks, self.choices.precision() if self.ranks.main else None)
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
            max_len = self.choices.max_len(first.lengths)  # from the first chunk: all a stream offers
            lay, _ = self.choices.layout(first, self.choices.mode(), max_len, precision)
        else:
            lay = None
        lay = broadcast(self.ranks, lay, Layout)

        def plan() -> Iterator[tuple[int, Tokenized, list]]:
            ci = 0
            for ep, c in itertools.chain([(epoch0, first)], it):
                em.phase(Phase.layout(lay.mode), detail=f"chunk {ci}: {c.n:,} samples")
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
        fpt = flops_per_token(model, self.cfg, float(np.minimum(data.lengths, lay.max_len).mean()))
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
        stopped = stopped_early(em, self.controls, res, state, save)
        if stopped is not None:
            return stopped
        if ev is not None and (ev.last is None or ev.last["step"] != state.step):
            ev.run(model, state.step)  # the data ran out before the last planned step: the final eval
        if not self.ranks.main:  # rank 0 saves the final model
            em.emit("state", state="completed", reason=f"rank {self.ranks.rank}: trained {state.step} steps")
            return EXIT_OK
        em.phase(Phase.SAVING, detail="final model")
        final = ckpt.save_final(self.out, model, self.tokenizer, merge_lora=not (spec.lora and spec.lora.load_in_4bit))
        em.phase(Phase.SAVING, done=1, total=1, detail=str(final))
        em.emit("checkpoint", step=state.step, path=str(final), final=True)
        reason = f"trained {state.step} steps" + (" (data exhausted)" if res.outcome == "exhausted" else "")
        em.emit("state", state="completed", reason=reason)
        return EXIT_OK
