"""Is a progressing job slow, and why? Pure logic over the job's own metrics and info events, with
the clock passed in, so each rule is testable without training anything.

Slow means progressing, but:
- throughput far below what this job showed earlier (`slow_factor` x, against its best sustained
  pace), or far below its preflight projection (`slow_projection_factor` x the autotune measurement);
- or a step time that grows steadily (`slow_growth_factor` x across the recent window, not one jump);
- or a known waste, named with its fix: padding above `slow_padding_frac` of batch tokens, the model
  on the CPU while the worker has a GPU, fp32 on a GPU with bf16, optimizer steps so large they crawl
  (`slow_step_s`), or periodic pauses every N steps costing `slow_periodic_frac` of the time.

One alert per job (kind "slow"), its message listing the reasons. Each reason has its own latch
(hysteresis.Latch): it joins the alert after holding `alert_open_s` and leaves it after staying away
`alert_clear_s`, and it is judged only on its own measurement (padding on samples that carry a padding
fraction: a throughput check without one leaves it as it was). The alert is re-sent (updated in place)
when the set of reasons changes, cleared (saying so) when none is open any more.
"""
from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass, field
from typing import Optional

from tokenpulse.diagnosis.stall import StallConfig, Verdict
from tokenpulse.protocol import AlertKind, Phase
from worker.agent.anatomy import Anatomy
from worker.agent.hysteresis import CLEAR, OPEN, Latch
from worker.agent.machine_signals import MachineSignals
from worker.agent.slow_reasons import padding_reason, periodic_share, steady_growth

# The memory blow-up's hold: two of the agent's 5 s samples (sysmetrics.EVERY_S), not the general
# alert_open_s, since the machine may run out of memory before a longer hold ends.
MEMORY_OPEN_S = 5.0


@dataclass
class Sample:
    t: float
    step: int
    step_time: float  # seconds per optimizer step over the window this sample covers
    tps: Optional[float]  # real tokens per second
    padding: Optional[float]


def _fmt_rate(x: float, tokens: bool = True) -> str:
    """A throughput in words: real tokens/s, or optimizer steps/s where the job counts no tokens."""
    if not tokens:
        return f"{x:.2f} steps/s"
    return f"{x:,.0f} tokens/s" if x >= 10 else f"{x:.2f} tokens/s"


def reason_latch(key: str, config: StallConfig) -> Latch:
    """A reason's hysteresis: it opens after holding alert_open_s and clears after alert_clear_s away."""
    open_s = config.alert_open_s
    if key == "memory":  # a doubling by a GiB does not flicker: two samples agreeing are enough
        open_s = min(open_s, MEMORY_OPEN_S)
    return Latch(open_s, config.alert_clear_s)


