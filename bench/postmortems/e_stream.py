"""Case e, as the user wrote it: a plain PyTorch loop that fills 4096-token chunks from a slow
streamed dataset and prints nothing until a chunk is full ("hangs after Dataset loaded").
--fixed: the stream wrapped in tqdm, so it reports its progress."""
import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--data", required=True)
p.add_argument("--chunk", type=int, default=4096)
p.add_argument("--latency", type=float, default=0.5, help="seconds the stream takes per record")
p.add_argument("--steps", type=int, default=3)
p.add_argument("--fixed", action="store_true")
args = p.parse_args()


def fetch_records(path):
    """A remote dataset streamed record by record (the network's latency on each)."""
    with open(path) as f:
        for line in f:
            time.sleep(args.latency)
            yield json.loads(line)["text"]


tok = AutoTokenizer.from_pretrained(args.model)
model = AutoModelForCausalLM.from_pretrained(args.model)
print("Dataset loaded", flush=True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
stream = fetch_records(args.data)
if args.fixed:
    from tqdm import tqdm
    stream = iter(tqdm(stream, desc="streaming records", unit="records"))
buf = []
for step in range(args.steps):
    while len(buf) < args.chunk:
        buf.extend(tok(next(stream))["input_ids"])
    ids = torch.tensor([buf[:args.chunk]])
    buf = buf[args.chunk:]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step + 1} loss {loss.item():.3f}", flush=True)
