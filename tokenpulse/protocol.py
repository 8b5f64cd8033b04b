"""The one vocabulary that crosses every boundary: job specs, events, job states.

Imported by the training process, the agent, the server's storage, REST and websockets, so the
shapes cannot drift apart. Imports nothing heavy (pydantic only): the server never loads torch.
"""
from __future__ import annotations

import enum
import os
import re
import shlex
from typing import Annotated, Any, Final, Literal, Optional, TypedDict, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

BUILTIN_MODEL = "builtin:tiny-llama"
BUILTIN_DATASET = "builtin:demo"


class JobState(str, enum.Enum):
    queued = "queued"
    starting = "starting"
    running = "running"
    paused = "paused"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"


ACTIVE_STATES = {JobState.starting, JobState.running}
FINAL_STATES = {JobState.completed, JobState.failed, JobState.cancelled}


# ---- named kinds: failures, alerts, phases, commands, job kinds ------------------------------------
# Plain str constants (not enums): they go into SQLite columns, JSON and f-strings unchanged.

FailureKind = Literal["oom", "nan", "crash", "lost", "signal", "hang", "spec", "disk_full", "error", "data",
                      "preempted", "collective_timeout", "timeout", "node_fail", "cancelled_outside"]


class Failure:
    """Why an attempt failed (jobs.failure, attempts.failure, StateData.failure)."""
    OOM: FailureKind = "oom"  # out of memory: retried with half the micro-batch
    NAN: FailureKind = "nan"  # non-finite loss
    CRASH: FailureKind = "crash"  # the training process died of an exception or an unknown exit
    LOST: FailureKind = "lost"  # its agent went silent, shut down, or lost the claim
    SIGNAL: FailureKind = "signal"  # killed by a signal
    HANG: FailureKind = "hang"
    SPEC: FailureKind = "spec"  # the spec cannot run (a missing file, a bad field)
    DISK_FULL: FailureKind = "disk_full"
    ERROR: FailureKind = "error"  # a command job exited non-zero (its script's own failure)
    DATA: FailureKind = "data"  # a data error naming its row/index/line: never retried (it fails the same way)
    # SIGTERM from outside (a scheduler's preemption, a node drain): checkpointed and requeued, no retry spent
    PREEMPTED: FailureKind = "preempted"
    # a collective (NCCL/gloo) timed out: transient, retried like a crash (a class, refined from a crash)
    COLLECTIVE_TIMEOUT: FailureKind = "collective_timeout"
    # Slurm's endings (worker/agent/slurm_executor.py), sent with retry=True where a rerun from the
    # newest checkpoint makes sense (timeout, preempted, node_fail); a cancel from outside is final
    TIMEOUT: FailureKind = "timeout"  # the allocation's time limit ran out before a checkpoint
    NODE_FAIL: FailureKind = "node_fail"
    CANCELLED_OUTSIDE: FailureKind = "cancelled_outside"  # scancel by someone else, not tokenpulse



class AlertKind:
    """The alert kinds tokenpulse raises. AlertData.kind stays a str: an instrumented script or the
    explicit API may raise alerts of its own kinds; ours use these names."""
    STALLED = "stalled"
    SLOW = "slow"
    CONTENTION = "contention"
    CRASHED = "crashed"
    NAN = "nan"
    OOM = "oom"
    WORKER_LOST = "worker_lost"
    PADDING = "padding"
    # verdicts on a command job's first steps, each naming its fix (worker/agent/advice.py)
    TRUNCATION = "truncation"
    BATCH = "batch"
    DATALOADER = "dataloader"
    PLACEMENT = "placement"
    PRECISION = "precision"
    QUIET = "quiet"  # a finished phase and nothing since: a warning, not a stall
    STRAGGLER = "straggler"  # one rank of a distributed job works far longer per step than the others
    DISK_FULL = "disk_full"
    DATABASE_LOCKED = "database_locked"  # webhooks only: the database cannot store it


class Phase:
    """The native training process's phase names. PhaseData.name stays a str: instrumented scripts
    and the explicit API report phases of their own names. The server's logic reads TRAINING."""
    LOADING_MODEL = "loading model"
    LOADING_DATASET = "loading dataset"
    TOKENIZING = "tokenizing"
    ACCUMULATING = "accumulating"
    TUNING = "tuning batch size"
    # the batch plan, named by what the layout does to the rows (Phase.layout)
    PACKING = "packing"
    BATCHING = "batching"  # dynamic padding: each micro-batch padded to its longest row
    PADDING_TO_MAX = "padding to max length"
    TRAINING = "training"
    EVALUATING = "evaluating"
    SAVING = "saving"
    SLURM_PENDING = "pending in Slurm"  # the Slurm executor's word while Slurm holds the job (its reason)

    @staticmethod
    def layout(mode: str) -> str:
        """The batch plan's phase for a padding mode ("pack", "dynamic", "max_length"): a run that
        packs nothing never says "packing"."""
        return {"pack": Phase.PACKING, "dynamic": Phase.BATCHING}.get(mode, Phase.PADDING_TO_MAX)


CommandAction = Literal["cancel", "pause", "stack"]


class Action:
    """What the server asks an agent to do with a job (Command.action)."""
    CANCEL: CommandAction = "cancel"
    PAUSE: CommandAction = "pause"
    STACK: CommandAction = "stack"


JobKind = Literal["train", "command", "external"]
TRAIN: JobKind = "train"  # JobSpec: tokenpulse's own training process
COMMAND: JobKind = "command"  # CommandSpec: the user's own command
EXTERNAL: JobKind = "external"  # a script started by hand, reporting itself (server/external.py): no agent runs it


class LoraSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    rank: int = Field(8, ge=1, le=1024, description="LoRA rank r")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (scaling = alpha / rank)")
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        default_factory=lambda: ["q_proj", "v_proj"], min_length=1, max_length=1000)
    load_in_4bit: bool = Field(False, description="QLoRA: 4-bit base weights (CUDA only)")