@dataclass
class SlowDetector:
    config: StallConfig = field(default_factory=StallConfig)
    gpu: Optional[str] = None  # the worker's accelerator (None: CPU only)
    gpu_bf16: bool = False
    info: dict = field(default_factory=dict)
    samples: list = field(default_factory=list)
    arrivals: list = field(default_factory=list)  # (t, step) of every metrics event
    pauses_at: dict = field(default_factory=dict)  # step -> phase names seen between steps (saving...)
    projected_tps: Optional[float] = None
    baseline: Optional[float] = None  # the earlier pace, frozen while a 'fell' reason is open
    contention_open: Optional[str] = None
    open_keys: Optional[frozenset] = None
    open_message: Optional[str] = None
    latches: dict = field(default_factory=dict)  # reason key -> Latch
    texts: dict = field(default_factory=dict)  # reason key -> its latest text
    contention_latch: Optional[Latch] = None
    sent_at: float = 0.0  # when the open alert's message was last sent
    fresh: bool = False
    last_step: Optional[int] = None
    anatomy: Anatomy = field(default_factory=Anatomy)  # every rank's step anatomy (input-bound, memory creep)
    owned: frozenset = frozenset()  # reasons another judge names with their fix (a command job's advice.py)
    machine: MachineSignals = field(default_factory=MachineSignals)  # GPU use, CPU waits (machine_signals.py)
    eta_s: Optional[float] = None  # the job's latest ETA (its metrics): what a cause costs in time
    periodic: Optional[tuple] = None  # the periodic stalls found: (every n steps, share of the time, phases)
    # CPU starvation among the newest reasons (check() finds it, check_contention() latches it)
    _contention: Optional[str] = field(default=None, init=False)

    # ---- feeding -----------------------------------------------------------------------------

    def observe(self, kind: str, data: dict, now: float) -> None:
        if kind == "alert" and data.get("kind") == "padding" and not data.get("clear"):
            # the training process judged its padding itself (padding=max_length: its alert, its fix,
            # the data's recommended length): one verdict and one fix, not a second in the slow alert
            self.owned = self.owned | {"padding"}
        elif kind == "info":
            self.info.update({k: v for k, v in data.items() if k != "reason"})
            if "measured" in data:
                measured = [m.get("tokens_per_s") for m in data["measured"] or [] if isinstance(m, dict)]
                rates = [r for r in measured if isinstance(r, (int, float)) and r > 0]
                if rates:
                    self.projected_tps = max(rates)
            if isinstance(data.get("projected_tokens_per_s"), (int, float)):
                self.projected_tps = float(data["projected_tokens_per_s"])
        elif kind == "phase":
            name = data.get("name")
            if name and name != Phase.TRAINING and self.last_step is not None:
                self.pauses_at.setdefault(self.last_step, set()).add(name)
        elif kind == "metrics":
            self.observe_anatomy(data, now)
            step, v = int(data.get("step", 0)), data.get("values", {})
            if self.last_step is not None and step <= self.last_step:
                return
            self.arrivals.append((now, step))
            self.last_step = step
            if len(self.arrivals) > 2000:  # bounded however long the job runs
                del self.arrivals[:1000]
                first = self.arrivals[0][1]
                self.pauses_at = {k: v for k, v in self.pauses_at.items() if k >= first - 2}
            if isinstance(v.get("eta_s"), (int, float)):
                self.eta_s = float(v["eta_s"])
            st = v.get("step_time_s")
            if st is None or not st > 0:
                return  # warm-up steps carry no speed figures
            self.samples.append(Sample(now, step, float(st), v.get("tokens_per_s"), v.get("padding_frac")))
            if len(self.samples) > 2000:
                del self.samples[:1000]
            self.fresh = True

    def observe_anatomy(self, data: dict, now: float) -> None:
        """A rank's step anatomy (any rank's metrics event; rank 0's also carries its memory)."""
        self.anatomy.observe(data, now)

    def observe_memory(self, now: float, mb: float, step: Optional[int] = None) -> None:
        """The job's process tree's RSS, as the agent samples it (the memory blow-up rule), with the
        optimizer step the job had reached (None: unknown)."""
        self.anatomy.observe_tree_rss(now, mb, step)
        self.fresh = True

    def _rates(self) -> list[float]:
        """Throughput per sample: real tokens/s when reported, else optimizer steps/s."""
        if all(s.tps for s in self.samples[-20:]):
            return [s.tps for s in self.samples if s.tps]  # earlier samples may have had no token count
        return [1.0 / s.step_time for s in self.samples]

    def _uses_tokens(self) -> bool:
        return all(s.tps for s in self.samples[-20:])

    # ---- reasons -----------------------------------------------------------------------------

    def reasons(self) -> list[tuple[str, str]]:
        c = self.config
        out: list[tuple[str, str]] = []
        n = len(self.samples)
        if n < c.slow_min_samples:
            # input-bound and memory are judged on their own samples (anatomy windows, the agent's
            # memory readings): a Trainer's speed samples come only every logging_steps
            was_open = self.open_keys or frozenset()
            return [r for r in self.anatomy.reasons(c.slow_input_frac, was_open) if r[0] not in self.owned]
        rates = self._rates()
        recent = self.samples[-3:]
        now_rate = statistics.median(rates[-3:])
        unit = functools.partial(_fmt_rate, tokens=self._uses_tokens())
        was_open = self.open_keys or frozenset()

        # throughput against the job's own earlier pace: the median of the last 5 samples (3 early
        # on) against the median of everything before them; frozen while the alert is open, so a long
        # slow stretch does not become the new normal. Hysteresis: clears at half the factor.
        w = 5 if n >= 10 else 3
        cur = statistics.median(rates[-w:])
        # frozen too while the drop waits out its hold time: else the slow samples become the baseline
        # before the alert may open, and a drop that lasts is never reported
        latches = (self.latches.get("fell"), self.contention_latch)
        pending = [x for x in latches if x is not None and x.since is not None]
        held = "fell" in was_open or bool(self.contention_open) or bool(pending)
        if not held and n >= w + 5:
            self.baseline = statistics.median(rates[:-w][-500:])
        if self.baseline and cur > 0:
            drop = self.baseline / cur
            need = c.slow_factor if not held else max(1.0, c.slow_factor / 2)
            if drop >= need:
                msg = (f"throughput fell {drop:.1f}x: {unit(cur)} now, {unit(self.baseline)} earlier in "
                       f"this job")
                starved = self.machine.starved(self.samples, w)
                if starved:
                    out.append((AlertKind.CONTENTION, f"{msg}, because {starved}"))
                else:
                    out.append(("fell", msg))

        # against the preflight projection (autotune's measured forward+backward rate)
        if self.projected_tps and self._uses_tokens() and now_rate > 0:
            below = self.projected_tps / now_rate
            need = c.slow_projection_factor if "projection" not in was_open else c.slow_projection_factor / 2
            if below >= need:
                msg = f"{unit(now_rate)} is {below:.1f}x below the preflight projection of {unit(self.projected_tps)}"
                # the projection was measured on its own: starvation against it, not against earlier
                starved = self.machine.starved(self.samples, 3, relative=False)
                if starved:
                    if not any(k == AlertKind.CONTENTION for k, _ in out):
                        out.append((AlertKind.CONTENTION, f"{msg}, because {starved}"))
                else:
                    out.append(("projection", msg))

        # steady growth of the step time (not a single jump: that is 'fell')
        g = steady_growth(self.samples, c.slow_growth_factor)
        if g is not None:
            out.append(("growth", g))

        # padding waste: judged on the last 3 padding measurements (not the last 3 samples: one
        # without a padding figure says nothing about padding); clears a tenth below the bar
        pads = [s.padding for s in self.samples[-20:] if s.padding is not None][-3:]
        need = c.slow_padding_frac * (0.9 if "padding" in was_open else 1.0)
        if pads and statistics.median(pads) > need:
            out.append(("padding", padding_reason(self.info, statistics.median(pads))))

        # the model on the CPU while the worker has a GPU
        dev = str(self.info.get("device", ""))
        if self.gpu and dev.startswith("cpu"):
            out.append(("cpu", f"the model trains on the CPU although this worker has a GPU ({self.gpu}): "
                               f"set device=auto or cuda"))

        # no mixed precision on a GPU that has bf16
        if dev.startswith("cuda") and self.info.get("precision") == "fp32" and self.gpu_bf16:
            out.append(("precision", f"training in fp32 on a GPU with bf16 ({self.gpu or 'this GPU'}): "
                                     f"precision=auto or bf16 is typically 2-3x faster"))

        # optimizer steps so large they crawl
        st = statistics.median([s.step_time for s in recent])
        if st >= c.slow_step_s:
            rows, ga = self.info.get("batch_size"), self.info.get("grad_accum")
            row_len = self.info.get("row_len") or self.info.get("max_seq_length")
            shape = ""
            if rows and ga:
                shape = f" ({rows} rows x {ga} accumulation" + (f" x {row_len} tokens" if row_len else "") + ")"
            out.append(("crawl", f"each optimizer step takes {st:.0f} s{shape}: the batch is so large that "
                                 f"steps crawl; lower tokens_per_batch / batch_size / grad_accum"))

        p = periodic_share(self.arrivals, self.pauses_at, self.config.slow_periodic_frac)
        self.periodic = p[:3] if p is not None else None
        if p is not None:
            out.append(("periodic", p[3]))

        out += self.anatomy.reasons(c.slow_input_frac, was_open)  # input-bound, memory creep
        idle = self.machine.gpu_idle(was_open) if self.samples else None
        if idle is not None:
            out.append(("gpu_idle", idle))
        return [r for r in out if r[0] not in self.owned]

    # ---- judging -----------------------------------------------------------------------------

    def _latch(self, key: str) -> Latch:
        if key not in self.latches:
            self.latches[key] = reason_latch(key, self.config)
        return self.latches[key]

    def _measured(self, key: str) -> bool:
        """Did the newest sample measure this reason? Padding is measured only by a sample that
        carries a padding fraction; the other reasons by every sample."""
        return key != "padding" or (bool(self.samples) and self.samples[-1].padding is not None)

    def check(self, now: float) -> Optional[Verdict]:
        """A 'slow' verdict when the set of open reasons appears or changes, 'slow_clear' when the last
        one clears. Slowness explained by CPU starvation alone is reported apart (check_contention)."""
        if not self.fresh and not any(x.since is not None for x in self.latches.values()):
            return None  # nothing new, and no reason waiting out its hysteresis
        fresh, self.fresh = self.fresh, False
        if fresh:
            all_reasons = self.reasons()
            rs = dict((k, t) for k, t in all_reasons if k != AlertKind.CONTENTION)
            cont = [t for k, t in all_reasons if k == AlertKind.CONTENTION]
            self._contention = cont[0] if cont else None
            self.texts.update(rs)
            for k in set(rs) | set(self.latches):
                if k in rs or self._measured(k):
                    self._latch(k).update(k in rs, now)
                elif self.latches[k].since is not None:  # not measured: its last observation goes on
                    self.latches[k].update(not self.latches[k].is_open, now)
        else:  # a clock tick: reasons keep their last observation
            for x in self.latches.values():
                if x.since is not None:
                    x.update(not x.is_open, now)
        keys = frozenset(k for k, x in self.latches.items() if x.is_open)
        rs_open = [(k, self.texts[k]) for k in self.texts if k in keys]
        message = "slow: " + "; ".join(text for _, text in rs_open)
        # updated in place: when the reasons change, and with their new numbers at most once a minute
        if keys and (keys != self.open_keys or (message != self.open_message and now - self.sent_at >= 60)):
            self.open_keys, self.open_message, self.sent_at = keys, message, now
            return Verdict(AlertKind.SLOW, self.open_message, reasons=rs_open)
        if not keys and self.open_keys:
            self.open_keys = self.open_message = None
            return Verdict("slow_clear", f"no longer slow: {self._now_rate()} at step {self.last_step}")
        return None

    def check_contention(self, now: float = 0.0) -> Optional[Verdict]:
        """'contention' when the job is slow only because other processes hold the CPUs (an info
        alert: nothing in the job to fix), 'contention_clear' when that ends. Call after check()."""
        cur = self._contention
        if self.contention_latch is None:
            self.contention_latch = Latch(self.config.alert_open_s, self.config.alert_clear_s)
        change = self.contention_latch.update(bool(cur), now)
        if change == OPEN:
            self.contention_open = cur
            return Verdict(AlertKind.CONTENTION, f"slowed by a busy machine: {cur}")
        if change == CLEAR and self.contention_open:
            self.contention_open = None
            return Verdict("contention_clear", f"the machine is no longer holding the job back: "
                                               f"{self._now_rate()} at step {self.last_step}")
        return None

    def _now_rate(self) -> str:
        return _fmt_rate(self._rates()[-1] if self.samples else 0, self._uses_tokens())
