"""Find and read the dataset: builtin demo, local files (jsonl/json/csv/parquet/txt) or a save_to_disk dir.

Everything here is cheap to call at submit time except `load_rows` (reads the whole file).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from tokenpulse.errors import SpecError
from tokenpulse.protocol import BUILTIN_DATASET, JobSpec

from .errors import root_cause

DEMO_DIR = Path(__file__).resolve().parents[2] / "tokenpulse" / "demo"
_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


@dataclass(frozen=True)
class Fields:
    """Which columns hold the example: `text`; `prompt` + `response`; `messages` (a chat, rendered
    with the tokenizer's chat template); or Alpaca's `instruction` (+ optional `input`) + `output`."""
    text: Optional[str] = None
    prompt: Optional[str] = None
    response: Optional[str] = None
    messages: Optional[str] = None
    instruction: Optional[str] = None
    input: Optional[str] = None
    output: Optional[str] = None

    @property
    def kind(self) -> str:
        if self.messages:
            return "messages"
        if self.instruction:
            return "alpaca"
        return "pair" if self.prompt is not None else "text"

    @property
    def is_pair(self) -> bool:
        """A prompt followed by a response (prompt/response or Alpaca): one prefix to mask."""
        return self.kind in ("pair", "alpaca")

    def named(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v}


class _Quiet:
    def phase(self, *a, **k):
        pass


def dataset_path(spec: JobSpec, em=None) -> Path:
    """The dataset's local file or directory; a Hub dataset is downloaded into the cache first."""
    if spec.dataset == BUILTIN_DATASET:
        return DEMO_DIR / "demo.jsonl"
    from . import hub
    snapshot = hub.fetch_dataset(spec, em or _Quiet())
    if snapshot is not None:
        return snapshot
    p = Path(spec.dataset).expanduser()
    if not p.exists():
        raise SpecError("dataset", f"dataset not found: {spec.dataset} (neither a local path nor a Hub id)")
    if p.is_dir():
        if not (p / "dataset_info.json").exists() and not (p / "dataset_dict.json").exists():
            raise SpecError("dataset", f"{spec.dataset} is a directory but not a datasets save_to_disk directory")
    elif p.suffix.lower() not in _BUILDERS:
        raise SpecError("dataset", f"unsupported dataset file type {p.suffix!r}: use .jsonl, .json, .csv, .parquet, "
                                   ".txt or a save_to_disk directory")
    elif not os.access(p, os.R_OK):
        raise SpecError("dataset", f"dataset not readable: {spec.dataset}")
    return p


def fingerprint(path: Path) -> str:
    """Content hash of the dataset (all bytes: a changed file, even with the same size, invalidates caches)."""
    h = hashlib.sha256()
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def data_fingerprint(spec: JobSpec, path: Path) -> str:
    """What decides the examples: the bytes (local), or repo + commit (Hub); plus config and split."""
    from . import hub
    repo = hub.dataset_repo(spec) if spec.dataset != BUILTIN_DATASET else None
    base = f"hub:{repo}@{hub.commit_of(path)}" if repo else fingerprint(path)
    if spec.dataset_config or spec.dataset_split:
        base += f":{spec.dataset_config}:{spec.dataset_split}"
    return hashlib.sha256(base.encode()).hexdigest()


def _hf_cache(cache_dir: Optional[Path]) -> Optional[str]:
    return str(cache_dir / "hf-datasets") if cache_dir else None


def _pick_split(ds, split: Optional[str] = None):
    from datasets import DatasetDict, IterableDatasetDict
    if isinstance(ds, (DatasetDict, IterableDatasetDict)):
        if split is not None:
            if split not in ds:
                raise SpecError("dataset_split", f"no split {split!r} in the dataset (splits: {', '.join(ds)})")
            return ds[split]
        return ds["train"] if "train" in ds else ds[next(iter(ds))]
    return ds


def load_rows(path: Path, cache_dir: Optional[Path] = None, streaming: bool = False,
              config: Optional[str] = None, split: Optional[str] = None):
    """A datasets.Dataset (or IterableDataset when streaming) of the file or directory (a save_to_disk
    directory, or a Hub dataset's downloaded snapshot with its configs and splits)."""
    import datasets
    datasets.disable_progress_bars()  # our own phase events report progress
    try:
        if path.is_dir() and not ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
            ds = datasets.load_dataset(str(path), name=config, streaming=streaming, cache_dir=_hf_cache(cache_dir))
            return _pick_split(ds, split)
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
            ds = _pick_split(ds, split)
            return ds.to_iterable_dataset() if streaming else ds
        builder = _BUILDERS[path.suffix.lower()]
        ds = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=streaming,
                                   cache_dir=_hf_cache(cache_dir))
        return ds
    except SpecError:
        raise
    except Exception as e:  # a malformed file is the user's to fix, not a crash to retry
        raise SpecError("dataset", f"cannot read dataset {path}: {root_cause(e)}") from e