class StallSpec(BaseModel):
    """Per-job overrides of the stall detector's thresholds (seconds); None: the agent's default
    (worker/agent/stall.py StallConfig). Each knob's title and description are the submit form's
    label and help (web/pages.py reads them from here)."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    factor: Optional[float] = Field(None, gt=1, title="Factor",
                                    description="stalled after this many times the typical step interval")
    floor_s: Optional[float] = Field(None, gt=0, title="Floor (s)",
                                     description="never stalled before this many seconds without progress")
    ceiling_s: Optional[float] = Field(None, gt=0, title="Ceiling (s)",
                                       description="always stalled after this many seconds without progress")
    first_step_s: Optional[float] = Field(None, gt=0, title="First step allowance (s)",
                                          description="how long the first step may take")
    phase_s: Optional[float] = Field(None, gt=0, title="Phase budget (s)",
                                     description="budget for a phase with no progress counter")
    slow_factor: Optional[float] = Field(
        None, gt=1, title="Slow: below own rate (×)",
        description="slow when throughput falls this many times below the job's own earlier rate")
    slow_projection_factor: Optional[float] = Field(
        None, gt=1, title="Slow: below projection (×)",
        description="… or this many times below the preflight projection")
    slow_growth_factor: Optional[float] = Field(
        None, gt=1, title="Slow: step time growth (×)",
        description="slow when step time grows steadily by this factor")
    slow_padding_frac: Optional[float] = Field(
        None, gt=0, le=1, title="Slow: padding share",
        description="slow when more than this fraction (0–1) of batch tokens is padding")
    slow_step_s: Optional[float] = Field(
        None, gt=0, title="Slow: step time (s)",
        description="an optimizer step slower than this counts as crawling")
    slow_periodic_frac: Optional[float] = Field(
        None, gt=0, le=1, title="Slow: periodic pauses share",
        description="periodic pauses costing this share (0–1) of the time")
    quiet_s: Optional[float] = Field(
        None, gt=0, title="Quiet warning after (s)",
        description="warn (with where the main thread waits) when a phase ended and nothing was reported "
                    "for this long")
    alert_open_s: Optional[float] = Field(
        None, ge=0, title="Alert opens after (s)",
        description="a slow or straggler condition must hold this long before its alert opens")
    alert_clear_s: Optional[float] = Field(
        None, ge=0, title="Alert clears after (s)",
        description="an alert's condition must stay away this long before the alert clears")
    kill_after_s: Optional[float] = Field(
        None, ge=0, title="Kill a stalled job after (s)",
        description="end a stalled attempt as a hang this long after its stall alert opened (retried from the "
                    "newest checkpoint; a second hang at the same step and frame is not); 0: never. Default: "
                    "1800 for tokenpulse's own training, never for command jobs")


_HUB_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*")


_SLURM_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.,:=-]{0,127}$"


class SlurmSpec(BaseModel):
    """How a job asks Slurm for its allocation when a Slurm executor (`tokenpulse agent --slurm`)
    claims it; ignored by other agents. Unset fields: the executor's defaults, then Slurm's."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    partition: Optional[str] = Field(None, pattern=_SLURM_NAME, description="Slurm partition (-p)")
    account: Optional[str] = Field(None, pattern=_SLURM_NAME, description="Slurm account (-A)")
    qos: Optional[str] = Field(None, pattern=_SLURM_NAME, description="Slurm QOS (--qos)")
    time_limit_min: Optional[int] = Field(None, ge=1, le=60 * 24 * 365, description="time limit in minutes (-t)")
    mem_gb: Optional[float] = Field(None, gt=0, le=1 << 20, description="memory per node in GB (--mem)")
    cpus_per_node: Optional[int] = Field(None, ge=1, le=4096,
                                         description="CPUs per node (default: nproc_per_node on CPU partitions)")
    gpus_per_node: Optional[int] = Field(None, ge=0, le=64,
                                         description="GPUs per node (default: nproc_per_node on GPU partitions, "
                                                     "else 0)")
    signal_before_s: int = Field(120, ge=10, le=3600,
                                 description="seconds before the time limit when Slurm warns the job (SIGUSR2): "
                                             "it checkpoints at the next step and goes back to the queue")


# Many runs: every job is in a project and may carry tags (editable after submit: jobs.project/tags).
DEFAULT_PROJECT = "default"
MAX_TAGS = 20
ProjectName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9 ._/-]{0,99}$",
                                   description="letters, digits, space . _ / -; at most 100 characters")]
TagName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/=-]{0,49}$",
                               description="letters, digits . _ : / = -; at most 50 characters")]


class SpecBase(BaseModel):
    """What every job carries, whichever kind it is (JobSpec, CommandSpec): how the queue orders
    and retries it, how its progress is judged, and how many processes and machines run it."""
    # Finite numbers only: JSON's 1e999 / Infinity parse to inf, which JSON cannot store (it became
    # null, and every claim of the job then failed). Refused at submit, with the field named.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: Optional[str] = Field(None, max_length=200, description="a label for the job (default for a command: "
                                                                    "the command)")
    priority: int = Field(0, ge=-100, le=100, description="higher runs first")
    max_retries: int = Field(2, ge=0, le=20, description="automatic retries (OOM, a lost worker, a crash or "
                                                          "a killing signal)")
    stall: StallSpec = Field(default_factory=StallSpec)
    nproc_per_node: int = Field(1, ge=1, le=64, description="training processes (ranks) per machine: "
                                "more than 1 runs DistributedDataParallel under torchrun")
    nnodes: int = Field(1, ge=1, le=16, description="machines (agents) that run the job together, "
                        "claimed as one gang")
    slurm: Optional[SlurmSpec] = Field(None, description="the allocation a Slurm executor asks for "
                                       "(partition, time limit, memory...)")
    project: ProjectName = Field(DEFAULT_PROJECT, description="the project the job belongs to (the runs "
                                 "table groups and filters by it)")
    tags: list[TagName] = Field(default_factory=list, max_length=MAX_TAGS,
                                description="labels to find the job by (editable later)")


