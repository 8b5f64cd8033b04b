"""A plain PyTorch training loop, as people write it: no Trainer, no tqdm, no tokenpulse calls."""
import os
import sys

import torch
from userdata import TinyLM, after_step, evaluate, read_batch, save_checkpoint

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 400
out = os.environ.get("OUT_DIR", ".")
torch.manual_seed(0)
model = TinyLM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(1, steps + 1):
    batch = read_batch(step)
    loss = model(**batch)["loss"]
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step % 50 == 0:
        print(f"step {step} loss {loss.item():.3f}", flush=True)
    if step % 20 == 0:
        print(f"eval loss {evaluate(model, step):.3f}", flush=True)
    if step % 25 == 0:
        save_checkpoint(model, step, out)
    after_step(step)
print("done", flush=True)
