"""A sweep's Optuna study: its sampler and pruner, and the study rebuilt from our own tables.

Optuna keeps its study in memory here (InMemoryStorage); the truth is in sweep_trials (each trial's
settings, state, value and Optuna's own per-trial attributes) and in the trials' stored metric
series (the objective's intermediate values). So a server restart, even a kill -9, loses nothing:
the study is built again from them, in trial-number order, and the sweep goes on.
"""
from __future__ import annotations

import json
import math
import warnings
from typing import Iterable, Optional

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from server.models import SweepTrial
from tokenpulse.sweep_spec import Param, SweepSpec

optuna.logging.set_verbosity(optuna.logging.WARNING)  # the server's log is not Optuna's progress report

STATES = {"running": TrialState.RUNNING, "complete": TrialState.COMPLETE, "pruned": TrialState.PRUNED,
          "failed": TrialState.FAIL}


def distribution(spec: SweepSpec, param: Param) -> BaseDistribution:
    if spec.method == "grid" or param.values is not None:
        return CategoricalDistribution(param.grid() or [])
    assert param.low is not None and param.high is not None
    if param.int:
        return IntDistribution(int(math.ceil(param.low)), int(math.floor(param.high)), log=param.log,
                               step=int(param.step or 1))
    return FloatDistribution(param.low, param.high, log=param.log, step=param.step)


def distributions(spec: SweepSpec) -> dict[str, BaseDistribution]:
    return {name: distribution(spec, p) for name, p in spec.parameters.items()}


def grid_size(spec: SweepSpec) -> Optional[int]:
    """How many settings a grid holds (None: not a grid)."""
    if spec.method != "grid":
        return None
    return math.prod(len(p.grid() or []) for p in spec.parameters.values())


def trial_budget(spec: SweepSpec) -> int:
    size = grid_size(spec)
    return min(spec.budget.trials, size) if size is not None else spec.budget.trials


def sampler(spec: SweepSpec, made: int = 0) -> optuna.samplers.BaseSampler:
    """made: trials the study holds already (a rebuilt one). A sampler seeded as at the start would
    draw the settings of the first trials again after a restart: random draws each trial's own
    (seed, number) stream (the same settings with or without pruning, restarts or not), TPE
    continues from a seed moved on by the trials made. The grid knows its visited points."""
    if spec.method == "grid":
        return optuna.samplers.GridSampler({n: p.grid() or [] for n, p in spec.parameters.items()}, seed=spec.seed)
    if spec.method == "random":
        return optuna.samplers.RandomSampler(seed=trial_seed(spec, made))
    # TPE: a few random trials first; constant_liar keeps parallel trials from all asking the same point
    return optuna.samplers.TPESampler(seed=trial_seed(spec, made),
                                      n_startup_trials=min(5, max(2, spec.budget.trials // 4)), constant_liar=True)


def trial_seed(spec: SweepSpec, number: int) -> int:
    return (spec.seed * 1_000_003 + number) % 2**32


def before_ask(study: optuna.Study, spec: SweepSpec) -> None:
    """Random search: the next trial's settings from its own seed (see sampler)."""
    if spec.method == "random":
        study.sampler = optuna.samplers.RandomSampler(seed=trial_seed(spec, len(study.get_trials(deepcopy=False))))


def pruner(spec: SweepSpec) -> optuna.pruners.BasePruner:
    p = spec.pruner
    if p.kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=p.startup_trials, n_warmup_steps=p.warmup_steps)
    if p.kind == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=p.min_resource or "auto",
                                                      reduction_factor=p.reduction_factor)
    if p.kind == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=p.min_resource or 1, reduction_factor=p.reduction_factor)
    return optuna.pruners.NopPruner()


def new_study(spec: SweepSpec, made: int = 0) -> optuna.Study:
    return optuna.create_study(direction="minimize" if spec.objective.goal == "min" else "maximize",
                               sampler=sampler(spec, made), pruner=pruner(spec))


def rebuild(spec: SweepSpec, trials: Iterable[SweepTrial], series: dict[int, list[tuple[int, float]]]) -> optuna.Study:
    """The study as it was: every trial added back in number order (Optuna numbers them as added),
    with its settings, state, value, Optuna's attributes and its objective points so far."""
    trials = sorted(trials, key=lambda t: t.number)
    study = new_study(spec, len(trials))
    dists = distributions(spec)
    for t in trials:
        points = series.get(t.job_id, [])
        if t.state == "pruned" and t.pruned_step is not None:
            points = [p for p in points if p[0] <= t.pruned_step]
        params = json.loads(t.params)
        study.add_trial(optuna.trial.create_trial(
            state=STATES[t.state], value=t.value if t.state == "complete" else None, params=params,
            distributions={n: dists[n] for n in params if n in dists},
            system_attrs=json.loads(t.system_attrs), intermediate_values=dict(points)))
    return study


def importance(spec: SweepSpec, trials: list[SweepTrial]) -> dict[str, float]:
    """Each parameter's importance for the objective over the completed trials: Optuna's PED-ANOVA
    evaluator (its default, fANOVA, needs scikit-learn); empty until enough trials completed."""
    done = [t for t in trials if t.state == "complete" and t.value is not None]
    if len(done) < 2 or len(spec.parameters) < 1:
        return {}
    study = rebuild(spec, done, {})
    try:
        with warnings.catch_warnings():  # PED-ANOVA is marked experimental
            warnings.simplefilter("ignore")
            evaluator = optuna.importance.PedAnovaImportanceEvaluator()
            found = optuna.importance.get_param_importances(study, evaluator=evaluator)
    except (RuntimeError, ValueError):  # e.g. every completed trial has the same settings
        return {}
    return {k: float(v) for k, v in found.items()}