class JobSpec(SpecBase):
    """What a user submits. Every field validated here, so a typo fails at submit, not hours later."""
    model: str = Field(BUILTIN_MODEL, min_length=1, max_length=4096,
                       description=f"local Hugging Face model directory, a Hub id (org/name), or {BUILTIN_MODEL}")
    dataset: str = Field(BUILTIN_DATASET, min_length=1, max_length=4096,
                         description=f".jsonl/.csv/.parquet/.txt file, a save_to_disk directory, a Hub dataset id "
                                     f"(org/name), or {BUILTIN_DATASET}")
    # ---- Hugging Face Hub: models and datasets given as Hub ids are downloaded into the agent's cache
    revision: Optional[str] = Field(None, min_length=1, max_length=200,
                                    description="Hub model: branch, tag or commit (default: main)")
    dataset_revision: Optional[str] = Field(None, min_length=1, max_length=200,
                                            description="Hub dataset: branch, tag or commit (default: main)")
    dataset_config: Optional[str] = Field(None, min_length=1, max_length=200,
                                          description="Hub dataset: configuration (subset) name")
    dataset_split: Optional[str] = Field(None, min_length=1, max_length=200,
                                         description="split to train on (default: train, else the first)")
    hub_token_secret: Optional[str] = Field(
        None, pattern=r"^[A-Za-z0-9_]{1,64}$",
        description="name of an agent secret holding a Hub token (env TOKENPULSE_SECRET_<NAME> on the agent); "
                    "default: the agent's HF_TOKEN. The token itself is never stored or shown")
    text_field: Optional[str] = Field(None, max_length=200, description="column holding plain text")
    prompt_field: Optional[str] = Field(None, max_length=200, description="column holding the prompt")
    response_field: Optional[str] = Field(None, max_length=200, description="column holding the response")
    messages_field: Optional[str] = Field(
        None, max_length=200, description="column holding a chat (list of {role, content}), rendered with the "
        "tokenizer's chat template; default: a 'messages' column when no other field is named")
    loss_on_response_only: Optional[bool] = Field(
        None, description="mask prompt tokens (chat: all but assistant turns) out of the loss; default: on for data "
                          "with a prompt (prompt/response, Alpaca, chats), off for plain text (set at submit from the "
                          "dataset's columns)")
    streaming: bool = Field(False, description="read the dataset as a stream, accumulating chunks")

    max_steps: Optional[int] = Field(None, ge=1, description="optimizer steps (or use epochs)")
    epochs: Optional[float] = Field(None, gt=0, description="passes over the data (when max_steps is unset)")
    learning_rate: float = Field(3e-4, gt=0, lt=1, description="peak learning rate")
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    batch_size: Union[int, Literal["auto"]] = Field(
        "auto", description="micro-batch (rows per step); auto measures a few sizes")
    tokens_per_batch: Optional[int] = Field(
        None, ge=8, description="effective batch in real tokens per optimizer step (default: 16 rows' worth)")
    grad_accum: Union[int, Literal["auto"]] = Field("auto", description="micro-batches per optimizer step")
    max_seq_length: Union[int, Literal["auto"]] = Field(
        "auto", description="tokens per example; auto covers the data up to the coverage percentile")
    length_coverage: float = Field(99.9, gt=50, le=100, description="percentile auto max length covers")
    padding: Literal["auto", "pack", "dynamic", "max_length"] = Field(
        "auto", description="pack (padding-free), dynamic (pad to longest in batch), max_length (wasteful)")
    group_by_length: bool = Field(False, description="dynamic padding: batch similar lengths together")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="auto: bf16 where measured faster or on GPUs that have it")
    gradient_checkpointing: bool = False
    torch_compile: Literal["auto", "on", "off"] = Field(
        "auto", description="auto: the output head and loss compiled with torch.compile where checked equal, "
                            "measured faster and the run is long enough to repay compiling; on: wherever "
                            "checked equal")
    lora: Optional[LoraSpec] = None
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: the accelerator when there is one")
    checkpoint_every: Optional[int] = Field(None, ge=1, description="save a checkpoint every N steps")
    checkpoint_every_min: Optional[float] = Field(None, gt=0, description="... or every N minutes")
    keep_checkpoints: int = Field(2, ge=1, le=100)
    log_every: int = Field(1, ge=1, description="steps between metric points")
    seed: int = Field(0, ge=0, le=2**32 - 1)
    # ---- evaluation and the quick test run ----
    eval_fraction: Optional[float] = Field(
        None, gt=0, le=0.5, description="hold out this fraction of the examples for evaluation (chosen by seed)")
    eval_dataset: Optional[str] = Field(
        None, min_length=1, max_length=4096, description="a separate evaluation file or save_to_disk dir (same fields)")
    eval_split: Optional[str] = Field(
        None, min_length=1, max_length=200, description="evaluate on this split of the dataset (a save_to_disk "
                                                         "DatasetDict or a Hub dataset), e.g. validation")
    eval_every: Optional[int] = Field(None, ge=1, description="evaluate every N steps (and always at the end)")
    eval_every_min: Optional[float] = Field(None, gt=0, description="... or every N minutes")
    eval_max_examples: int = Field(2000, ge=1, le=1_000_000, description="evaluate on at most this many examples")
    eval_prompts: list[Annotated[str, Field(min_length=1, max_length=2000)]] = Field(
        default_factory=list, max_length=8, description="fixed prompts whose greedy generations are shown at each eval")
    eval_max_new_tokens: int = Field(32, ge=1, le=256, description="tokens generated per eval prompt")
    test_run: bool = Field(False, description="first run the whole job end to end on a few steps; "
                                              "a failing check fails the job at once")

    @field_validator("model", "dataset")
    @classmethod
    def _no_nul(cls, v: str) -> str:
        if "\x00" in v:
            raise ValueError("must not contain NUL bytes")
        return v.strip()

    @field_validator("revision", "dataset_revision", "dataset_config", "dataset_split", "eval_split")
    @classmethod
    def _hub_name(cls, v: Optional[str], info) -> Optional[str]:
        """Names the Hub side resolves (they end up in URLs and cache paths): plain names like
        model ids, a revision may hold '/' (refs/pr/1); never '..', NUL or a leading '/'."""
        if v is None:
            return v
        pattern = _REVISION if info.field_name.endswith("revision") else _HUB_NAME
        if not pattern.fullmatch(v) or ".." in v or "//" in v:
            raise ValueError("letters, digits, '.', '_' and '-'" + (" (and '/' between parts)" if pattern is
                             _REVISION else "") + ", not starting with '.' or '/', without '..'")
        return v

    @field_validator("max_seq_length")
    @classmethod
    def _seq_len(cls, v):
        if isinstance(v, int) and not 8 <= v <= 1_048_576:
            raise ValueError("must be 'auto' or between 8 and 1048576")
        return v

    @field_validator("batch_size", "grad_accum")
    @classmethod
    def _positive(cls, v):
        if isinstance(v, int) and not 1 <= v <= 65536:
            raise ValueError("must be 'auto' or between 1 and 65536")
        return v

    @model_validator(mode="after")
    def _fields_consistent(self):
        if self.prompt_field and not self.response_field or self.response_field and not self.prompt_field:
            raise ValueError("prompt_field and response_field go together")
        if self.text_field and self.prompt_field:
            raise ValueError("give text_field or prompt_field/response_field, not both")
        if self.messages_field and (self.text_field or self.prompt_field):
            raise ValueError("give messages_field alone, not with text_field or prompt_field/response_field")
        if self.max_steps is None and self.epochs is None:
            self.max_steps = 200
        if sum(x is not None for x in (self.eval_fraction, self.eval_dataset, self.eval_split)) > 1:
            raise ValueError("give one of eval_fraction, eval_dataset or eval_split")
        if self.eval_fraction is not None and self.streaming:
            raise ValueError("eval_fraction cannot hold out examples from a stream; give eval_dataset")
        return self

    @field_validator("eval_dataset")
    @classmethod
    def _eval_path(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and "\x00" in v:
            raise ValueError("must not contain NUL bytes")
        return v.strip() if v is not None else v

    @property
    def has_eval(self) -> bool:
        return self.eval_fraction is not None or bool(self.eval_dataset) or bool(self.eval_split)

    @property
    def masks_prompt(self) -> bool:
        """loss_on_response_only as training applies it: unset (a Hub dataset, whose columns the
        submit could not read) is on; plain text has no prompt, so it masks nothing either way."""
        return self.loss_on_response_only is not False


# ---- command jobs -----------------------------------------------------------------------------------

# Set by the agent for every command job; a job may not set or import them itself.
RESERVED_ENV = frozenset({"TOKENPULSE_EVENT_FD", "TOKENPULSE_JOB_ID", "TOKENPULSE_RESUME_FROM",
                          "TOKENPULSE_TOKEN", "TOKENPULSE_AGENT_TOKEN"})
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
MAX_ARGS, MAX_ARG_CHARS, MAX_ENV = 1000, 32768, 200


class CommandSpec(SpecBase):
    """A job that runs a command (your own script) on an agent instead of tokenpulse's training.

    Code execution on the agent's machine: only tokens with the `commands` scope may submit one, and
    only agents started with --allow-commands run one. `env` values are plain settings, stored and
    shown on the job page; `secret_env` only names variables the agent passes on from its own
    environment, so their values never reach the server."""
    command: list[str] = Field(min_length=1, max_length=MAX_ARGS,
                               description="argv, e.g. [\"python\", \"train.py\", \"--lr\", \"1e-4\"]; a string is "
                                           "split like a POSIX shell would (no shell runs it)")
    cwd: Optional[str] = Field(None, max_length=4096,
                               description="working directory (under the server's path_roots); default: a "
                                           "fresh directory per job on the agent")
    env: dict[str, str] = Field(default_factory=dict, max_length=MAX_ENV,
                                description="environment variables: plain settings, visible on the job page")
    secret_env: list[str] = Field(default_factory=list, max_length=MAX_ENV,
                                  description="names of variables taken from the agent's own environment "
                                              "(Hub tokens, API keys): their values are never stored or shown")
    instrument: bool = Field(True, description="report Trainer/tqdm/datasets progress, metrics and stacks "
                                               "without code changes (a startup hook on PYTHONPATH)")
    capture: dict[str, bool] = Field(default_factory=dict, max_length=8,
                                     description="metric sources to read, each on unless set false: "
                                                 "{\"loggers\": false, \"backward\": false, \"printed\": false} "
                                                 "(logging-library calls, the loss the script calls .backward() on, "
                                                 "printed lines)")
    # the shared fields (SpecBase) whose meaning differs for a command
    nproc_per_node: int = Field(1, ge=1, le=64, description="processes (ranks) per machine: more than 1 runs "
                                "the command under torchrun (`--no-python`: the command as given, once per rank)")
    nnodes: int = Field(1, ge=1, le=1, description="machines: command jobs run on one agent")

    @field_validator("command", mode="before")
    @classmethod
    def _split(cls, v):
        if isinstance(v, str):
            try:
                v = shlex.split(v)
            except ValueError as e:
                raise ValueError(f"cannot split the command line: {e}") from None
        return v

    @field_validator("command")
    @classmethod
    def _argv(cls, v: list[str]) -> list[str]:
        if not v or not v[0].strip():
            raise ValueError("the command is empty")
        for a in v:
            if "\x00" in a:
                raise ValueError("arguments must not contain NUL bytes")
            if len(a) > MAX_ARG_CHARS:
                raise ValueError(f"an argument is over {MAX_ARG_CHARS} characters")
        return v

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, v: Optional[str]) -> Optional[str]:
        if v is None or not v.strip():
            return None
        if "\x00" in v:
            raise ValueError("must not contain NUL bytes")
        return v.strip()

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            _env_name(k)
            if "\x00" in val or len(val) > MAX_ARG_CHARS:
                raise ValueError(f"{k}: values are at most {MAX_ARG_CHARS} characters, without NUL bytes")
        return v

    @field_validator("capture")
    @classmethod
    def _capture(cls, v: dict[str, bool]) -> dict[str, bool]:
        from tokenpulse.instrument.sources import CAPTURE_KEYS
        bad = sorted(k for k in v if k not in CAPTURE_KEYS)
        if bad:
            raise ValueError(f"unknown source {', '.join(bad)}: one of {', '.join(CAPTURE_KEYS)}")
        return v

    @field_validator("secret_env")
    @classmethod
    def _secret_names(cls, v: list[str]) -> list[str]:
        for k in v:
            _env_name(k)
        return list(dict.fromkeys(v))

    @model_validator(mode="after")
    def _no_overlap(self):
        both = sorted(set(self.env) & set(self.secret_env))
        if both:
            raise ValueError(f"{', '.join(both)}: given both as a plain setting (env) and as a secret "
                             "(secret_env); pick one")
        return self

    def label(self) -> str:
        """A default name: the command as typed, program path shortened."""
        words = [os.path.basename(self.command[0]) or self.command[0], *self.command[1:]]
        text = shlex.join(words)
        return text if len(text) <= 80 else text[:79] + "…"


