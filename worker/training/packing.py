"""Turn tokenized examples into micro-batches: packed rows, dynamic padding or (wasteful) max_length.

Targets are built here, already shifted (targets[t] = token t+1 of the same example, or -100), so the
loss never crosses an example boundary and padding never counts, whatever the layout.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from .tokenization import Tokenized

IGNORE = -100


@dataclass
class Layout:
    mode: str  # "pack" | "dynamic" | "max_length"
    max_len: int  # examples are truncated to this many tokens
    row_len: int  # pack: tokens per packed row; max_length: = max_len; dynamic: longest allowed
    rows: int  # rows per micro-batch (pack with step_tokens: at most this many)
    grad_accum: int = 1  # micro-batches per optimizer step (fixed-shape steps)
    group_by_length: bool = False
    step_tokens: int = 0  # pack: each optimizer step takes examples up to this many real tokens (0: fixed)
    # pack: a micro-batch's width is its fullest row rounded up to this (8 suits GPU tensor cores; a
    # CPU gains nothing from it and pays the padding, ~1.5 % of the tokens)
    pad_multiple: int = 8

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
        for idx, width, rows_per in ((short, layout.row_len, B),
                                     (long, long_len, max(1, B * layout.row_len // long_len))):
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


def balanced_rows(lengths: np.ndarray, idx: np.ndarray, row_len: int) -> list[list[int]]:
    """Spread examples over ceil(total / row_len) rows, longest first into the emptiest row (LPT).

    Rows end up nearly equal, so a micro-batch padded to its fullest row wastes only a few percent,
    even for a small group (one optimizer step's examples) where fixed-width rows would leave the
    last row half empty.
    """
    import heapq
    total = int(lengths[idx].sum())
    n_rows = max(1, -(-total // row_len))
    heap = [(0, r) for r in range(n_rows)]
    rows: list[list[int]] = [[] for _ in range(n_rows)]
    for i in idx[np.argsort(-lengths[idx], kind="stable")]:
        fill, r = heapq.heappop(heap)
        rows[r].append(int(i))
        heapq.heappush(heap, (fill + int(lengths[i]), r))
    rows = [r for r in rows if r]
    even_out(lengths, rows)
    return rows


def even_out(lengths: np.ndarray, rows: list[list[int]], rounds: int = 64) -> None:
    """Lower the fullest row by moving one example, or swapping two, with a less full row.

    The micro-batch is as wide as its fullest row, so every token the fullest row holds above the
    others is padding in all of them. LPT leaves a few percent; a few moves and swaps bring the
    widest row within a token or two of the mean (the 5 % -> under 1 % of the layout benchmark)."""
    if len(rows) < 2:
        return
    fill = [int(lengths[r].sum()) for r in rows]
    for _ in range(rounds):
        hi = max(range(len(rows)), key=fill.__getitem__)
        best = None  # (new max of the two rows, row, index in the fullest row, index in the other or None)
        for o in range(len(rows)):
            if o == hi:
                continue
            for a, ia in enumerate(rows[hi]):
                la = int(lengths[ia])
                cand = [(None, 0)] + [(b, int(lengths[ib])) for b, ib in enumerate(rows[o])]
                for b, lb in cand:
                    d = la - lb  # tokens moved from the fullest row to row o
                    if d <= 0 or len(rows[hi]) == 1 and b is None:
                        continue
                    top = max(fill[hi] - d, fill[o] + d)
                    if top < fill[hi] and (best is None or top < best[0]):
                        best = (top, o, a, b)
        if best is None:
            return
        _, o, a, b = best
        ia = rows[hi].pop(a)
        moved = int(lengths[ia])
        if b is not None:
            ib = rows[o].pop(b)
            rows[hi].append(ib)
            moved -= int(lengths[ib])
        rows[o].append(ia)
        fill[hi] -= moved
        fill[o] += moved


def _pack_group(lengths: np.ndarray, idx: np.ndarray, layout: Layout, rng) -> list[list[list[int]]]:
    """Micro-batches for one optimizer step's examples: balanced rows of about row_len, and rows of
    their own (about long_len) for the few examples longer than row_len, so one long example never
    widens every row of the micro-batch."""
    long_len = long_row_len(layout)
    short = idx[lengths[idx] <= layout.row_len]
    long = idx[lengths[idx] > layout.row_len]
    rows = balanced_rows(lengths, short, layout.row_len) if short.size else []
    # One example longer than every other row would set the whole micro-batch's width alone: it
    # goes with the long ones (a row of its own size) and the rest are balanced again.
    while len(rows) > 1:
        fills = sorted((int(lengths[r].sum()), k) for k, r in enumerate(rows))
        (top, k), second = fills[-1], fills[-2][0]
        if len(rows[k]) > 1 or top - second <= 8:
            break
        long = np.append(long, rows[k][0])
        short = short[short != rows[k][0]]
        rows = balanced_rows(lengths, short, layout.row_len)
    per = layout.rows
    out = [rows[k:k + per] for k in range(0, len(rows), per)]
    if long.size:
        per = max(1, layout.rows * layout.row_len // long_len)
        rows = balanced_rows(lengths, long, long_len)
        out += [rows[k:k + per] for k in range(0, len(rows), per)]
    return out


def epoch_steps(data: Tokenized, layout: Layout, seed: int, epoch: int) -> list[list[list[list[int]]]]:
    """The epoch's optimizer steps: each a list of micro-batches (lists of rows of example indices).

    Packing with step_tokens: a step takes the next examples of the shuffled order up to step_tokens
    real tokens (so the effective batch is the same whatever the row shape), packed into as few
    micro-batches as the measured micro-batch size allows. Otherwise: grad_accum micro-batches.
    """
    if layout.mode == "pack" and layout.step_tokens:
        rng = np.random.default_rng([seed, epoch])
        lengths = np.minimum(data.lengths, layout.max_len)
        order = rng.permutation(data.n)
        order = order[lengths[order] >= 2]
        ends = np.cumsum(lengths[order])
        # step boundaries where the running total crosses multiples of step_tokens
        cuts = np.searchsorted(ends, np.arange(layout.step_tokens, int(ends[-1]) + layout.step_tokens,
                                               layout.step_tokens), side="left") + 1 if len(order) else []
        steps, start = [], 0
        for c in cuts:
            c = min(int(c), len(order))
            if c > start:
                steps.append(_pack_group(lengths, order[start:c], layout, rng))
                start = c
        return steps
    mb = epoch_batches(data, layout, seed, epoch)
    A = max(1, layout.grad_accum)
    return [mb[k:k + A] for k in range(0, len(mb), A)]


def long_row_len(layout: Layout) -> int:
    return max(layout.row_len, -(-layout.max_len // 8) * 8)


def collate(data: Tokenized, rows: list[list[int]], layout: Layout, pad_id: int) -> dict:
    """Tensors for one micro-batch plus host-side counts (no device sync needed to normalize loss).

    No attention_mask: padding is always on the right, so causal attention never lets a real token
    see a pad; packed rows are separated by position_ids restarting at 0.
    """
    L = layout.max_len
    seqs = [[data.ids(i, L) for i in row] for row in rows]
    used = [sum(len(s) for s in row) for row in seqs]
    if layout.mode == "pack":  # pad to the fullest row, not to a fixed width
        width = -(-max(used) // layout.pad_multiple) * layout.pad_multiple
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
            if data.loss_mask is not None:  # chats: targets where the next token is the assistant's
                keep = data.mask(i, L)[1:].astype(bool)
                tgt[r, c:c + n - 1] = np.where(keep, s[1:], IGNORE)
                n_targets += int(keep.sum())
            else:
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
