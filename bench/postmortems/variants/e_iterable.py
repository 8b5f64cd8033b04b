"""Case e, another user's way: a torch IterableDataset that streams records (the network's latency on
each) and yields 4096-token blocks, through a DataLoader, in a plain loop: nothing is printed until a
block is full. --fixed: the stream reports its progress (tqdm)."""
import argparse
import json
import time

import torch
from torch.utils.data import DataLoader, IterableDataset
from transformers import AutoModelForCausalLM, AutoTokenizer

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--data", required=True)
p.add_argument("--chunk", type=int, default=4096)
p.add_argument("--latency", type=float, default=0.5)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--fixed", action="store_true")
args = p.parse_args()


class RemoteBlocks(IterableDataset):
    def __init__(self, path, tok, block):
        self.path, self.tok, self.block = path, tok, block

    def records(self):
        with open(self.path) as f:
            for line in f:
                time.sleep(args.latency)  # a remote shard, record by record
                yield json.loads(line)["text"]

    def __iter__(self):
        stream = self.records()
        if args.fixed:
            from tqdm import tqdm
            stream = tqdm(stream, desc="records", unit="rec")
        buf = []
        for text in stream:
            buf += self.tok(text)["input_ids"]
            while len(buf) >= self.block:
                yield torch.tensor(buf[:self.block])
                buf = buf[self.block:]


tok = AutoTokenizer.from_pretrained(args.model)
model = AutoModelForCausalLM.from_pretrained(args.model)
loader = DataLoader(RemoteBlocks(args.data, tok, args.chunk), batch_size=1)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
print("model ready, streaming", flush=True)
for step, x in enumerate(loader):
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step + 1} loss {loss.item():.3f}", flush=True)
    if step + 1 >= args.steps:
        break
