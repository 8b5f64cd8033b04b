"""What a command job's instrumentation reported about its first optimizer steps, and the facts the
verdicts read from it (advice.py: the rules over these facts; quiet.py: its silence).

Fed by the agent from the job's events (`observe`) and output lines (`output`): the script's
tokenizer calls, batches and TrainingArguments, each step's speed and padding, the step anatomy's
data-wait share, the model loaded."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional

from tokenpulse.diagnosis.stall import StallConfig
from worker.agent import anatomy
from worker.agent.quiet import QuietWatch

FIRST_STEPS = 3  # steps judged on; a verdict comes by the third optimizer step at the latest


@dataclass
class StepSample:
    step: int
    step_time: float
    padding: Optional[float]
    eta_s: Optional[float]


@dataclass
class FirstSteps:
    config: StallConfig = field(default_factory=StallConfig)
    gpu: Optional[str] = None
    gpu_bf16: bool = False
    script: dict = field(default_factory=dict)  # the latest info {"script": ...} from the process
    info: dict = field(default_factory=dict)  # other info (the Trainer callback's max_steps...)
    steps: list = field(default_factory=list)  # StepSample of the first steps
    # the share of a step waiting for data, from the startup hook's step anatomy (every few seconds,
    # per rank: the DataLoader's __next__ timed, the one data-wait signal), its first windows
    data_shares: list = field(default_factory=list)
    model: Optional[str] = None  # what from_pretrained loaded (its 'loading model' phase)
    # the first forward/backward pass still running: (stage, when it began on the agent's clock)
    running: Optional[tuple] = None
    now: Optional[float] = None  # the agent's clock at the last check (a running pass's seconds so far)
    quiet: QuietWatch = field(init=False)  # the 'quiet' warning (quiet.py)

    def __post_init__(self) -> None:
        self.quiet = QuietWatch(getattr(self.config, "quiet_s", 60.0))

    # ---- feeding -----------------------------------------------------------------------------

    def observe(self, kind: str, data: dict, now: float) -> None:
        if kind == "info":
            if isinstance(data.get("script"), dict):
                self.script = data["script"]
                p = self.script.get("passes") or {}
                stage = p.get("running")
                if not stage:
                    self.running = None
                elif self.running is None or self.running[0] != stage:
                    self.running = (stage, now - float(p.get("running_s") or 0))
            self.info.update({k: v for k, v in data.items() if k != "script"})
        elif kind == "phase":
            self.quiet.phase = data
            if data.get("name") == "loading model" and data.get("detail"):
                self.model = str(data["detail"]).split(": ")[0][:500]
        elif kind == "metrics":
            v = data.get("values") or {}
            self._observe_anatomy(v)
            st = v.get("step_time_s")
            step = int(data.get("step", 0))
            if not isinstance(st, (int, float)) or st <= 0 or len(self.steps) >= 50:
                return
            if self.steps and step <= self.steps[-1].step:
                return
            self.steps.append(StepSample(step, float(st), v.get("padding_frac"), v.get("eta_s")))

    def _observe_anatomy(self, values: dict) -> None:
        """The worst rank's data-wait share of a step from one anatomy window (anatomy.parse)."""
        if len(self.data_shares) >= FIRST_STEPS + 2:
            return
        shares = [p["data_s"] / p["step_s"] for p in anatomy.parse(values).values()
                  if p.get("data_s") is not None and p.get("step_s")]
        if shares:
            self.data_shares.append(max(shares))

    def output(self, line: str) -> None:
        self.quiet.output(line)

    # ---- the facts ---------------------------------------------------------------------------

    @property
    def args(self) -> dict:
        return self.script.get("args") or {}

    def _group_arg(self) -> str:
        return ('train_sampling_strategy="group_by_length"' if "train_sampling_strategy" in self.args
                else "group_by_length=True")

    def _lengths(self) -> dict:
        """Example lengths: the tokenizer's (untruncated) when seen, else the batches' rows."""
        return self.script.get("lengths") or (self.script.get("batches") or {}).get("rows") or {}

    def _padding(self) -> Optional[float]:
        pads = [s.padding for s in self.steps[:FIRST_STEPS + 2] if s.padding is not None]
        if pads:
            return statistics.median(pads)
        b = self.script.get("batches") or {}
        rows, widths = b.get("rows") or {}, b.get("widths") or {}
        if rows.get("mean") and widths.get("mean"):
            return max(0.0, 1 - rows["mean"] / widths["mean"])
        return None

    def _pad_site(self) -> Optional[dict]:
        sites = [s for s in self.script.get("tokenizer") or [] if s.get("padding") == "max_length"]
        return max(sites, key=lambda s: s.get("texts", 0)) if sites else None

    def _cut_site(self) -> Optional[dict]:
        sites = [s for s in self.script.get("tokenizer") or [] if s.get("truncation") and s.get("cut")]
        return max(sites, key=lambda s: s.get("cut", 0)) if sites else None

    def _data_share(self) -> Optional[float]:
        return statistics.median(self.data_shares) if self.data_shares else None

    def _step_time(self) -> Optional[float]:
        xs = [s.step_time for s in self.steps[:FIRST_STEPS]]
        if len(xs) >= 2 or (xs and xs[0] >= 3 * self._crawl_s()):
            return statistics.median(xs)
        if not xs:
            est = self._pass_estimate()
            if est is not None and est[0] >= 1.5 * self._crawl_s():
                return est[0]  # a first pass this long: the step crawls, judged before it ends
        return None

    def micro_batches(self) -> int:
        return int(self.args.get("gradient_accumulation_steps") or 1)

    def _pass_estimate(self) -> Optional[tuple[float, str, bool]]:
        """An optimizer step's seconds from its first forward and backward passes, before it ends:
        (forward + backward) x micro-batches per step once both ran; 3 x forward (a backward costs
        about twice its forward) once the forward ran; a pass still running: its seconds so far (a
        lower bound). With the words that say which, and whether it is a lower bound."""
        p = self.script.get("passes") or {}
        fwd, bwd, ga = p.get("forward_s") or [], p.get("backward_s") or [], self.micro_batches()
        per = f" x {ga} micro-batches" if ga > 1 else ""
        if fwd and bwd:
            n = min(len(fwd), len(bwd))
            mb = statistics.median(f + b for f, b in zip(fwd[:n], bwd[:n]))
            return mb * ga, f"its first forward and backward took {mb:.0f} s{per}", False
        if self.running is None or self.now is None:
            if fwd:
                words = f"its first forward took {fwd[0]:.0f} s (a backward costs about twice that){per}"
                return 3 * fwd[0] * ga, words, False
            return None
        so_far = max(0.0, self.now - self.running[1])
        if self.running[0] == "forward":
            return so_far * ga, f"its first forward has run {so_far:.0f} s and not ended{per}", True
        f = fwd[0] if fwd else 0.0
        words = f"its first forward took {f:.0f} s, its backward has run {so_far:.0f} s{per}"
        if 3 * f > f + so_far:  # the backward's usual twice the forward, not reached yet
            return 3 * f * ga, words + " (a backward costs about twice its forward)", False
        return (f + so_far) * ga, words, True

    def _crawl_s(self) -> float:
        return self.config.slow_step_s / 2  # a first step this long: the batch is far too large
