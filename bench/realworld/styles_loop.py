"""A small character-level language model trained by a plain loop in the styles people write, with
no tokenpulse import: its own `get_batch`, a loss logged every few steps through the logger the
style names, and its own record of what it logged (--record, JSON {step: loss}) so a test can hold
the dashboard's series against the script's own numbers.

Styles: tensorboard (SummaryWriter.add_scalar at the iteration), wandb (offline: WANDB_MODE),
mlflow (a local file store), trackio, print (nanoGPT-like: GradScaler, gradient accumulation,
`print(f"iter {it}: loss {loss:.4f}")` only). Faults for the benchmark: the data function blocks
(--hang-data-at N), the evaluation blocks (--hang-eval).
"""
import argparse
import json
import math
import os
import time

import fault  # bench/realworld/fault.py, beside this script
import torch

p = argparse.ArgumentParser()
p.add_argument("--style", choices=("tensorboard", "wandb", "mlflow", "trackio", "print"), required=True)
p.add_argument("--iters", type=int, default=40)
p.add_argument("--log-every", type=int, default=5)
p.add_argument("--accum", type=int, default=1)
p.add_argument("--eval-every", type=int, default=0)
p.add_argument("--record", default="")
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--hang-data-at", type=int, default=-1)
p.add_argument("--hang-data-after-s", type=float, default=-1, help="hang in the data function so long after its start")
p.add_argument("--hang-eval", action="store_true")
p.add_argument("--nan-at", type=int, default=-1, help="log a NaN loss at this iteration (bad input)")
p.add_argument("--print-decoys", action="store_true", help="also print another loss and lines that look like one")
args = p.parse_args()

torch.manual_seed(0)
VOCAB, CTX, BATCH = 64, 32, 8
data = torch.randint(0, VOCAB, (20_000,))
calls = [0]
first_call: list[float] = []



def get_batch():
    calls[0] += 1
    if not first_call:
        first_call.append(time.monotonic())
    late = 0 <= args.hang_data_after_s <= time.monotonic() - first_call[0]
    if late or 0 <= args.hang_data_at < calls[0] // args.accum:
        fault.mark()  # a shard that never arrives
        while True:
            time.sleep(1)
    ix = torch.randint(len(data) - CTX - 1, (BATCH,))
    x = torch.stack([data[i:i + CTX] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + CTX] for i in ix])
    return x, y


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 48)
        self.mix = torch.nn.Linear(48, 48)
        self.head = torch.nn.Linear(48, VOCAB)

    def forward(self, input_ids, targets=None):
        logits = self.head(torch.tanh(self.mix(self.emb(input_ids))))
        if targets is None:
            return logits, None
        return logits, torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


@torch.no_grad()
def evaluate(model):
    if args.hang_eval:
        fault.mark()  # an evaluation that never ends
        while True:
            time.sleep(1)
    model.eval()
    losses = [model(input_ids=x, targets=y)[1].item() for x, y in (get_batch() for _ in range(4))]
    model.train()
    return sum(losses) / len(losses)


model = TinyLM()
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
scaler = torch.amp.GradScaler("cpu", enabled=args.style == "print")
record: dict[int, float] = {}

if args.style == "tensorboard":
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(os.path.join(os.getcwd(), "tb"))
elif args.style == "wandb":
    import wandb
    wandb.init(project="styles-loop", dir=os.getcwd(), config={"lr": 3e-3})
elif args.style == "mlflow":
    import mlflow
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # a local file store, as many scripts have
    mlflow.set_tracking_uri("file://" + os.path.join(os.getcwd(), "mlruns"))
    mlflow.start_run()
elif args.style == "trackio":
    import trackio
    trackio.init(project="styles-loop")


def log(it: int, values: dict) -> None:
    if args.style == "tensorboard":
        for k, v in values.items():
            writer.add_scalar(k, v, it)
    elif args.style == "wandb":
        wandb.log(values, step=it)
    elif args.style == "mlflow":
        mlflow.log_metrics(values, step=it)
    elif args.style == "trackio":
        trackio.log(values, step=it)
    else:
        print(" ".join(f"{k} {v:.4f}," for k, v in values.items()).rstrip(",").replace("loss", f"iter {it}: loss", 1)
              if "loss" in values else f"iter {it}: " + ", ".join(f"{k} {v:.4f}" for k, v in values.items()),
              flush=True)


for it in range(1, args.iters + 1):
    total = 0.0
    for _ in range(args.accum):
        x, y = get_batch()
        _, loss = model(input_ids=x, targets=y)
        loss = loss / args.accum
        scaler.scale(loss).backward()
        total += loss.item()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    if args.step_sleep:
        time.sleep(args.step_sleep)
    if it % args.log_every == 0:
        value = float("nan") if it == args.nan_at else total
        record[it] = round(value, 4) if math.isfinite(value) else value
        log(it, {"loss": value})
        if args.print_decoys:
            print(f"iter {it}: loss {10 * total:.4f} (x10), lossless 3, loss of signal 5", flush=True)
    if args.eval_every and it % args.eval_every == 0:
        log(it, {"val_loss": evaluate(model)})

if args.style == "tensorboard":
    writer.close()
elif args.style == "wandb":
    wandb.finish()
elif args.style == "mlflow":
    mlflow.end_run()
elif args.style == "trackio":
    trackio.finish()
if args.record:
    with open(args.record, "w") as f:
        json.dump({str(k): v for k, v in record.items()}, f)
