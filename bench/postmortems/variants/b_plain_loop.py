"""Case b, another user's way: a plain PyTorch loop with its own DataLoader: 1024-token chunks of the
concatenated texts, 32 a batch, 8 worker processes on a small machine, on the CPU; it prints every 10
steps. --fixed: 4 chunks a batch with 2 accumulation steps, 2 workers (the verdict's own 8 x 2 still
took 75 s a step at 2048 tokens on the loaded 2-core box: over the crawl line, and said so)."""
import argparse
import json

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--data", required=True)
p.add_argument("--out", default=None)
p.add_argument("--max-steps", type=int, default=2000)
p.add_argument("--max-length", type=int, default=1024)
p.add_argument("--batch", type=int, default=32)
p.add_argument("--workers", type=int, default=8)
p.add_argument("--fixed", action="store_true")
args = p.parse_args()


class Chunks(Dataset):
    def __init__(self, path, tok, block):
        ids = []
        for line in open(path):
            ids += tok(json.loads(line)["text"])["input_ids"] + [tok.eos_token_id]
        self.blocks = [ids[i:i + block] for i in range(0, len(ids) - block, block)]

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return torch.tensor(self.blocks[i])


tok = AutoTokenizer.from_pretrained(args.model)
ds = Chunks(args.data, tok, args.max_length)
accum = 2 if args.fixed else 1
loader = DataLoader(ds, batch_size=args.batch // 8 if args.fixed else args.batch, shuffle=True,
                    num_workers=2 if args.fixed else args.workers, drop_last=True)
model = AutoModelForCausalLM.from_pretrained(args.model).to("cpu")
opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
step = 0
while step < args.max_steps:
    for i, x in enumerate(loader):
        loss = model(x, labels=x).loss / accum
        loss.backward()
        if (i + 1) % accum:
            continue
        opt.step()
        opt.zero_grad()
        step += 1
        if step % 10 == 0:
            print(f"step {step}: loss {loss.item() * accum:.3f}", flush=True)
        if step >= args.max_steps:
            break