def _env_name(k: str) -> None:
    if not ENV_NAME.fullmatch(k):
        raise ValueError(f"{k!r} is not a variable name (letters, digits and _, not starting with a digit)")
    if k in RESERVED_ENV:
        raise ValueError(f"{k} is reserved: the agent sets it, or it is a tokenpulse credential")


JOB_KINDS: dict[str, type[SpecBase]] = {TRAIN: JobSpec, COMMAND: CommandSpec}


def spec_kind(spec: SpecBase) -> JobKind:
    return COMMAND if isinstance(spec, CommandSpec) else TRAIN


def load_spec(kind: str, raw: Union[str, bytes, dict]):
    """A stored spec (the jobs table's JSON and kind) as its model."""
    model = JOB_KINDS.get(kind or TRAIN, JobSpec)
    return model.model_validate(raw) if isinstance(raw, dict) else model.model_validate_json(raw)


# ---- events ---------------------------------------------------------------------------------------

EventKind = Literal["phase", "alive", "metrics", "log", "state", "alert", "checkpoint", "info"]


class PhaseData(BaseModel):
    name: str  # ours are Phase's names; a user's script may name its own
    done: Optional[float] = None
    total: Optional[float] = None
    unit: Optional[str] = None  # examples, steps, samples, tokens...
    detail: Optional[str] = None
    quiet: Optional[bool] = None  # the agent's line "no progress reported since ...": not progress


