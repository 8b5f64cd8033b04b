"""A plain torchrun DDP loop (gloo on CPU): `torchrun --nproc-per-node 2 ddp_loop.py`."""
import os
import sys

import torch
import torch.distributed as dist
from userdata import FAULT, RANK, TinyLM, after_step, evaluate, read_batch, save_checkpoint, striking

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 400
out = os.environ.get("OUT_DIR", ".")
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(TinyLM())
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(1, steps + 1):
    batch = read_batch(step)
    loss = model(**batch)["loss"]
    loss.backward()
    opt.step()
    opt.zero_grad()
    mean = loss.detach().clone()
    if not striking(step, "skip_collective"):
        dist.all_reduce(mean)  # the loss averaged over ranks, for the log
    elif FAULT == "skip_collective":
        dist.barrier()  # this rank went on to the next collective: the others wait in all_reduce
    if step % 50 == 0 and RANK == 0:
        print(f"step {step} loss {mean.item() / dist.get_world_size():.3f}", flush=True)
    if step % 20 == 0:
        val = evaluate(model.module, step)
        if RANK == 0:
            print(f"eval loss {val:.3f}", flush=True)
    if step % 25 == 0 and RANK == 0:
        save_checkpoint(model.module, step, out)
    after_step(step)
    if step % 25 == 0:
        dist.barrier()  # the others wait for rank 0's checkpoint
dist.destroy_process_group()
print("done", flush=True)
