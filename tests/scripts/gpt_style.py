"""A GPT training loop as people write it (no tokenpulse import): its own get_batch, a model called
with positional tensors model(X, Y), a GradScaler, gradient accumulation, an evaluation at iteration
0, a line printed every 10 iterations. How it ends is chosen: --end {normal,exit,raise,term}."""
import argparse
import os
import signal
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--max_iters", type=int, default=40)
p.add_argument("--accum", type=int, default=2)
p.add_argument("--end", default="normal")
p.add_argument("--end_at", type=int, default=-1)
p.add_argument("--save", default="")
args = p.parse_args()

torch.manual_seed(1337)
vocab, block, batch = 64, 16, 4
data = torch.randint(0, vocab, (4000,))


def get_batch():
    ix = torch.randint(len(data) - block - 1, (batch,))
    x = torch.stack([data[i:i + block] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block] for i in ix])
    return x, y


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab, 32)
        self.wpe = nn.Embedding(block, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, vocab)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1])
        h = self.wte(idx) + self.wpe(pos)
        logits = self.head(h + self.mlp(h))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, vocab), targets.view(-1))
        return logits, loss


model = TinyGPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)


@torch.no_grad()
def estimate_loss():
    model.eval()
    losses = torch.zeros(5)
    for k in range(5):
        X, Y = get_batch()
        _, loss = model(X, Y)
        losses[k] = loss.item()
    model.train()
    return losses.mean()


iter_num = 0
X, Y = get_batch()
t0 = time.time()
while True:
    if iter_num % 20 == 0:
        print(f"step {iter_num}: val loss {estimate_loss():.4f}", flush=True)
    total = 0.0
    for _micro_step in range(args.accum):
        logits, loss = model(X, Y)
        loss = loss / args.accum
        X, Y = get_batch()
        scaler.scale(loss).backward()
        total += loss.item()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if iter_num % 10 == 0:
        dt = time.time() - t0
        t0 = time.time()
        print(f"iter {iter_num}: loss {total:.4f}, time {dt * 1000:.2f}ms", flush=True)
    iter_num += 1
    if iter_num == args.end_at:
        if args.end == "exit":
            sys.exit(3)
        if args.end == "raise":
            raise RuntimeError(f"diverged after {iter_num} iterations")
        if args.end == "term":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
    if iter_num >= args.max_iters:
        break
if args.save:
    torch.save(model, args.save)
print("done", flush=True)
