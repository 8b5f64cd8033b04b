"""A word-level LSTM language model as people write it (no tokenpulse import): no optimizer object,
the update written by hand after loss.backward(), a line printed every 10 batches, and at the end the
model saved whole (torch.save(model, f)) and loaded back with weights_only=True and its safe globals."""
import argparse
import math
import time

import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--batches", type=int, default=30)
p.add_argument("--save", default="model.pt")
args = p.parse_args()
torch.manual_seed(7)
ntokens, bptt, bsz, lr = 50, 12, 4, 5.0
corpus = torch.randint(0, ntokens, (bptt * bsz * (args.batches + 1),)).view(bsz, -1).t().contiguous()


class RNNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Embedding(ntokens, 24)
        self.rnn = nn.LSTM(24, 24)
        self.decoder = nn.Linear(24, ntokens)

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.encoder(input), hidden)
        return self.decoder(output).view(-1, ntokens), hidden

    def init_hidden(self, n):
        w = next(self.parameters())
        return (w.new_zeros(1, n, 24), w.new_zeros(1, n, 24))


def get_batch(source, i):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


model = RNNModel()
criterion = nn.NLLLoss()
model.train()
hidden = model.init_hidden(bsz)
total_loss, start = 0.0, time.time()
for batch, i in enumerate(range(0, bptt * args.batches, bptt), 1):
    data, targets = get_batch(corpus, i)
    hidden = tuple(h.detach() for h in hidden)
    model.zero_grad()
    output, hidden = model(data, hidden)
    loss = criterion(torch.log_softmax(output, -1), targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    for q in model.parameters():
        q.data.add_(q.grad, alpha=-lr)
    if batch % 10 == 0:
        print(f"| epoch 1 | {batch:5d}/{args.batches:5d} batches | ms/batch {(time.time() - start) * 100:5.2f} "
              f"| loss {loss.item():5.2f} | ppl {math.exp(loss.item()):8.2f}", flush=True)
        start = time.time()
with open(args.save, "wb") as f:
    torch.save(model, f)
with open(args.save, "rb") as f:
    with torch.serialization.safe_globals([RNNModel, nn.Embedding, nn.LSTM, nn.Linear]):
        model = torch.load(f, weights_only=True)
print("loaded", type(model).__name__, flush=True)