NONFINITE_WORDS = ("nan", "inf", "-inf")


def nonfinite_word(v: float) -> str:
    """NaN and +-inf as they cross JSON, which has no literal for them: "nan", "inf", "-inf".
    MetricsData reads the words back as floats, so a non-finite metric is stored and shown, not dropped."""
    return "nan" if v != v else "inf" if v > 0 else "-inf"


def metric_wire(v: float) -> Union[float, str]:
    """A metric value ready for JSON: a finite number as is, a non-finite one as its word."""
    return v if v - v == 0 else nonfinite_word(v)


class MetricsData(BaseModel):
    step: int = Field(ge=0)
    values: dict[str, float]  # a non-finite value arrives as "nan", "inf" or "-inf" (metric_wire)
    # where a command job's values came from, by name (tokenpulse/instrument/sources.py: api, logger,
    # backward, printed); absent for tokenpulse's own training and the Trainer callback
    sources: Optional[dict[str, str]] = None

    @field_validator("values")
    @classmethod
    def _names(cls, v: dict[str, float]) -> dict[str, float]:
        for k in v:
            if not k or len(k) > 64:
                raise ValueError("metric names are 1 to 64 characters")
        return v


class LogData(BaseModel):
    line: str = Field(max_length=8192)
    stream: Literal["stdout", "stderr", "agent"] = "stdout"


class StateData(BaseModel):
    state: JobState
    reason: Optional[str] = Field(None, max_length=8192)
    exit_code: Optional[int] = None
    signal: Optional[str] = None
    retry: bool = False  # the agent asks for a requeue (policy decides)
    # Ours are FailureKind; a str because a command job's own process may send its state event.
    failure: Optional[str] = None
    # a distributed job: how each rank ended (rank -> "exited with code 1", "killed by SIGKILL", ...)
    ranks: Optional[dict[int, str]] = Field(None, max_length=1024)
    # what the retry policy compares and reports (server/store.py end_attempt): a hang's step and the
    # frame it was stuck in (the user's innermost), the peak memory the attempt reached (MiB)
    step: Optional[int] = Field(None, ge=0)
    frame: Optional[str] = Field(None, max_length=500)
    peak_mb: Optional[float] = Field(None, ge=0)


# ---- fixes: a verdict's remedy as a change (server/fixes.py applies it, worker/agent/fixes.py and
# the training process build it). A fix is a dict in an alert's data["fixes"]:
#   {"kind": FixKind, "title": str, "changes": {field: [old, new]}, "effect": str, "ratio": float|None,
#    "resume": "checkpoint"|"fresh", "why_fresh": str|None, "reason": the verdict's reason key}
# a command job's fix changes its argv: "changes" names the flags, "argv": [old argv, new argv].
class FixKind:
    PADDING = "padding"  # packing on / max_seq_length from the data's lengths
    MICRO_BATCH = "micro_batch"  # a smaller micro-batch, more accumulation: the same effective batch
    PRECISION = "precision"  # bf16 on a GPU that has it
    EVAL = "eval"  # evaluate less often
    WORKERS = "workers"  # a command's DataLoader workers
    GROUP_BY_LENGTH = "group_by_length"  # a command's Trainer batches similar lengths together
    REVERT = "revert"  # a person undoing an applied fix


# Why a change to the batch layout starts from step 0: the checkpoint's data position is a place in the
# plan of micro-batches its layout made (attempt_outcomes.halve_micro_batch's rule).
LAYOUT_FRESH = ("a checkpoint's data position is a place in the plan of micro-batches its layout (padding, "
                "row length, micro-batch) made: with a new layout the run starts again from step 0")
LAYOUT_FIELDS = ("padding", "max_seq_length", "batch_size", "grad_accum", "tokens_per_batch", "group_by_length")


