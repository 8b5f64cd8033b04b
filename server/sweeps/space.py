"""A sweep spec's checks beyond its shape, and each trial's job spec.

Every refusal is a SpecError naming the field (a 422): the space's parameters against the base job
(a setting it has; every value a valid job), the objective against what the base job reports.
"""
from __future__ import annotations

import math
from typing import Union

from pydantic import ValidationError

from server.errors import error_list
from tokenpulse.errors import SpecError
from tokenpulse.protocol import CommandSpec, JobSpec
from tokenpulse.sweep_spec import EVAL_METRICS, TRAIN_METRICS, Param, SweepSpec

Spec = Union[JobSpec, CommandSpec]
NOT_SEARCHED = {"name", "project", "tags", "command", "slurm", "stall", "lora"}  # not a parameter's to set


def base_model(spec: SweepSpec) -> type[Spec]:
    return CommandSpec if spec.is_command else JobSpec


def check(spec: SweepSpec) -> Spec:
    """The base job as a spec, once every parameter and the objective are judged sound."""
    model = base_model(spec)
    try:
        base = model.model_validate(spec.base)
    except ValidationError as e:
        errors = [{**x, "field": f"base.{x['field']}"} for x in error_list(e.errors())]
        raise SpecError(errors[0]["field"], errors[0]["message"], errors) from None
    for name, param in spec.parameters.items():
        field = f"parameters.{name}"
        if spec.method == "grid" and param.grid() is None:
            raise SpecError(field, "a grid search needs values (or a range with step, or int)")
        if spec.is_command:
            if not any(f"{{{name}}}" in text for text in _command_texts(spec.base)):
                raise SpecError(field, f"the base command has no {{{name}}} in its argv or env to set")
            continue
        if name not in JobSpec.model_fields or name in NOT_SEARCHED:
            raise SpecError(field, f"the base job has no setting {name!r} to search")
        for value in corners(param):
            try:
                model.model_validate({**spec.base, name: value})
            except ValidationError as e:
                why = error_list(e.errors())[0]["message"]
                raise SpecError(field, f"{value!r} makes no valid job: {name} {why}") from None
    _check_objective(spec, base)
    return base


def _check_objective(spec: SweepSpec, base: Spec) -> None:
    metric = spec.objective.metric
    if spec.is_command:
        return  # a command reports what its script logs: a trial that never does counts as failed
    assert isinstance(base, JobSpec)
    evaluates = base.eval_fraction or base.eval_dataset or base.eval_split
    if metric in TRAIN_METRICS or (metric in EVAL_METRICS and evaluates):
        return
    if metric in EVAL_METRICS:
        raise SpecError("objective.metric", f"no trial reports {metric}: the base job holds out no evaluation "
                                            "set (set eval_fraction, eval_dataset or eval_split)")
    known = ", ".join(sorted(TRAIN_METRICS | EVAL_METRICS))
    raise SpecError("objective.metric", f"no trial reports {metric!r}: a training job reports {known}")


def corners(param: Param) -> list:
    """The values that decide whether a whole range makes valid jobs: its ends, or every choice."""
    if param.values is not None:
        return list(param.values)
    assert param.low is not None and param.high is not None
    ends = [param.low, param.high]
    return [int(math.ceil(param.low)), int(math.floor(param.high))] if param.int else ends


def _command_texts(base: dict) -> list[str]:
    command = base.get("command")
    argv = command.split() if isinstance(command, str) else list(command or [])
    return [str(x) for x in argv] + [str(v) for v in (base.get("env") or {}).values()]


def trial_spec(spec: SweepSpec, sweep_id: int, number: int, params: dict) -> Spec:
    """The job of trial `number`: the base with the trial's settings, in the sweep's project, tagged
    with its sweep."""
    body = dict(spec.base)
    if spec.is_command:
        def fill(text: str) -> str:
            for name, value in params.items():
                text = text.replace(f"{{{name}}}", _plain(value))
            return text
        command = body["command"]
        body["command"] = fill(command) if isinstance(command, str) else [fill(str(x)) for x in command]
        body["env"] = {k: fill(str(v)) for k, v in (body.get("env") or {}).items()}
    else:
        body.update(params)
    label = spec.name or f"sweep-{sweep_id}"
    body.update(name=f"{label} #{number}", project=spec.project,
                tags=list(dict.fromkeys([*body.get("tags", []), *spec.tags, f"sweep:{sweep_id}"])))
    return base_model(spec).model_validate(body)


def _plain(value) -> str:
    return repr(value) if isinstance(value, float) else str(value)
