"""The corpus of real training programs, run unchanged by bench/realworld.py and tests/test_realworld.py:
frameworks with their own loops and logging (Lightning, a Trainer reporting to TensorBoard or wandb,
TRL's CLI, a script Accelerate ships) and loops of our own in the styles people write
(styles_loop.py). Add a program by adding a Program: its command, what it logs its loss as, where
that loss is read from, and the file in which it records its own numbers (None: it keeps none)."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PY = sys.executable
BIN = Path(PY).parent
OWN = "own.json"  # {step: loss} a program of ours records of what it logged
QUIET = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true"}


@dataclass
class Program:
    name: str
    command: Callable[[Path, Path], list]  # (its directory, a tiny model) -> argv
    loss: str  # the name its training loss is stored under
    source: str  # where that loss is read from, as the job says it (said_source: the logging call, or the source)
    steps: Optional[int] = None  # the optimizer steps it runs (the job's final step)
    eval_loss: Optional[str] = None  # its evaluation's loss, when it evaluates
    lm: bool = True  # a language model: tokens/s expected
    extra_env: dict = field(default_factory=dict)
    own: bool = True  # it records its own numbers (OWN)
    # else its own numbers are the ones it prints (`iter 10: loss 4.1234`), read from the job's log:
    # printed_step_offset is its printed count's distance from the optimizer steps (nanoGPT prints
    # `iter 0` for the first step: 1), printed_places its print precision
    printed_step_offset: Optional[int] = None
    printed_places: int = 4
    faults: tuple = ()  # the faults it can be given (bench/realworld.py FAULTS), by its arguments
    run_long: tuple = ()  # its arguments that keep it training until a fault strikes (they come last: they win)

    def argv(self, tmp: Path, model: Path) -> list:
        return [str(a) for a in self.command(tmp, model)]

    def env(self, tmp: Path) -> dict:
        return {**QUIET, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp), "TRACKIO_DIR": str(tmp / "trackio"),
                "HF_DATASETS_CACHE": str(tmp / "hf-datasets"), **self.extra_env}

    def own_numbers(self, tmp: Path) -> dict[int, float]:
        f = tmp / OWN
        return {int(k): float(v) for k, v in json.loads(f.read_text()).items()} if f.exists() else {}


def printed_numbers(prog: Program, lines: list) -> dict[int, float]:
    """The training loss a program printed, by optimizer step (its own numbers, when it keeps no record)."""
    from worker.agent.printed_metrics import FRACTION, parse
    out = {}
    for line in lines:
        values, step = parse(line)
        if step is None and FRACTION.search(line):  # `| epoch 1 | 20/30 batches |`: one epoch here, its count
            step = int(FRACTION.search(line)["n"])
        if "loss" in values and step is not None and prog.printed_step_offset is not None:
            out[step + prog.printed_step_offset] = values["loss"]
    return out


def said_source(info: dict, name: str) -> str:
    """Where the job says a metric came from: the logging call ('wandb.log'), else its source ('printed')."""
    return (info.get("metric_via") or {}).get(name) or (info.get("metric_sources") or {}).get(name) or ""


def matches(got: dict[int, float], own: dict[int, float], places: int = 4) -> bool:
    """The series equals the program's own numbers at every step it logged, to its print precision."""
    return bool(own) and all(s in got and round(got[s], places) == round(v, places) for s, v in own.items())


def styles(style: str, *extra: str) -> Callable[[Path, Path], list]:
    return lambda tmp, model: [PY, HERE / "styles_loop.py", "--style", style, "--iters", "40",
                               "--eval-every", "20", "--record", tmp / OWN, *extra]


def trainer(report_to: str) -> Callable[[Path, Path], list]:
    return lambda tmp, model: [PY, ROOT / "tests" / "scripts" / "hf_trainer.py", "--model", model,
                               "--data", ROOT / "tokenpulse" / "demo" / "demo.jsonl", "--out", tmp / "out",
                               "--max-steps", "12", "--examples", "120", "--eval-steps", "6",
                               "--report-to", report_to]


def trl_sft(tmp: Path, model: Path) -> list:
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    lines = (ROOT / "tokenpulse" / "demo" / "demo.jsonl").read_text().splitlines()[:200]
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    return [BIN / "trl", "sft", "--model_name_or_path", model, "--dataset_name", data, "--output_dir", tmp / "out",
            "--max_steps", "12", "--logging_steps", "2", "--report_to", "tensorboard", "--use_cpu",
            "--per_device_train_batch_size", "4", "--max_length", "64", "--save_strategy", "no"]


GPT_STYLE = ROOT / "tests" / "scripts" / "gpt_style.py"
LSTM = ROOT / "tests" / "scripts" / "lstm_by_hand.py"
DATA_FAULTS = ("data_early", "data_late", "sigstop", "eval_hang")
LONG_LOOP = ("--iters", "100000", "--step-sleep", "0.02")
PROGRAMS = {p.name: p for p in [
    Program("tensorboard loop", styles("tensorboard"), "loss", "SummaryWriter.add_scalar", 40, "val_loss",
            faults=DATA_FAULTS, run_long=LONG_LOOP),
    Program("wandb loop (offline)", styles("wandb"), "loss", "wandb.log", 40, "val_loss", faults=DATA_FAULTS,
            run_long=LONG_LOOP),
    Program("mlflow loop", styles("mlflow"), "loss", "mlflow.log_metrics", 40, "val_loss"),
    Program("trackio loop", styles("trackio"), "loss", "trackio.log", 40, "val_loss"),
    Program("print loop (GradScaler, accumulation)", styles("print", "--accum", "2"), "loss", "printed", 40,
            "val_loss", faults=DATA_FAULTS, run_long=LONG_LOOP),
    Program("Lightning self.log", lambda tmp, model: [PY, HERE / "lightning_module.py", "--steps", "30",
                                                      "--record", tmp / OWN],
            "train_loss", "Lightning self.log", 30, "val_loss", faults=DATA_FAULTS + ("collate",),
            run_long=("--steps", "100000")),
    Program("Trainer report_to=tensorboard", trainer("tensorboard"), "train/loss", "SummaryWriter.add_scalar", 12,
            "eval/loss", own=False, faults=("collate",), run_long=("--max-steps", "100000")),
    Program("Trainer report_to=wandb (offline)", trainer("wandb"), "train/loss", "wandb.log", 12, "eval/loss",
            own=False),
    Program("trl sft --report_to tensorboard", trl_sft, "train/loss", "SummaryWriter.add_scalar", 12, own=False),
    *([Program("GPT-style loop (positional model(X, Y))",  # the scripts branch's (tests/scripts/gpt_style.py)
               lambda tmp, model: [PY, GPT_STYLE, "--max_iters", "40"], "loss", "backward", 40, "val_loss",
               own=False, printed_step_offset=1)] if GPT_STYLE.exists() else []),
    *([Program("LSTM, hand-written SGD update", lambda tmp, model: [PY, LSTM, "--batches", "30"], "loss",
               "backward", 30, lm=True, own=False, printed_step_offset=0, printed_places=2)]
      if LSTM.exists() else []),
    Program("accelerate test_sync (shipped)", lambda tmp, model: [PY, "-m", "accelerate.test_utils.scripts.test_sync"],
            "", "", lm=False, own=False),
]}
