"""A LightningModule trained by Lightning's own Trainer, with no tokenpulse import: `self.log` of its
training loss (on the progress bar) and of a validation loss, Lightning's default logger, its
progress bar. --record writes the script's own numbers at the steps it logs (JSON {global_step: loss}).
Faults for the benchmark: the data function blocks (--hang-data-at N), the validation blocks."""
import argparse
import json
import time

import fault  # bench/realworld/fault.py, beside this script
import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
p.add_argument("--log-every", type=int, default=5)
p.add_argument("--val-every", type=int, default=10)
p.add_argument("--record", default="")
p.add_argument("--hang-data-at", type=int, default=-1)
p.add_argument("--hang-eval", action="store_true")
p.add_argument("--hang-data-after-s", type=float, default=-1, help="hang in the data function so long after its start")
p.add_argument("--hang-collate-at", type=int, default=-1)
args = p.parse_args()
VOCAB, CTX = 64, 16
collated = [0]
first_call: list[float] = []



def collate(rows):
    collated[0] += 1
    if 0 <= args.hang_collate_at < collated[0]:
        fault.mark()  # a collate function that never returns
        while True:
            time.sleep(1)
    return torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])


def make_example(i):
    if not first_call:
        first_call.append(time.monotonic())
    late = 0 <= args.hang_data_after_s <= time.monotonic() - first_call[0]
    if late or 0 <= args.hang_data_at < i // 8:
        fault.mark()  # a shard that never arrives
        while True:
            time.sleep(1)
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, VOCAB, (CTX + 1,), generator=g)
    return ids[:-1], ids[1:]


class Tokens(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return make_example(i)


class TinyLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.head = torch.nn.Linear(32, VOCAB)
        self.seen: dict[int, float] = {}

    def forward(self, input_ids):
        return self.head(self.emb(input_ids))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x).view(-1, VOCAB), y.view(-1))
        if (self.global_step + 1) % args.log_every == 0:  # the steps Lightning logs (log_every_n_steps)
            self.seen[self.global_step] = round(loss.item(), 4)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        if args.hang_eval:
            fault.mark()  # a validation that never ends
            while True:
                time.sleep(1)
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x).view(-1, VOCAB), y.view(-1)))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


torch.manual_seed(0)
model = TinyLM()
trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, log_every_n_steps=args.log_every,
                    val_check_interval=args.val_every, limit_val_batches=2, check_val_every_n_epoch=None,
                    enable_checkpointing=False, enable_model_summary=False, default_root_dir=".")
trainer.fit(model, DataLoader(Tokens(10_000_000), batch_size=8, collate_fn=collate),
            DataLoader(Tokens(64), batch_size=8))
if args.record:
    with open(args.record, "w") as f:
        json.dump({str(k): v for k, v in model.seen.items()}, f)
