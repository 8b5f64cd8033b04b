"""An Accelerate training loop with a DataLoader, as in Accelerate's examples."""
import os
import sys

import torch
from accelerate import Accelerator
from userdata import Examples, TinyLM, after_step, collate, evaluate, save_checkpoint

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 400
out = os.environ.get("OUT_DIR", ".")
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = TinyLM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = torch.utils.data.DataLoader(Examples(), batch_size=8, collate_fn=collate,
                                     num_workers=int(os.environ.get("NUM_WORKERS", "1")))
model, opt, loader = accelerator.prepare(model, opt, loader)
for step, batch in enumerate(loader, start=1):
    loss = model(**batch)["loss"]
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    if step % 50 == 0:
        accelerator.print(f"step {step} loss {loss.item():.3f}")
    if step % 20 == 0:
        accelerator.print(f"eval loss {evaluate(model, step):.3f}")
    if step % 25 == 0:
        save_checkpoint(accelerator.unwrap_model(model), step, out)
    after_step(step)
    if step >= steps:
        break
accelerator.print("done")
