"""From a spec to tokenized examples, with a progress event for every phase (and the cache)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from tokenpulse.errors import SpecError
from tokenpulse.protocol import JobSpec, Phase

from . import data as D
from .errors import Cancelled
from .faults import Faults
from .tokenization import Tokenized, cache_key, cached_tokenize, encode_examples, tokenize_all


def load_tokenized(spec: JobSpec, tokenizer, em, cache_dir: Optional[Path] = None,
                   sample: Optional[int] = None, should_stop: Callable[[], bool] = lambda: False,
                   faults: Faults = Faults()) -> tuple[Tokenized, dict]:
    """Tokenize the dataset (or a random sample of `sample` examples); info says what happened."""
    em.phase(Phase.LOADING_DATASET, detail=spec.dataset)
    faults.at("data", em=em, should_stop=should_stop)
    path = D.dataset_path(spec, em)
    fp = D.data_fingerprint(spec, path)
    rows = None

    def open_rows():
        nonlocal rows
        if rows is None:
            rows = D.load_rows(path, cache_dir, config=spec.dataset_config, split=spec.dataset_split)
        return rows

    fields = D.resolve_fields(spec, list(open_rows().column_names))
    if fields.kind == "messages":
        from .chat import require_template
        require_template(tokenizer, spec.model)
    n_total = len(rows)
    info = {"examples": n_total, "fields": fields.__dict__, "dataset_fingerprint": fp[:16]}
    sampled = sample is not None and n_total > sample
    key = cache_key(fp + (f":sample{sample}" if sampled else ""), tokenizer, fields, spec.masks_prompt)

    def progress(done, total):
        em.phase(Phase.TOKENIZING, done=done, total=total, unit="examples")
        if should_stop():
            raise Cancelled()

    def make():
        r = open_rows()
        if sampled:
            idx = np.sort(np.random.default_rng(0).choice(n_total, sample, replace=False))
            r = r.select(idx)
        return tokenize_all(D.iter_texts(r, fields), len(r), tokenizer, fields,
                            spec.masks_prompt, progress)

    tok, hit = cached_tokenize(cache_dir, key, make)
    if hit:
        em.phase(Phase.TOKENIZING, done=tok.n, total=tok.n, unit="examples", detail="cached")
    info.update(cache_hit=hit, cache_key=key, sampled=sampled, sample_size=tok.n)
    return tok, info


def stream_chunks(spec: JobSpec, tokenizer, em, chunk_tokens: int, cache_dir: Optional[Path] = None,
                  should_stop: Callable[[], bool] = lambda: False, batch: int = 64,
                  faults: Faults = Faults()) -> Iterator[Tokenized]:
    """streaming=True: read the file as a stream, yield chunks of >= chunk_tokens tokens for packing.

    Emits an "accumulating" phase at least every second while a chunk fills.
    """
    em.phase(Phase.LOADING_DATASET, detail=f"{spec.dataset} (streaming)")
    faults.at("data", em=em, should_stop=should_stop)
    stream = D.open_stream(spec, em, cache_dir)
    fields = None
    parts, buf, n_samples, n_tokens = [], [], 0, 0
    last = 0.0

    def flush():
        nonlocal buf, n_samples, n_tokens
        if buf:
            t = encode_examples(tokenizer, list(D.iter_texts(buf, fields)), fields, spec.masks_prompt)
            parts.append(t)
            n_samples += t.n
            n_tokens += int(t.offsets[-1])
            buf = []

    for row in stream:
        if fields is None:
            fields = D.resolve_fields(spec, list(row.keys()))
            if fields.kind == "messages":
                from .chat import require_template
                require_template(tokenizer, spec.model)
        buf.append(row)
        if len(buf) >= batch:
            flush()
        now = time.monotonic()
        if now - last >= 0.5:
            em.phase(Phase.ACCUMULATING, done=n_samples, unit="samples",
                     detail=f"{n_samples:,} samples, ~{n_tokens:,} tokens")
            last = now
            if should_stop():
                raise Cancelled()
        if n_tokens >= chunk_tokens:
            em.phase(Phase.ACCUMULATING, done=n_samples, unit="samples",
                     detail=f"{n_samples:,} samples, ~{n_tokens:,} tokens (chunk ready)")
            yield Tokenized.concat(parts)
            parts, n_samples, n_tokens = [], 0, 0
    flush()
    if fields is None:
        raise SpecError("dataset", f"dataset {spec.dataset} is empty")
    if parts:
        yield Tokenized.concat(parts)
