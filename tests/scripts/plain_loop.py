"""A plain PyTorch loop reporting with the explicit API, as a user would write it."""
import sys
import threading
import time

import torch

import tokenpulse

STEPS = int(sys.argv[1])
BLOCK_AT = int(sys.argv[2]) if len(sys.argv) > 2 else -1
RAISE_AT = int(sys.argv[3]) if len(sys.argv) > 3 else -1


def wait_for_the_other_rank(lock):
    lock.acquire()  # the test's deadlock: nobody ever releases it


tokenpulse.init(name="plain-loop", config={"lr": 0.05, "steps": STEPS}, total_steps=STEPS)
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = [torch.randn(16, 8) for _ in range(20)]
for i in range(len(data)):
    tokenpulse.phase("preparing data", done=i + 1, total=len(data), unit="batches")
lock = threading.Lock()
lock.acquire()
for step in range(1, STEPS + 1):
    x = data[step % len(data)]
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    tokenpulse.log({"loss": loss.item(), "lr": 0.05}, step=step)
    if step == BLOCK_AT:
        wait_for_the_other_rank(lock)
    if step == RAISE_AT:
        raise ValueError(f"loss exploded at step {step}")
    time.sleep(0.05)
tokenpulse.finish()
print("loop done", flush=True)
