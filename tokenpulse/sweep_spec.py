"""A sweep as submitted (`tokenpulse sweep sweep.yaml`, POST /api/sweeps, the browser's sweep form):
a base job, the space of its settings to search, how to search and judge, and the budget.

Shapes only (pydantic): whether a parameter is one the base job has, and whether its values make a
valid job, is the server's check (server/sweeps/space.py), with the same 422 naming the field.
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tokenpulse.protocol import DEFAULT_PROJECT, MAX_TAGS, ProjectName, TagName

Scalar = Union[bool, int, float, str]

# What tokenpulse's own training process reports (worker/training/loop.py, evaluation.py): a train
# sweep's objective must be one of them; eval/* only when the base spec holds out an evaluation set.
TRAIN_METRICS = {"loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "step_time_s", "padding_frac",
                 "padded_tokens_per_s", "mfu", "rss_mb", "cuda_peak_mb", "epoch"}
EVAL_METRICS = {"eval/loss", "eval/ppl"}


class Param(BaseModel):
    """One setting's range: `values` (a choice; grid needs these), or `low`..`high` (with `log` for a
    log scale; `int` for whole numbers; `step` for a grid of a range)."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    values: Optional[list[Scalar]] = Field(None, description="the choices")
    low: Optional[float] = None
    high: Optional[float] = None
    log: bool = Field(False, description="sample on a log scale (low > 0)")
    int: bool = Field(False, description="whole numbers")
    step: Optional[float] = Field(None, gt=0, description="a range's spacing")

    @model_validator(mode="after")
    def _one_kind(self) -> "Param":
        if self.values is not None:
            if not self.values:
                raise ValueError("values: must have at least one choice")
            if self.low is not None or self.high is not None:
                raise ValueError("give values or low..high, not both")
            return self
        if self.low is None or self.high is None:
            raise ValueError("needs values, or low and high")
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) is above high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError(f"a log range must lie above zero (low is {self.low})")
        if self.log and self.step is not None:
            raise ValueError("a log range takes no step")
        return self

    def grid(self) -> Optional[list[Scalar]]:
        """The points a grid search visits: the choices, or a range's steps (None: a continuous range)."""
        if self.values is not None:
            return list(self.values)
        if self.step is None and not self.int:
            return None
        assert self.low is not None and self.high is not None
        step = self.step or 1
        n = int((self.high - self.low) / step + 1e-9) + 1
        points = [self.low + i * step for i in range(n)]
        return [int(round(p)) for p in points] if self.int else [round(p, 12) for p in points]


class Objective(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metric: str = Field(min_length=1, max_length=64, description="a metric the trials report, e.g. eval/loss")
    goal: Literal["min", "max"] = "min"


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    trials: int = Field(10, ge=1, le=10_000, description="trials in all")
    parallel: int = Field(2, ge=1, le=256, description="trials queued or running at once")
    hours: Optional[float] = Field(None, gt=0, description="no new trial after this long")


class Pruner(BaseModel):
    """Early stopping of hopeless trials (Optuna's pruners), fed by the objective's live points."""
    model_config = ConfigDict(extra="forbid")
    kind: Literal["none", "median", "successive_halving", "hyperband"] = "median"
    startup_trials: int = Field(2, ge=0, le=1000, description="median: trials finished before any pruning")
    warmup_steps: int = Field(0, ge=0, description="median: steps of a trial before it may be pruned")
    min_resource: Optional[int] = Field(None, ge=1, description="halving/hyperband: steps before the first rung")
    reduction_factor: int = Field(3, ge=2, le=10, description="halving/hyperband: 1 in this many goes on")


class SweepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: Optional[str] = Field(None, max_length=200)
    project: ProjectName = DEFAULT_PROJECT
    tags: list[TagName] = Field(default_factory=list, max_length=MAX_TAGS, description="given to every trial")
    base: dict = Field(description="the base job: a JobSpec, or a CommandSpec (has `command`) whose argv or "
                                   "env names each parameter as {name}")
    parameters: dict[str, Param] = Field(description="the space: setting name -> its range")
    method: Literal["grid", "random", "tpe"] = Field("tpe", description="tpe: Bayesian (Optuna's TPE sampler)")
    objective: Objective
    budget: Budget = Field(default_factory=Budget)
    pruner: Pruner = Field(default_factory=Pruner)
    seed: int = Field(0, ge=0, le=2**32 - 1)

    @field_validator("parameters")
    @classmethod
    def _not_empty(cls, v: dict) -> dict:
        if not v:
            raise ValueError("the space is empty: name at least one setting to search")
        return v

    @property
    def is_command(self) -> bool:
        return "command" in self.base
