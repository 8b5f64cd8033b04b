"""A plain PyTorch training loop with no tokenpulse import, as users write them: a Dataset whose
items come from the script's own data function, a DataLoader, an optimizer; optionally under
Accelerate (--accelerate) or DDP under torchrun (--ddp, gloo on CPU). The tests run it unchanged as
a command job: the startup hook must make its steps, tokens and step anatomy visible.

Test situations only: the data function blocks forever at a step (on one rank), evaluations run
slowly every few steps, gradient accumulation."""
import argparse
import os
import time

import torch
from torch.utils.data import DataLoader, Dataset

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--block-at", type=int, default=-1)
p.add_argument("--block-rank", type=int, default=0)
p.add_argument("--accelerate", action="store_true")
p.add_argument("--ddp", action="store_true")
p.add_argument("--accum", type=int, default=1)
p.add_argument("--eval-every", type=int, default=0)
p.add_argument("--eval-batches", type=int, default=6)
p.add_argument("--eval-sleep", type=float, default=0.0)
p.add_argument("--step-sleep", type=float, default=0.03)
args = p.parse_args()
rank = int(os.environ.get("RANK", "0"))
calls = [0]


def read_shard(i):
    """The user's own data function: the tests make it block forever."""
    calls[0] += 1
    if rank == args.block_rank and args.block_at >= 0 and calls[0] > args.block_at * args.accum * 4:
        while True:  # the test's hang: a shard that never arrives
            time.sleep(1)
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(1, 100, (24,), generator=g)
    mask = (torch.arange(24) < 16 + i % 8).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


class Shards(Dataset):
    def __len__(self):
        return 1_000_000

    def __getitem__(self, i):
        return read_shard(i)


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(100, 32)
        self.out = torch.nn.Linear(32, 100)

    def forward(self, input_ids, attention_mask=None):
        return self.out(self.emb(input_ids))


torch.manual_seed(0)
model = TinyLM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = DataLoader(Shards(), batch_size=4)
loss_fn = torch.nn.CrossEntropyLoss()
accelerator = None
if args.accelerate:
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accum)
    model, opt, loader = accelerator.prepare(model, opt, loader)
elif args.ddp:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(model)


def evaluate():
    with torch.no_grad():
        for _, batch in zip(range(args.eval_batches), loader):
            model(**batch)
            time.sleep(args.eval_sleep)


step = 0
for i, batch in enumerate(loader):
    logits = model(**batch)
    loss = loss_fn(logits.view(-1, 100), batch["input_ids"].view(-1)) / (1 if accelerator else args.accum)
    if accelerator is not None:
        with accelerator.accumulate(model):
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        if not accelerator.sync_gradients:
            continue
    else:
        loss.backward()
        if (i + 1) % args.accum:
            continue
        opt.step()
        opt.zero_grad()
    step += 1
    time.sleep(args.step_sleep)
    if args.eval_every and step % args.eval_every == 0:
        evaluate()
    if step >= args.steps:
        break
print(f"finished {step} steps", flush=True)
