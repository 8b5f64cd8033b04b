"""The logging calls a script already makes, read as they happen (logged.py sends what they say):
`wandb.log` (online, offline or disabled), TensorBoard's `SummaryWriter.add_scalar/add_scalars`,
`mlflow.log_metric(s)`, Lightning's `self.log` (what its logger connector hands to its loggers, also
with `logger=False`), `Accelerator.log` and `trackio.log`.

Each is patched right after its module loads (boot.py registers the import hooks), by a wrapper that
calls the original with the same arguments and returns what it returns: the user's backend keeps
working exactly as before. The arguments are read before the call, and sent only when the call
returned (a call the user's logger refused is not a value). A failure of ours is swallowed. A script
that replaces `wandb.log` with its own function keeps it (ours is on wandb's Run class, underneath).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from . import logged
from .imports import when_imported

Reader = Callable[..., "tuple[dict, Optional[Any]]"]  # the call's arguments -> (values, step)


def _reading(orig: Callable, label: str, read: Reader) -> Callable:
    @functools.wraps(orig)
    def logging_call(*a, **k):
        with logged.outermost() as first:
            said = None
            if first:
                try:
                    values, step = read(*a, **k)
                    said = (dict(values), step)
                except Exception:
                    said = None
            result = orig(*a, **k)
            if said is not None:
                try:
                    logged.capture(label, *said)
                except Exception:
                    pass  # reading must never break the user's logging
            return result
    logging_call._tp_reads = True  # type: ignore[attr-defined]
    return logging_call


def _patch(owner: Any, name: str, label: str, read: Reader) -> None:
    orig = getattr(owner, name, None)
    if orig is None or getattr(orig, "_tp_reads", False):
        return
    setattr(owner, name, _reading(orig, label, read))


# ---- what each call says: (values, step) ------------------------------------------------------------

def _wandb(self, data=None, step=None, *a, **k):
    return (data if isinstance(data, dict) else {}), step


def _add_scalar(self, tag, scalar_value, global_step=None, *a, **k):
    return {tag: scalar_value}, global_step


def _add_scalars(self, main_tag, tag_scalar_dict, global_step=None, *a, **k):
    return {f"{main_tag}/{t}": v for t, v in tag_scalar_dict.items()}, global_step


def _mlflow_metric(key, value, step=None, *a, **k):
    return {key: value}, step


def _mlflow_metrics(metrics, step=None, *a, **k):
    return metrics, step


def _lightning(self, metrics, step=None):
    # the step Lightning's loggers get (logger_connector.log_metrics): given, a logged `step`, or the
    # batches that stepped the optimizer
    values = {k: v for k, v in metrics.items() if k != "step"}
    if step is None:
        step = metrics.get("step")
    if step is None:
        step = self.trainer.fit_loop.epoch_loop._batches_that_stepped
    return values, step


def _values_step(self, values, step=None, *a, **k):
    return values, step


def _trackio(metrics, step=None, *a, **k):
    return metrics, step


# ---- installed when each module loads ----------------------------------------------------------------

def install_wandb(module) -> None:
    _patch(module.Run, "log", "wandb.log", _wandb)


def install_wandb_disabled(module) -> None:
    _patch(module.NoopRun, "log", "wandb.log", _wandb)  # wandb.init(mode="disabled")


def install_tensorboard(module) -> None:
    _patch(module.SummaryWriter, "add_scalar", "SummaryWriter.add_scalar", _add_scalar)
    _patch(module.SummaryWriter, "add_scalars", "SummaryWriter.add_scalars", _add_scalars)


def install_mlflow(module) -> None:
    _patch(module, "log_metric", "mlflow.log_metric", _mlflow_metric)
    _patch(module, "log_metrics", "mlflow.log_metrics", _mlflow_metrics)
    top = __import__("sys").modules.get("mlflow")
    if top is not None:  # already re-exported: point those names at the reading functions too
        for name in ("log_metric", "log_metrics"):
            if getattr(getattr(top, name, None), "__wrapped__", None) is getattr(module, name).__wrapped__:
                setattr(top, name, getattr(module, name))


def install_lightning(module) -> None:
    _patch(module._LoggerConnector, "log_metrics", "Lightning self.log", _lightning)


def install_accelerate(module) -> None:
    _patch(module.Accelerator, "log", "accelerator.log", _values_step)


def install_trackio(module) -> None:
    _patch(module, "log", "trackio.log", _trackio)


def register() -> None:
    """The import hooks (boot.py): nothing is loaded or patched until the script imports it."""
    when_imported("wandb.sdk.wandb_run", install_wandb)
    when_imported("wandb.sdk.lib.noop_run", install_wandb_disabled)
    when_imported("torch.utils.tensorboard.writer", install_tensorboard)
    when_imported("mlflow.tracking.fluent", install_mlflow)
    for pkg in ("lightning.pytorch", "pytorch_lightning"):
        when_imported(f"{pkg}.trainer.connectors.logger_connector.logger_connector", install_lightning)
    when_imported("accelerate.accelerator", install_accelerate)
    when_imported("trackio", install_trackio)
