"""The one vocabulary that crosses every boundary: job specs, events, job states.

Imported by the training process, the agent, the server's storage, REST and websockets, so the
shapes cannot drift apart. Imports nothing heavy (pydantic only): the server never loads torch.
"""
from __future__ import annotations

import enum
import math
import os
import re
import shlex
from typing import Annotated, Any, Literal, Optional, Union

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


class LoraSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    rank: int = Field(8, ge=1, le=1024, description="LoRA rank r")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (scaling = alpha / rank)")
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        default_factory=lambda: ["q_proj", "v_proj"], min_length=1, max_length=1000)
    load_in_4bit: bool = Field(False, description="QLoRA: 4-bit base weights (CUDA only)")


class StallSpec(BaseModel):
    """Per-job overrides of the stall detector's thresholds (seconds)."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    factor: Optional[float] = Field(None, gt=1, description="stalled after factor x typical interval")
    floor_s: Optional[float] = Field(None, gt=0, description="never stalled before this many seconds")
    ceiling_s: Optional[float] = Field(None, gt=0, description="always stalled after this many seconds")
    first_step_s: Optional[float] = Field(None, gt=0, description="allowance for the first step")
    phase_s: Optional[float] = Field(None, gt=0, description="budget for a phase with no counter")
    slow_factor: Optional[float] = Field(None, gt=1, description="slow when throughput falls this many x below its own earlier rate")
    slow_projection_factor: Optional[float] = Field(None, gt=1, description="... or this many x below the preflight projection")
    slow_growth_factor: Optional[float] = Field(None, gt=1, description="slow when step time grows steadily by this factor")
    slow_padding_frac: Optional[float] = Field(None, gt=0, le=1, description="slow when more than this fraction of batch tokens is padding")
    slow_step_s: Optional[float] = Field(None, gt=0, description="an optimizer step slower than this crawls")
    slow_periodic_frac: Optional[float] = Field(None, gt=0, le=1, description="periodic pauses costing this share of the time")


class JobSpec(BaseModel):
    """What a user submits. Every field validated here, so a typo fails at submit, not hours later."""
    # Finite numbers only: JSON's 1e999 / Infinity parse to inf, which JSON cannot store (it became
    # null, and every claim of the job then failed). Refused at submit, with the field named.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: Optional[str] = Field(None, max_length=200, description="a label for the job")
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
    loss_on_response_only: bool = Field(True, description="mask prompt tokens (chat: all but assistant turns) out of the loss")
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
    lora: Optional[LoraSpec] = None
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: the accelerator when there is one")
    checkpoint_every: Optional[int] = Field(None, ge=1, description="save a checkpoint every N steps")
    checkpoint_every_min: Optional[float] = Field(None, gt=0, description="... or every N minutes")
    keep_checkpoints: int = Field(2, ge=1, le=100)
    log_every: int = Field(1, ge=1, description="steps between metric points")
    seed: int = Field(0, ge=0, le=2**32 - 1)
    priority: int = Field(0, ge=-100, le=100, description="higher runs first")
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

    max_retries: int = Field(2, ge=0, le=20, description="automatic retries (OOM, lost worker, crash)")
    stall: StallSpec = Field(default_factory=StallSpec)

    @field_validator("model", "dataset")
    @classmethod
    def _no_nul(cls, v: str) -> str:
        if "\x00" in v:
            raise ValueError("must not contain NUL bytes")
        return v.strip()

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


# ---- command jobs -----------------------------------------------------------------------------------

# Set by the agent for every command job; a job may not set or import them itself.
RESERVED_ENV = frozenset({"TOKENPULSE_EVENT_FD", "TOKENPULSE_JOB_ID", "TOKENPULSE_RESUME_FROM",
                          "TOKENPULSE_TOKEN", "TOKENPULSE_AGENT_TOKEN"})
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
MAX_ARGS, MAX_ARG_CHARS, MAX_ENV = 1000, 32768, 200


class CommandSpec(BaseModel):
    """A job that runs a command (your own script) on an agent instead of tokenpulse's training.

    Code execution on the agent's machine: only tokens with the `commands` scope may submit one, and
    only agents started with --allow-commands run one. `env` values are plain settings, stored and
    shown on the job page; `secret_env` only names variables the agent passes on from its own
    environment, so their values never reach the server."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: Optional[str] = Field(None, max_length=200, description="a label for the job (default: the command)")
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
    priority: int = Field(0, ge=-100, le=100, description="higher runs first")
    max_retries: int = Field(2, ge=0, le=20, description="automatic retries (killed by a signal, lost worker)")
    stall: StallSpec = Field(default_factory=StallSpec)

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


JOB_KINDS: dict[str, type[BaseModel]] = {"train": JobSpec, "command": CommandSpec}


def spec_kind(spec: BaseModel) -> str:
    return "command" if isinstance(spec, CommandSpec) else "train"


def load_spec(kind: str, raw: Union[str, bytes, dict]):
    """A stored spec (the jobs table's JSON and kind) as its model."""
    model = JOB_KINDS.get(kind or "train", JobSpec)
    return model.model_validate(raw) if isinstance(raw, dict) else model.model_validate_json(raw)


# ---- events ---------------------------------------------------------------------------------------

EventKind = Literal["phase", "alive", "metrics", "log", "state", "alert", "checkpoint", "info"]


class PhaseData(BaseModel):
    name: str  # loading model, tokenizing, packing, training, evaluating, saving, accumulating...
    done: Optional[float] = None
    total: Optional[float] = None
    unit: Optional[str] = None  # examples, steps, samples, tokens...
    detail: Optional[str] = None


class MetricsData(BaseModel):
    step: int = Field(ge=0)
    values: dict[str, float]

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
    failure: Optional[str] = None  # oom, nan, crash, lost, spec, hang, disk_full...


class AlertData(BaseModel):
    kind: str = Field(max_length=64)  # stalled, slow, crashed, nan, worker_lost, padding...
    severity: Literal["info", "warning", "critical"] = "warning"
    message: str = Field(max_length=8192)
    stack: Optional[str] = Field(None, max_length=200_000)
    clear: bool = False  # the condition is over (job recovered)


class CheckpointData(BaseModel):
    step: int
    path: str
    final: bool = False


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


def finite_or_none(x: float) -> Optional[float]:
    return x if x is not None and math.isfinite(x) else None


# ---- agent protocol -------------------------------------------------------------------------------

class AgentHello(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str = Field(min_length=1, max_length=200)
    host: str = Field(max_length=200)
    device: str = Field("cpu", max_length=500)
    capacity: int = Field(1, ge=1, le=64)
    accepts_commands: bool = Field(False, description="started with --allow-commands: it runs command jobs")


class EventBatch(BaseModel):
    events: list[Event] = Field(max_length=100_000)


class Command(BaseModel):
    job_id: int
    action: Literal["cancel", "pause", "stack"]


class AgentReply(BaseModel):
    """What the server answers to a heartbeat or an event batch: acks and commands."""
    acked: dict[int, int] = Field(default_factory=dict)  # job_id -> highest seq stored
    commands: list[Command] = Field(default_factory=list)


class Claim(BaseModel):
    job_id: int
    attempt: int
    seq_start: int
    kind: Literal["train", "command"] = "train"
    spec: Union[JobSpec, CommandSpec]
    resume_from: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _spec_of_kind(cls, v):
        if isinstance(v, dict) and isinstance(v.get("spec"), dict):
            v = {**v, "spec": load_spec(v.get("kind", "train"), v["spec"])}
        return v
