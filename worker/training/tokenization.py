"""Tokenize once, cache by content hash, report progress.

Examples are stored untruncated (flat int32 tokens + offsets + prompt lengths), so the analysis and any
max_seq_length reuse the same cache; truncation is a cheap view taken at training time.
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

CACHE_VERSION = 1
ProgressFn = Callable[[int, Optional[int]], None]


@dataclass
class Tokenized:
    tokens: np.ndarray  # int32, all examples back to back
    offsets: np.ndarray  # int64, n + 1
    prompt_lens: np.ndarray  # int32: tokens at the start of each example left out of the loss

    @property
    def n(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def ids(self, i: int, max_len: int) -> np.ndarray:
        s = self.offsets[i]
        return self.tokens[s:min(self.offsets[i + 1], s + max_len)]

    def save(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with tmp.open("wb") as f:
            np.savez(f, tokens=self.tokens, offsets=self.offsets, prompt_lens=self.prompt_lens)
        os.replace(tmp, path)  # readers see the whole file or none of it

    @classmethod
    def load(cls, path: Path) -> "Tokenized":
        z = np.load(path)
        return cls(z["tokens"], z["offsets"], z["prompt_lens"])

    @classmethod
    def concat(cls, parts: list["Tokenized"]) -> "Tokenized":
        if not parts:
            return cls(np.zeros(0, np.int32), np.zeros(1, np.int64), np.zeros(0, np.int32))
        offs, base = [np.zeros(1, np.int64)], 0
        for p in parts:
            offs.append(p.offsets[1:] + base)
            base += int(p.offsets[-1])
        return cls(np.concatenate([p.tokens for p in parts]), np.concatenate(offs),
                   np.concatenate([p.prompt_lens for p in parts]))


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of what decides token ids: the vocabulary/merges/normalizer and the special tokens."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(sorted(tokenizer.get_vocab().items())).encode())
    h.update(repr((tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
                   type(tokenizer).__name__)).encode())
    return h.hexdigest()


def cache_key(data_fp: str, tokenizer, fields: Fields, loss_on_response_only: bool) -> str:
    key = json.dumps({"v": CACHE_VERSION, "data": data_fp, "tok": tokenizer_fingerprint(tokenizer),
                      "fields": [fields.text, fields.prompt, fields.response],
                      "response_only": bool(loss_on_response_only and fields.is_pair)}, sort_keys=True)
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


def tokenize_all(pairs: Iterable[tuple[str, str]], total: Optional[int], tokenizer, fields: Fields,
                 loss_on_response_only: bool, progress: ProgressFn, chunk: int = 256) -> Tokenized:
    """Tokenize in chunks; progress(done, total) is called at least every ~0.5 s of work."""
    parts, buf, done = [], [], 0
    mask = loss_on_response_only and fields.is_pair
    last = time.monotonic()
    progress(0, total)
    for pair in pairs:
        buf.append(pair)
        if len(buf) >= chunk:
            parts.append(encode_batch(tokenizer, buf, fields.is_pair, mask))
            done += len(buf)
            buf = []
            if time.monotonic() - last >= 0.25:
                progress(done, total)
                last = time.monotonic()
    if buf:
        parts.append(encode_batch(tokenizer, buf, fields.is_pair, mask))
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
