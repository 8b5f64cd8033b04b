"""Tokenize once, cache by content hash, report progress.

Examples are stored untruncated (flat int32 tokens + offsets + prompt lengths, and for chats a per-token
loss mask), so the analysis and any max_seq_length reuse the same cache; truncation is a cheap view
taken at training time.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np

from .data import Fields

CACHE_VERSION = 2  # 2: chat data (per-token loss masks)
ProgressFn = Callable[[int, Optional[int]], None]


@dataclass
class Tokenized:
    tokens: np.ndarray  # int32, all examples back to back
    offsets: np.ndarray  # int64, n + 1
    prompt_lens: np.ndarray  # int32: tokens at the start of each example left out of the loss
    loss_mask: Optional[np.ndarray] = None  # uint8 per token (chats: 1 on assistant turns); wins over prompt_lens

    @property
    def n(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def ids(self, i: int, max_len: int) -> np.ndarray:
        s = self.offsets[i]
        return self.tokens[s:min(self.offsets[i + 1], s + max_len)]

    def mask(self, i: int, max_len: int) -> np.ndarray:
        """1 where token i's tokens are loss targets (same truncation as ids)."""
        s, e = self.offsets[i], self.offsets[i + 1]
        e = min(e, s + max_len)
        if self.loss_mask is not None:
            return self.loss_mask[s:e]
        m = np.ones(e - s, np.uint8)
        m[:int(self.prompt_lens[i])] = 0
        return m

    def save(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        extra = {"loss_mask": self.loss_mask} if self.loss_mask is not None else {}
        with tmp.open("wb") as f:
            np.savez(f, tokens=self.tokens, offsets=self.offsets, prompt_lens=self.prompt_lens, **extra)
        os.replace(tmp, path)  # readers see the whole file or none of it

    @classmethod
    def load(cls, path: Path) -> "Tokenized":
        z = np.load(path)
        return cls(z["tokens"], z["offsets"], z["prompt_lens"], z["loss_mask"] if "loss_mask" in z else None)

    @classmethod
    def concat(cls, parts: list["Tokenized"]) -> "Tokenized":
        if not parts:
            return cls(np.zeros(0, np.int32), np.zeros(1, np.int64), np.zeros(0, np.int32))
        offs, base = [np.zeros(1, np.int64)], 0
        for p in parts:
            offs.append(p.offsets[1:] + base)
            base += int(p.offsets[-1])
        mask = None
        if any(p.loss_mask is not None for p in parts):
            mask = np.concatenate([p.loss_mask if p.loss_mask is not None else
                                   np.concatenate([p.mask(i, 1 << 62) for i in range(p.n)] or [np.zeros(0, np.uint8)])
                                   for p in parts])
        return cls(np.concatenate([p.tokens for p in parts]), np.concatenate(offs),
                   np.concatenate([p.prompt_lens for p in parts]), mask)


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of what decides token ids: the vocabulary/merges/normalizer and the special tokens."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(sorted(tokenizer.get_vocab().items())).encode())
    h.update(repr((tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
                   type(tokenizer).__name__)).encode())
    return h.hexdigest()


def cache_key(data_fp: str, tokenizer, fields: Fields, loss_on_response_only: bool) -> str:
    chat = fields.kind == "messages"
    key = json.dumps({"v": CACHE_VERSION, "data": data_fp, "tok": tokenizer_fingerprint(tokenizer),
                      "fields": fields.named(), "template": getattr(tokenizer, "chat_template", None) if chat else None,
                      "response_only": bool(loss_on_response_only and (fields.is_pair or chat))}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def encode_batch(tokenizer, pairs: list[tuple[str, str]], is_pair: bool, mask_prompt: bool) -> Tokenized:
    """Model's own special tokens (e.g. BOS) first, EOS last so the model learns where text ends."""
    eos = tokenizer.eos_token_id
    prompts = [p for p, _ in pairs]
    texts = [r for _, r in pairs]
    if is_pair:
        p_ids = tokenizer(prompts, add_special_tokens=True)["input_ids"]
        r_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    else:
        p_ids = [[] for _ in pairs]
        r_ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    seqs, plens = [], []
    for p, r in zip(p_ids, r_ids):
        s = list(p) + list(r)
        if eos is not None and (not s or s[-1] != eos):
            s.append(eos)
        seqs.append(s)
        plens.append(len(p) if mask_prompt else 0)
    lens = np.fromiter((len(s) for s in seqs), np.int64, len(seqs))
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    flat = np.fromiter((t for s in seqs for t in s), np.int32, int(offsets[-1]))
    return Tokenized(flat, offsets, np.asarray(plens, np.int32))


def encode_examples(tokenizer, examples: list, fields: Fields, loss_on_response_only: bool) -> Tokenized:
    """Examples as data.iter_texts yields them: (prompt, response) pairs, or chats (message lists)."""
    if fields.kind != "messages":
        return encode_batch(tokenizer, examples, fields.is_pair, loss_on_response_only and fields.is_pair)
    from .chat import encode_chats
    seqs, masks = encode_chats(tokenizer, examples, fields.messages, loss_on_response_only)
    lens = np.fromiter((len(s) for s in seqs), np.int64, len(seqs))
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    flat = np.fromiter((t for s in seqs for t in s), np.int32, int(offsets[-1]))
    mask = np.concatenate(masks) if masks else np.zeros(0, np.uint8)
    return Tokenized(flat, offsets, np.zeros(len(seqs), np.int32), mask.astype(np.uint8))


def tokenize_all(pairs: Iterable, total: Optional[int], tokenizer, fields: Fields,
                 loss_on_response_only: bool, progress: ProgressFn, chunk: int = 256) -> Tokenized:
    """Tokenize in chunks; progress(done, total) is called at least every ~0.5 s of work."""
    parts, buf, done = [], [], 0
    last = time.monotonic()
    progress(0, total)
    for pair in pairs:
        buf.append(pair)
        if len(buf) >= chunk:
            parts.append(encode_examples(tokenizer, buf, fields, loss_on_response_only))
            done += len(buf)
            buf = []
            if time.monotonic() - last >= 0.25:
                progress(done, total)
                last = time.monotonic()
    if buf:
        parts.append(encode_examples(tokenizer, buf, fields, loss_on_response_only))
        done += len(buf)
    progress(done, total)
    return Tokenized.concat(parts)


def cached_tokenize(cache_dir: Optional[Path], key: str, make: Callable[[], Tokenized]) -> tuple[Tokenized, bool]:
    """(data, hit). Without a cache dir, always tokenizes."""
    if cache_dir is None:
        return make(), False
    path = cache_dir / "tokenized" / f"{key}.npz"
    if path.exists():
        try:
            return Tokenized.load(path), True
        except Exception:
            path.unlink(missing_ok=True)  # a corrupt cache entry is rebuilt, never trusted
    data = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    data.save(path)
    return data, False