def resolve_fields(spec: JobSpec, columns: list[str]) -> Fields:
    """The spec's named columns, else (as TRL does) `messages`, then `text`, then Alpaca's columns."""
    def need(name: Optional[str], which: str) -> str:
        if name not in columns:
            raise SpecError(which, f"column {name!r} not in dataset (columns: {', '.join(columns)})")
        return name

    if spec.messages_field:
        return Fields(messages=need(spec.messages_field, "messages_field"))
    if spec.prompt_field:
        return Fields(prompt=need(spec.prompt_field, "prompt_field"),
                      response=need(spec.response_field, "response_field"))
    if spec.text_field:
        return Fields(text=need(spec.text_field, "text_field"))
    if "messages" in columns:
        return Fields(messages="messages")
    if "text" in columns:
        return Fields(text="text")
    if "instruction" in columns and "output" in columns:
        return Fields(instruction="instruction", output="output",
                      input="input" if "input" in columns else None)
    raise SpecError("text_field", f"no text_field given and no 'text', 'messages' or 'instruction'+'output' columns "
                                  f"(columns: {', '.join(columns)}); set text_field, messages_field or "
                                  "prompt_field/response_field")


def open_stream(spec: JobSpec, em=None, cache_dir: Optional[Path] = None):
    """streaming=True: an IterableDataset. A Hub dataset streams straight from the Hub (nothing is
    downloaded first: the point of streaming a dataset larger than the disk); offline, from the cache."""
    from . import hub
    repo = hub.dataset_repo(spec) if spec.dataset != BUILTIN_DATASET else None
    if repo is None or hub.offline():
        return load_rows(dataset_path(spec, em), cache_dir, streaming=True, config=spec.dataset_config,
                         split=spec.dataset_split)
    import datasets
    datasets.disable_progress_bars()
    if em is not None:
        em.phase("loading dataset", detail=f"{repo} (streaming from the Hub)")
    try:
        ds = datasets.load_dataset(repo, name=spec.dataset_config, revision=spec.dataset_revision, streaming=True,
                                   token=hub.hub_token(spec), cache_dir=_hf_cache(cache_dir))
    except SpecError:
        raise
    except Exception as e:  # not found, no such config, unreadable files: the user's to fix
        raise SpecError("dataset", f"cannot stream dataset {repo} from the Hub: {root_cause(e)}") from e
    return _pick_split(ds, spec.dataset_split)


def peek_columns(path: Path, cache_dir: Optional[Path] = None, config: Optional[str] = None,
                 split: Optional[str] = None) -> list[str]:
    """Column names from the first row only: fast enough for submit-time checks on big files."""
    ds = load_rows(path, cache_dir, streaming=True, config=config, split=split)
    try:
        first = next(iter(ds))
    except StopIteration:
        raise SpecError("dataset", f"dataset {path} is empty") from None
    except Exception as e:
        raise SpecError("dataset", f"cannot read dataset {path}: {root_cause(e)}") from e
    return list(first.keys())


def alpaca_prompt(instruction: str, inp: str) -> str:
    """The Stanford Alpaca prompt (with and without an input); the response follows it."""
    if inp.strip():
        return ("Below is an instruction that describes a task, paired with an input that provides further "
                "context. Write a response that appropriately completes the request.\n\n"
                f"### Instruction:\n{instruction}\n\n### Input:\n{inp}\n\n### Response:\n")
    return ("Below is an instruction that describes a task. Write a response that appropriately completes "
            f"the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


def iter_texts(rows, fields: Fields) -> Iterator:
    """Per row: a (prompt, response) pair (for plain text the prompt is empty), or for chat data the
    row's list of messages."""
    for r in rows:
        kind = fields.kind
        if kind == "messages":
            yield r[fields.messages]
        elif kind == "alpaca":
            inp = str(r[fields.input] or "") if fields.input else ""
            yield alpaca_prompt(str(r[fields.instruction] or ""), inp), str(r[fields.output] or "")
        elif kind == "pair":
            yield str(r[fields.prompt] or ""), str(r[fields.response] or "")
        else:
            yield "", str(r[fields.text] or "")
