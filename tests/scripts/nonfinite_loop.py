"""A plain loop whose values turn non-finite: `log` mode logs a metric through tokenpulse.log that is
NaN at step 3, -inf at step 4 and NaN at its last step (12); `backward` mode's loss is inf at one
optimizer step (the 7th), its gradient zeroed so the steps after it are finite again."""
import sys

import torch

import tokenpulse

w = torch.nn.Parameter(torch.ones(4))
opt = torch.optim.SGD([w], lr=0.01)
for it in range(12):
    loss = (w * torch.ones(4)).sum()
    if it == 6:
        loss = loss * float("inf")
    loss.backward()
    w.grad.nan_to_num_(0.0, 0.0, 0.0)
    opt.step()
    opt.zero_grad()
    if sys.argv[1] == "log":
        tokenpulse.log({"score": float("nan") if it == 3 else float("-inf") if it == 4 else float(it)}, step=it)
if sys.argv[1] == "log":
    tokenpulse.log({"score": float("nan")}, step=12)
