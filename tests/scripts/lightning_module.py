"""A LightningModule trained by Lightning's Trainer (no tokenpulse import): automatic optimization
(optimizer.step(closure)), a validation sanity check before the first step, a line printed every 10
steps. --optimizers 2: two optimizers stepped each iteration by hand (manual optimization)."""
import argparse
import os

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--max_steps", type=int, default=30)
p.add_argument("--optimizers", type=int, default=1)
args = p.parse_args()
torch.manual_seed(3)
vocab, seq = 40, 10
tokens = torch.randint(0, vocab, (400, seq + 1))
train = DataLoader(TensorDataset(tokens[:320]), batch_size=8, shuffle=True)
val = DataLoader(TensorDataset(tokens[320:]), batch_size=8)


class TinyLM(L.LightningModule):
    def __init__(self, optimizers: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, vocab)
        self.n_opt = optimizers
        self.automatic_optimization = optimizers == 1

    def forward(self, idx):
        return self.head(torch.tanh(self.emb(idx)))

    def loss(self, batch):
        (x,) = batch
        return F.cross_entropy(self(x[:, :-1]).reshape(-1, vocab), x[:, 1:].reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self.n_opt > 1:
            for opt in self.optimizers():
                opt.zero_grad()
            self.manual_backward(loss)
            for opt in self.optimizers():
                opt.step()
        step = self.global_step if self.automatic_optimization else batch_idx
        if step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
        return loss

    def validation_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        if self.n_opt == 1:
            return torch.optim.SGD(self.parameters(), lr=0.5)
        return [torch.optim.SGD(self.emb.parameters(), lr=0.5), torch.optim.SGD(self.head.parameters(), lr=0.5)]


trainer = L.Trainer(max_steps=args.max_steps, accelerator="cpu", devices=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    limit_val_batches=3, num_sanity_val_steps=2, default_root_dir=os.getcwd())
trainer.fit(TinyLM(args.optimizers), train, val)
print("fit done", flush=True)