class FixRequest(BaseModel):
    """POST /api/jobs/{id}/fix: which verdict's fix to apply (server/fixes.py), or revert the newest.
    Neither alert_id nor kind: the n-th of all the job's open fixes (`tokenpulse fix <job> <n>`)."""
    model_config = ConfigDict(extra="forbid")
    alert_id: Optional[int] = Field(None, ge=1, description="the alert whose fix to apply")
    kind: Optional[str] = Field(None, min_length=1, max_length=64,
                                description="an alert kind (slow, padding...) or a fix kind (padding, micro_batch, "
                                            "precision, eval, workers...): the job's open verdict of that kind")
    n: int = Field(1, ge=1, le=100, description="which fix, counting from 1, when several match")
    revert: bool = Field(False, description="undo the newest applied fix instead (resumes from the newest checkpoint)")

    @model_validator(mode="after")
    def _one_way(self):
        if self.revert and (self.alert_id is not None or self.kind is not None):
            raise ValueError("revert undoes the newest applied fix: give no alert_id or kind with it")
        return self


class AlertData(BaseModel):
    kind: str = Field(max_length=64)  # ours are AlertKind's names; a user's script may raise its own
    severity: Literal["info", "warning", "critical"] = "warning"
    message: str = Field(max_length=8192)
    stack: Optional[str] = Field(None, max_length=200_000)
    clear: bool = False  # the condition is over (job recovered)
    # structured: `fixes` (each a spec or command change with its predicted effect, server/fixes.py
    # applies one), `costs` (each cause's share of the step time, priced against the ETA); a stall's
    # `stuck_since` (when progress stopped: the page keeps "Stuck 2 min" current)
    data: Optional[dict[str, Any]] = None


class CheckpointData(BaseModel):
    step: int
    path: str
    final: bool = False
    # a checkpoint taken because it was asked for (SIGUSR2: pause or an agent's stop; an unannounced
    # SIGTERM: a preemption): which signal, and the seconds from its arrival to the saved checkpoint
    requested: Optional[str] = Field(None, max_length=32)
    request_s: Optional[float] = Field(None, ge=0)


class Event(BaseModel):
    """One message from a training process, relayed by its agent. seq is per job, from the agent."""
    kind: EventKind
    job_id: int = Field(ge=1)
    seq: int = Field(ge=0)
    t: float
    data: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _data_shape(self):
        model = DATA_MODELS.get(self.kind)
        if model is not None:
            self.data = model.model_validate(self.data).model_dump(exclude_none=True, mode="json")
        return self


DATA_MODELS: dict[str, type[BaseModel]] = {
    "phase": PhaseData, "metrics": MetricsData, "log": LogData, "state": StateData,
    "alert": AlertData, "checkpoint": CheckpointData,
}


# ---- agent protocol -------------------------------------------------------------------------------

