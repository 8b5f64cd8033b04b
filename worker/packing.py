"""Turn tokenized examples into micro-batches: packed rows, dynamic padding or (wasteful) max_length.

Targets are built here, already shifted (targets[t] = token t+1 of the same example, or -100), so the
loss never crosses an example boundary and padding never counts, whatever the layout.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterator, Optional

import numpy as np
import torch

from .tokenization import Tokenized

IGNORE = -100


@dataclass
class Layout:
    mode: str  # "pack" | "dynamic" | "max_length"
    max_len: int  # examples are truncated to this many tokens
    row_len: int  # pack: tokens per packed row; max_length: = max_len; dynamic: longest allowed
    rows: int  # rows per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    group_by_length: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def pack_rows(lengths: np.ndarray, order: np.ndarray, row_len: int, window: int = 64) -> list[list[int]]:
    """First-fit over a window of open rows: near-zero waste, and order stays mostly shuffled."""
    rows: list[list[int]] = []
    open_rows: list[int] = []  # indices into rows, with their free space in `free`
    free: list[int] = []
    for i in order:
        n = int(lengths[i])
        for k, space in enumerate(free):
            if n <= space:
                rows[open_rows[k]].append(int(i))
                free[k] -= n
                if free[k] < 8:  # practically full: stop scanning it
                    del open_rows[k], free[k]
                break
        else:
            rows.append([int(i)])
            if row_len - n >= 8:
                open_rows.append(len(rows) - 1)
                free.append(row_len - n)
                if len(open_rows) > window:
                    del open_rows[0], free[0]
    return rows


def epoch_batches(data: Tokenized, layout: Layout, seed: int, epoch: int) -> list[list[list[int]]]:
    """The epoch's micro-batches (each a list of rows, each row a list of example indices)."""
    rng = np.random.default_rng([seed, epoch])
    lengths = np.minimum(data.lengths, layout.max_len)
    order = rng.permutation(data.n)
    order = order[lengths[order] >= 2]  # a 1-token example has nothing to predict
    B = layout.rows
    if layout.mode == "pack":
        # Attention cost grows with the row, so rows may be shorter than max_len: the few examples
        # longer than row_len get rows of their own (long_len), in micro-batches of the same token size.
        long_len = long_row_len(layout)
        short = order[lengths[order] <= layout.row_len]
        long = order[lengths[order] > layout.row_len]
        batches = []
        for idx, width, rows_per in ((short, layout.row_len, B), (long, long_len, max(1, B * layout.row_len // long_len))):
            rows = pack_rows(lengths, idx, width)
            rows = [rows[j] for j in rng.permutation(len(rows))]  # first-fit fills early rows best; mix
            batches += [rows[k:k + rows_per] for k in range(0, len(rows), rows_per)]
        return [batches[j] for j in rng.permutation(len(batches))] if long.size else batches
    if layout.group_by_length and layout.mode == "dynamic":
        # Sort inside mega-batches of 50 micro-batches: similar lengths together, order still random.
        mega = 50 * B
        order = np.concatenate([c[np.argsort(-lengths[c], kind="stable")]
                                for c in np.array_split(order, max(1, -(-len(order) // mega)))])
        batches = [order[k:k + B] for k in range(0, len(order), B)]
        batches = [batches[j] for j in rng.permutation(len(batches))]
    else:
        batches = [order[k:k + B] for k in range(0, len(order), B)]
    return [[[int(i)] for i in b] for b in batches]


def long_row_len(layout: Layout) -> int:
    return max(layout.row_len, -(-layout.max_len // 8) * 8)


def micro_stream(data: Tokenized, layout: Layout, seed: int, start_epoch: int = 0) -> Iterator[tuple[int, list]]:
    """(epoch, micro-batch) forever, epoch after epoch (the loop decides when to stop)."""
    epoch = start_epoch
    while True:
        batches = epoch_batches(data, layout, seed, epoch)
        if not batches:
            return
        for b in batches:
            yield epoch, b
        epoch += 1


def collate(data: Tokenized, rows: list[list[int]], layout: Layout, pad_id: int) -> dict:
    """Tensors for one micro-batch plus host-side counts (no device sync needed to normalize loss).

    No attention_mask: padding is always on the right, so causal attention never lets a real token
    see a pad; packed rows are separated by position_ids restarting at 0.
    """
    L = layout.max_len
    seqs = [[data.ids(i, L) for i in row] for row in rows]
    used = [sum(len(s) for s in row) for row in seqs]
    if layout.mode == "pack":
        width = layout.row_len if max(used) <= layout.row_len else long_row_len(layout)
    else:
        width = layout.row_len if layout.mode == "max_length" else max(used)
    B = len(rows)
    ids = np.full((B, width), pad_id, np.int64)
    pos = np.tile(np.arange(width, dtype=np.int64), (B, 1))
    tgt = np.full((B, width), IGNORE, np.int64)
    n_targets = 0
    for r, row in enumerate(rows):
        c = 0
        for i, s in zip(row, seqs[r]):
            n = len(s)
            ids[r, c:c + n] = s
            pos[r, c:c + n] = np.arange(n)
            start = max(int(data.prompt_lens[i]) - 1, 0)
            if start < n - 1:
                tgt[r, c + start:c + n - 1] = s[start + 1:]
                n_targets += n - 1 - start
            c += n
        if c < width:  # positions continue into the pad tail so it never looks like a new example
            pos[r, c:] = np.arange(pos[r, c - 1] + 1, pos[r, c - 1] + 1 + width - c) if c else np.arange(width)
    out = {"input_ids": torch.from_numpy(ids), "targets": torch.from_numpy(tgt), "n_real": sum(used),
           "n_padded": B * width, "n_targets": n_targets, "n_examples": sum(len(r) for r in rows)}
    if layout.mode == "pack":  # only packed rows need them (and some models take no position_ids)
        out["position_ids"] = torch.from_numpy(pos)
    return out


def expected_fill(data: Tokenized, layout: Layout, seed: int) -> float:
    """Real tokens per micro-batch on average (from epoch 0's plan)."""
    batches = epoch_batches(data, layout, seed, 0)
    lengths = np.minimum(data.lengths, layout.max_len)
    real = sum(int(lengths[i]) for b in batches for row in b for i in row)
    return real / max(1, len(batches))
