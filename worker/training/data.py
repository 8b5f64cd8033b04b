"""Find and read the dataset: builtin demo, local files (jsonl/json/csv/parquet/txt) or a save_to_disk dir.

Everything here is cheap to call at submit time except `load_rows` (reads the whole file).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from tokenpulse.protocol import BUILTIN_DATASET, JobSpec

from .errors import SpecError

DEMO_DIR = Path(__file__).resolve().parents[2] / "tokenpulse" / "demo"
_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


@dataclass(frozen=True)
class Fields:
    """Which columns hold the text: either `text`, or `prompt` + `response`."""
    text: Optional[str] = None
    prompt: Optional[str] = None
    response: Optional[str] = None

    @property
    def is_pair(self) -> bool:
        return self.prompt is not None


def dataset_path(spec: JobSpec) -> Path:
    if spec.dataset == BUILTIN_DATASET:
        return DEMO_DIR / "demo.jsonl"
    p = Path(spec.dataset).expanduser()
    if not p.exists():
        raise SpecError(f"dataset not found: {spec.dataset}", "dataset")
    if p.is_dir():
        if not (p / "dataset_info.json").exists() and not (p / "dataset_dict.json").exists():
            raise SpecError(f"{spec.dataset} is a directory but not a datasets save_to_disk directory", "dataset")
    elif p.suffix.lower() not in _BUILDERS:
        raise SpecError(f"unsupported dataset file type {p.suffix!r}: use .jsonl, .json, .csv, .parquet, "
                        ".txt or a save_to_disk directory", "dataset")
    elif not os.access(p, os.R_OK):
        raise SpecError(f"dataset not readable: {spec.dataset}", "dataset")
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


def _hf_cache(cache_dir: Optional[Path]) -> Optional[str]:
    return str(cache_dir / "hf-datasets") if cache_dir else None


def _pick_split(ds):
    from datasets import DatasetDict, IterableDatasetDict
    if isinstance(ds, (DatasetDict, IterableDatasetDict)):
        return ds["train"] if "train" in ds else ds[next(iter(ds))]
    return ds


def load_rows(path: Path, cache_dir: Optional[Path] = None, streaming: bool = False):
    """A datasets.Dataset (or IterableDataset when streaming) of the file or directory."""
    import datasets
    datasets.disable_progress_bars()  # our own phase events report progress
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
            ds = _pick_split(ds)
            return ds.to_iterable_dataset() if streaming else ds
        builder = _BUILDERS[path.suffix.lower()]
        ds = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=streaming,
                                   cache_dir=_hf_cache(cache_dir))
        return ds
    except SpecError:
        raise
    except Exception as e:  # a malformed file is the user's to fix, not a crash to retry
        raise SpecError(f"cannot read dataset {path}: {type(e).__name__}: {e}", "dataset") from e


def resolve_fields(spec: JobSpec, columns: list[str]) -> Fields:
    def need(name: Optional[str], which: str) -> str:
        if name not in columns:
            raise SpecError(f"column {name!r} not in dataset (columns: {', '.join(columns)})", which)
        return name

    if spec.prompt_field:
        return Fields(prompt=need(spec.prompt_field, "prompt_field"),
                      response=need(spec.response_field, "response_field"))
    if spec.text_field:
        return Fields(text=need(spec.text_field, "text_field"))
    if "text" in columns:
        return Fields(text="text")
    raise SpecError(f"no text_field given and no 'text' column (columns: {', '.join(columns)}); "
                    "set text_field or prompt_field/response_field", "text_field")


def peek_columns(path: Path, cache_dir: Optional[Path] = None) -> list[str]:
    """Column names from the first row only: fast enough for submit-time checks on big files."""
    ds = load_rows(path, cache_dir, streaming=True)
    try:
        first = next(iter(ds))
    except StopIteration:
        raise SpecError(f"dataset {path} is empty", "dataset")
    except Exception as e:
        raise SpecError(f"cannot read dataset {path}: {type(e).__name__}: {e}", "dataset") from e
    return list(first.keys())


def iter_texts(rows, fields: Fields) -> Iterator[tuple[str, str]]:
    """(prompt, response) pairs; for plain text the prompt is empty."""
    for r in rows:
        if fields.is_pair:
            yield str(r[fields.prompt] or ""), str(r[fields.response] or "")
        else:
            yield "", str(r[fields.text] or "")