class AgentHello(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str = Field(min_length=1, max_length=200)
    host: str = Field(max_length=200)
    device: str = Field("cpu", max_length=500)
    capacity: int = Field(1, ge=1, le=64)
    accepts_commands: bool = Field(False, description="started with --allow-commands: it runs command jobs")
    instance: Optional[str] = Field(None, pattern=r"^[0-9a-f]{16,64}$",
                                    description="a stable id of the agent's work dir on its host: an agent that "
                                                "restarts with the same token and work dir keeps its identity")


class GpuSample(BaseModel):
    """One GPU as NVML reads it (a field the board does not report is left out)."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    util_pct: Optional[float] = Field(None, ge=0, le=100)
    mem_mb: Optional[float] = Field(None, ge=0)
    power_w: Optional[float] = Field(None, ge=0)
    temp_c: Optional[float] = None


class MachineSample(BaseModel):
    """An agent's machine now (worker/agent/sysmetrics.py), every few seconds: the workers page."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    cpu_pct: float = Field(ge=0, le=100, description="CPU use, % of all cores")
    cores: int = Field(ge=1, le=100_000)
    mem_used_mb: float = Field(ge=0)
    mem_total_mb: float = Field(ge=0)
    load1: float = Field(0.0, ge=0)
    net_recv_mbps: Optional[float] = Field(None, ge=0)
    net_sent_mbps: Optional[float] = Field(None, ge=0)
    gpus: list[GpuSample] = Field(default_factory=list, max_length=64)
    t: float


class EventBatch(BaseModel):
    events: list[Event] = Field(max_length=100_000)


class Registered(BaseModel):
    """The server's answer to AgentHello (the agent reads its id; the rest is server/schemas.AgentOut)."""
    id: int


class RankReport(BaseModel):
    """One rank of a distributed job as its agent sees it (worker/agent/ranks.py Rank.row())."""
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    rank: int = Field(ge=0, lt=1024)
    host: Optional[str] = Field(None, max_length=200)
    pid: Optional[int] = Field(None, ge=0, lt=2 ** 31)
    device: Optional[str] = Field(None, max_length=200)
    step: Optional[int] = Field(None, ge=0, lt=2 ** 62)
    step_time_s: Optional[float] = Field(None, ge=0)
    busy_s: Optional[float] = Field(None, ge=0)  # its own work per step, waits for the other ranks left out
    rss_mb: Optional[float] = Field(None, ge=0)
    alive_at: Optional[float] = None
    progress_at: Optional[float] = None
    exit: Optional[str] = Field(None, max_length=200)
    # a multi-node job's other node, asked: this rank's stacks, for node rank 0's merged verdict
    stack: Optional[str] = Field(None, max_length=100_000)


class Heartbeat(BaseModel):
    # job id -> time the training process last said it was alive
    jobs: dict[int, float] = Field(default_factory=dict, max_length=1000)
    # job id -> its ranks (distributed jobs only): the rank table
    ranks: dict[int, list[RankReport]] = Field(default_factory=dict, max_length=1000)
    # jobs the agent holds whose liveness another process reports (a Slurm executor's jobs while
    # their node process runs): not lost for missing from `jobs`, their alive time left alone
    held: list[int] = Field(default_factory=list, max_length=1000)


def event_batch_body(events: list[dict]) -> dict:
    """An EventBatch as the agent sends it: its journaled event dicts (already the Event shape),
    not revalidated here - the server checks every event (5,000 through pydantic would cost ~75 ms)."""
    return {"events": events}


class Command(BaseModel):
    job_id: int
    action: CommandAction


class AgentReply(BaseModel):
    """What the server answers to a heartbeat or an event batch: acks and commands."""
    acked: dict[int, int] = Field(default_factory=dict)  # job_id -> highest seq stored
    commands: list[Command] = Field(default_factory=list)
    # a heartbeat's answer: a job waits to be claimed (an idle agent on its websocket claims then;
    # the push on WORK_TOPIC says it when a job is queued, this covers requeues and a missed push)
    work: bool = False


class AgentMessage(BaseModel):
    """One request on an agent's websocket (`/api/agents/{id}/ws`): a Heartbeat, an event batch, or
    both in one message, with an id its answer repeats. The HTTP routes take the same parts one at a
    time (a Heartbeat at /heartbeat, an EventBatch at /events); the server applies both the same way
    (server/agent_protocol.py). Unknown keys are ignored (a newer agent's additions)."""
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    id: int
    heartbeat: Optional[Heartbeat] = None
    # an EventBatch's events, checked on the server's writer thread (server/ingest/parse.py): 5,000
    # events through pydantic on the event loop would hold every websocket for ~75 ms
    events: Optional[list[Any]] = Field(None, max_length=100_000)

    @field_validator("heartbeat", mode="before")
    @classmethod
    def _bare_jobs(cls, v):
        """The first socket dialect sent the jobs alone ({job id: alive_at}): still taken, as Heartbeat.jobs."""
        if isinstance(v, dict) and not v.keys() & {"jobs", "ranks"}:
            return {"jobs": v}
        return v

    @model_validator(mode="after")
    def _something(self):
        if self.heartbeat is None and self.events is None:
            raise ValueError("a message carries a heartbeat, events, or both")
        return self


class AgentAnswer(TypedDict, total=False):
    """The server's answer to an AgentMessage on the socket: an AgentReply's fields (acked only for a
    message with events, work only when true), or what the HTTP route would refuse it with."""
    id: int
    acked: dict[str, int]
    commands: list[dict[str, Any]]
    work: bool
    status: int  # 4xx/503, as HTTP would answer; the agent sends it again over HTTP (or later)
    detail: str


def socket_answer(reply: AgentReply, with_acks: bool) -> AgentAnswer:
    out: AgentAnswer = {"commands": [c.model_dump() for c in reply.commands]}
    if with_acks:
        out["acked"] = {str(k): v for k, v in reply.acked.items()}
    if reply.work:
        out["work"] = True
    return out


def refusal(status: int, detail: str) -> AgentAnswer:
    return {"status": status, "detail": detail}


class ClaimRequest(BaseModel):
    """What an agent offers with a claim: where its node would host a gang's rendezvous."""
    model_config = ConfigDict(extra="forbid")
    endpoint: Optional[str] = Field(None, max_length=300, pattern=r"^[A-Za-z0-9.:\[\]_-]+:[0-9]{1,5}$",
                                    description="host:port reachable by the other agents of a gang")
    slurm: bool = Field(False, description="a Slurm executor: takes multi-node jobs whole (its token needs "
                        "`gang`) and gets a credential for each job's node processes (Claim.job_token)")


class Claim(BaseModel):
    job_id: int
    attempt: int
    seq_start: int
    kind: JobKind = TRAIN
    spec: Union[JobSpec, CommandSpec]
    resume_from: Optional[str] = None
    # a multi-node job (nnodes > 1): this agent's node rank and node rank 0's rendezvous endpoint;
    # only node rank 0's agent reports the job's events (the others run their ranks, heartbeat them)
    node_rank: int = 0
    rdzv_endpoint: Optional[str] = None
    # the server's path roots (TOKENPULSE_PATH_ROOTS; empty: none): a command's working directory is
    # resolved and checked against them again when the agent starts it (a symlink swapped in after
    # the submit must not take it elsewhere)
    path_roots: list[str] = Field(default_factory=list)
    # a Slurm executor's claim: the job's own credential for its node processes, valid for this
    # attempt alone (heartbeats, events, stacks of this job); shown once
    job_token: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _spec_of_kind(cls, v):
        if isinstance(v, dict) and isinstance(v.get("spec"), dict):
            v = {**v, "spec": load_spec(v.get("kind", TRAIN), v["spec"])}
        return v


# ---- websocket frames ------------------------------------------------------------------------------
# Every frame the server pushes (and web/static/*.js reads by "type"), built here and nowhere else.
# Plain dicts typed by TypedDict, not models: the hub serializes each frame once with orjson, and a
# heartbeat or events frame is built per job per batch on the writer thread, so no model is built or
# dumped on that path. The payloads inside (a job summary, an alert, an agent, stored events) are the
# REST shapes of server/schemas.py.

FrameType = Literal["job", "events", "heartbeat", "alert", "agent", "error", "subscribed", "nudge", "work"]
# Final: each constant keeps its own literal type, the one its frame's "type" key declares
JOB_FRAME: Final = "job"
EVENTS_FRAME: Final = "events"
HEARTBEAT_FRAME: Final = "heartbeat"
ALERT_FRAME: Final = "alert"
AGENT_FRAME: Final = "agent"
ERROR_FRAME: Final = "error"
SUBSCRIBED_FRAME: Final = "subscribed"
# to agents' websockets only (server/api/agent_ws.py), which send each as {"<type>": true}
NUDGE_FRAME: Final = "nudge"  # a person asked for something on one of its jobs: heartbeat now
WORK_FRAME: Final = "work"  # a job was queued: an idle agent claims now

# The hub's topics (server/hub.py; a browser subscribes by these names, web/static/*.js).
JOBS_TOPIC = "jobs"  # every job's summaries and heartbeats
ALERTS_TOPIC = "alerts"
AGENTS_TOPIC = "agents"  # agents' registrations and changes of state
WORK_TOPIC = "agents:work"  # every agent's websocket: a job was queued (not a browser topic)
BROWSER_TOPICS = (JOBS_TOPIC, ALERTS_TOPIC, AGENTS_TOPIC)  # and job_topic(id)
_JOB_TOPIC = "job:"
_AGENT_TOPIC = "agent:"


def job_topic(job_id: int) -> str:
    """One job's events, summaries and heartbeats."""
    return f"{_JOB_TOPIC}{job_id}"


_BROWSER_TOPIC = re.compile(rf"^({'|'.join(BROWSER_TOPICS)}|{_JOB_TOPIC}[1-9][0-9]{{0,12}})$")


def is_browser_topic(topic: str) -> bool:
    """A topic a browser may subscribe to (server/api/ws.py): not an agent's."""
    return _BROWSER_TOPIC.match(topic) is not None


def agent_topic(agent_id: int) -> str:
    """One agent's websocket: nudges for its jobs (across server processes too: server/relay.py)."""
    return f"{_AGENT_TOPIC}{agent_id}"


class JobFrame(TypedDict):
    type: Literal["job"]
    job: dict[str, Any]  # a job summary (schemas.JobSummary)


class _EventsFrame(TypedDict):
    type: Literal["events"]
    job_id: int
    events: list[dict[str, Any]]  # {"kind", "seq", "t", "data"}, in seq order


class EventsFrame(_EventsFrame, total=False):
    missed: int  # events a lagging client never got (server/hub.py merge); the page refills from REST


class HeartbeatFrame(TypedDict):
    type: Literal["heartbeat"]
    job_id: int
    t: float  # when the server heard the agent
    alive_at: float  # when the training process last said it was alive


class AlertFrame(TypedDict):
    type: Literal["alert"]
    alert: dict[str, Any]  # schemas.AlertOut


class AgentFrame(TypedDict):
    type: Literal["agent"]
    agent: dict[str, Any]  # schemas.AgentOut, or {"id", "state"} for a change of state


class ErrorFrame(TypedDict):
    type: Literal["error"]
    message: str


class SubscribedFrame(TypedDict):
    type: Literal["subscribed"]
    topics: list[str]


class NudgeFrame(TypedDict):
    type: Literal["nudge"]


class WorkFrame(TypedDict):
    type: Literal["work"]


def job_frame(summary: dict[str, Any]) -> JobFrame:
    return {"type": JOB_FRAME, "job": summary}


def events_frame(job_id: int, events: list[dict[str, Any]], missed: int = 0) -> EventsFrame:
    f: EventsFrame = {"type": EVENTS_FRAME, "job_id": job_id, "events": events}
    if missed:
        f["missed"] = missed
    return f


def heartbeat_frame(job_id: int, t: float, alive_at: float) -> HeartbeatFrame:
    return {"type": HEARTBEAT_FRAME, "job_id": job_id, "t": t, "alive_at": alive_at}


def alert_frame(alert: dict[str, Any]) -> AlertFrame:
    return {"type": ALERT_FRAME, "alert": alert}


def agent_frame(agent: dict[str, Any]) -> AgentFrame:
    return {"type": AGENT_FRAME, "agent": agent}


def error_frame(message: str) -> ErrorFrame:
    return {"type": ERROR_FRAME, "message": message}


def subscribed_frame(topics: list[str]) -> SubscribedFrame:
    return {"type": SUBSCRIBED_FRAME, "topics": topics}


def nudge_frame() -> NudgeFrame:
    return {"type": NUDGE_FRAME}


def work_frame() -> WorkFrame:
    return {"type": WORK_FRAME}


# ---- dataset analysis ------------------------------------------------------------------------------

Number = Union[int, float]  # int first: a count stays 12, not 12.0


class LengthBin(BaseModel):
    lo: int
    hi: int
    count: int


class LayoutCost(BaseModel):
    """One padding layout at the same real tokens per optimizer step (worker/training/analysis.py).
    Extra keys allowed: the pack layout adds row_len, and the JSON stays as the worker wrote it."""
    model_config = ConfigDict(extra="allow")
    padding_frac: Number
    real_tokens_per_step: Number
    padded_tokens_per_step: Number
    computed_per_real_token: Number
    compute_vs_max_length: Number


class DatasetAnalysis(BaseModel):
    """The preflight analysis (`python -m worker.training.analyze`, POST /api/datasets/analyze,
    `tokenpulse analyze`). Extra keys pass through, so a newer worker's additions reach the caller."""
    model_config = ConfigDict(extra="allow")
    examples: int
    sampled: bool
    sample_size: int
    tokens: int
    mean: float
    percentiles: dict[str, Number] = Field(description="p50, p90, p99, p99.9 and max token length")
    histogram: list[LengthBin]
    length_coverage: float
    recommended_max_seq_length: Optional[int]
    max_seq_length: Optional[int]
    model_max_length: Optional[int]
    truncated: int
    truncated_frac: float
    rows_per_step: int
    real_tokens_per_step: Number = 0
    real_tokens_per_step_from: Optional[str] = None
    layouts: dict[str, LayoutCost] = Field(default_factory=dict,
                                           description="max_length / dynamic / pack: padding and tokens per step")
    fields: dict[str, Any] = Field(default_factory=dict)
    tokenization_cache: Optional[Literal["hit", "miss"]] = None
    warnings: list[dict[str, Any]] = Field(default_factory=list,
                                           description="preflight advice: [{kind, field, message, fix}]")
    memory: Optional[dict[str, Any]] = Field(None, description="with measure: {device, precision, budget_s, table: "
                                             "[{seq_len, max_rows, tokens_per_s, fits, limited_by}]}")


class ExitVerdict(BaseModel):
    """An agent's judgment of how an attempt ended: the data of the one authoritative `state` event it
    sends when the process exits (read on the server as StateData). Sent with
    model_dump(exclude_none=True), so only what the agent knows goes on the wire."""
    state: str  # a JobState value; "queued" when a shutdown requeues a checkpointed job
    reason: Optional[str] = None
    failure: Optional[str] = None  # a FailureKind, or what a command's own state event said
    exit_code: Optional[int] = None
    signal: Optional[str] = None
    retry: Optional[bool] = None  # the agent asks for a requeue (the policy decides)
    ranks: Optional[dict[int, str]] = None  # a distributed job: how each rank of this node ended
    step: Optional[int] = None  # a hang: the step it was stuck at
    frame: Optional[str] = None  # a hang: the frame it was stuck in (the user's innermost)
    peak_mb: Optional[float] = None  # the peak memory the attempt reached (MiB), where known
