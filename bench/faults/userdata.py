"""The user's own data and training helpers, as a fault benchmark script imports them: every fault
of bench/faults.py is injected inside one of these functions, so "the right cause" means the alert
names the function and this file (and, for a distributed script, the rank).

Fault switch (environment, set by bench/faults.py): FAULT names the fault, FAULT_STEP the optimizer
step it strikes after, FAULT_RANK the rank it strikes (default 0), FAULT_MARK a file the script
writes the wall-clock time of the fault into (the benchmark measures alert latency from it).
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import statistics
import threading
import time

import torch

FAULT = os.environ.get("FAULT", "")
FAULT_STEP = int(os.environ.get("FAULT_STEP", "15"))
FAULT_RANK = int(os.environ.get("FAULT_RANK", "0"))
RANK = int(os.environ.get("RANK", "0"))
VOCAB, SEQ, BATCH = 512, 64, 8
STEP_S = float(os.environ.get("STEP_S", "0.05"))  # the "I/O" of reading a batch
EVAL_BASE = 1_000_000  # example indices of the held-out set
_lock = threading.Lock()
_leak: list = []
_leak_t = [0.0]  # when the memory fault last grew
_struck: list = []
_reads = [0]  # training examples read by this process (a DataLoader worker: by this worker)
_step = [0]  # the optimizer step the user's loop is at (after_step keeps it)
_step_times: list[float] = []
# The healthy runs' irregular steps: a long first step, slow evaluations, slow checkpoint saves.
FIRST_STEP_S = float(os.environ.get("FIRST_STEP_S", "0"))
EVAL_EXTRA_S = float(os.environ.get("EVAL_EXTRA_S", "0"))
SAVE_EXTRA_S = float(os.environ.get("SAVE_EXTRA_S", "0"))


@atexit.register
def _write_step_log() -> None:
    """The script's typical step (median interval between optimizer steps), for the benchmark's goal."""
    path = os.environ.get("STEP_LOG")
    if path and RANK == 0 and len(_step_times) > 3:
        gaps = [b - a for a, b in zip(_step_times, _step_times[1:])]
        with open(path, "w") as f:
            json.dump({"median_step_s": round(statistics.median(gaps), 4)}, f)


def striking(step: int, fault: str, at_or_after: bool = False) -> bool:
    """True once: when `fault` is the one injected, on its rank, at its step (or the first call at or
    after it, for work that runs every N steps)."""
    if FAULT != fault or RANK != FAULT_RANK or _struck or step < FAULT_STEP or (step > FAULT_STEP and not at_or_after):
        return False
    _struck.append(step)
    mark = os.environ.get("FAULT_MARK")
    if mark:
        with open(f"{os.path.dirname(mark)}/pid.{RANK}", "w") as f:
            f.write(str(os.getpid()))
        with open(f"{mark}.{RANK}", "w") as f:
            f.write(repr(time.time()))
    return True


class TinyLM(torch.nn.Module):
    """A small language model taking a batch dict, like a Hugging Face model's forward."""

    def __init__(self, d: int = 128):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
        self.head = torch.nn.Linear(d, VOCAB)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.emb(input_ids)
        h = h + self.mlp(h)
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100)
        return {"loss": loss, "logits": logits}


class Examples(torch.utils.data.Dataset):
    """Random token sequences of 20-64 tokens."""

    def __init__(self, n: int = 100_000, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(20, SEQ + 1, (n,), generator=g).tolist()
        self.seed = seed

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return read_example(i, self.lengths[i])


def read_example(i: int, length: int) -> dict:
    """Reads one example (a DataLoader worker calls this)."""
    if i < EVAL_BASE:
        _reads[0] += 1
    # the step this read belongs to, counted by reads (a Trainer shuffles: the index says nothing)
    step = (_reads[0] - 1) // BATCH + 1
    if i < EVAL_BASE and striking(step, "worker_hang"):
        threading.Event().wait()  # the worker hangs: the main process waits in the DataLoader
    if i < EVAL_BASE and striking(step, "worker_dies"):
        os._exit(3)
    if i < EVAL_BASE and striking(step, "deadlock"):
        _deadlock()
    if i >= EVAL_BASE and striking(_step[0], "eval_hang", at_or_after=True):
        threading.Event().wait()  # an evaluation that never ends
    ids = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(i))
    return {"input_ids": ids}


def collate(examples: list[dict]) -> dict:
    """Pads a batch to its longest example."""
    if striking(next(_collate_calls), "collate_hang"):
        threading.Event().wait()  # never returns
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros(len(examples), width, dtype=torch.long)
    for r, e in enumerate(examples):
        ids[r, :len(e["input_ids"])] = e["input_ids"]
        mask[r, :len(e["input_ids"])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _counter():
    n = 0
    while True:
        n += 1
        yield n


_collate_calls = _counter()


def _deadlock() -> None:
    with _lock:
        with _lock:  # a non-reentrant lock taken twice: a deadlock in the user's data code
            pass


def read_batch(step: int) -> dict:
    """Reads the next batch from the user's storage (the main thread's own data function)."""
    time.sleep(STEP_S)
    if striking(step, "deadlock"):
        _deadlock()
    g = torch.Generator().manual_seed(step * 7919 + RANK)
    return collate([{"input_ids": torch.randint(0, VOCAB, (int(torch.randint(20, SEQ + 1, (1,), generator=g)),),
                                                generator=g)} for _ in range(BATCH)])


def after_step(step: int) -> None:
    """Per-step bookkeeping of the user's loop: the faults that strike between steps."""
    _step[0] = step
    _step_times.append(time.time())
    if step == 1 and FIRST_STEP_S:
        time.sleep(FIRST_STEP_S)  # e.g. compiling, or filling a cache
    if striking(step, "sigstop"):
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen, as by a debugger or a stopped container
    if FAULT == "slow_rank" and RANK == FAULT_RANK and (striking(step, FAULT) or _struck):
        time.sleep(2 * STEP_S + 0.1)  # this rank is about 3x slower than the others
    if FAULT == "memory" and RANK == FAULT_RANK and (striking(step, FAULT) or _struck):
        # 64 MiB every half second (a cache that keeps every batch), up to ~4 GiB, then it holds:
        # paced by the clock, not the step, so a fast loop does not finish it between two samples
        if len(_leak) < 60 and time.time() - _leak_t[0] >= 0.5:
            _leak_t[0] = time.time()
            _leak.append(torch.ones(16 * 1024 * 1024))


def save_checkpoint(model, step: int, out: str) -> None:
    """Saves the model (every 25 steps)."""
    if striking(step, "checkpoint_hang", at_or_after=True):
        threading.Event().wait()  # e.g. a network filesystem that stopped answering
    torch.save(model.state_dict(), os.path.join(out, "checkpoint.pt"))
    time.sleep(SAVE_EXTRA_S)


def evaluate(model, step: int) -> float:
    """A held-out loss over 20 batches (every 20 steps): a healthy evaluation takes ~20 steps' time."""
    if striking(step, "eval_hang", at_or_after=True):
        threading.Event().wait()  # an evaluation that never ends
    time.sleep(EVAL_EXTRA_S)
    model.eval()
    with torch.no_grad():
        losses = [model(**read_batch(10_000 + i))["loss"].item() for i in range(20)]
    model.train()
    return sum(losses) / len(losses)
