"""Submit-time checks of a job spec against the server's files, so a typo fails in the 4xx of the
submit, not ten minutes into a run. Cheap: reads a header or a first line, never the whole data."""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Optional

from server.settings import Settings
from tokenpulse.protocol import BUILTIN_DATASET, BUILTIN_MODEL, CommandSpec, JobSpec

DATA_SUFFIXES = {".jsonl", ".json", ".csv", ".parquet", ".txt"}


class SpecError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def confined(settings: Settings, raw: str, field: str) -> Path:
    """Resolve a user-given path; refuse it outside the configured roots (symlinks resolved first)."""
    try:
        path = Path(raw).expanduser()
        real = path.resolve()  # symlinks followed: a link inside a root pointing out of it is refused
    except (OSError, RuntimeError, ValueError) as e:  # a symlink loop, a name too long...
        raise SpecError(field, f"{raw!r} is not a usable path: {e}") from None
    if settings.path_roots:
        roots = [Path(r).resolve() for r in settings.path_roots]
        if not any(real == r or r in real.parents for r in roots):
            raise SpecError(field, f"{raw!r} is outside the allowed roots ({', '.join(map(str, roots))})")
    return real


def needs_remote_code(model_dir: Path) -> bool:
    """A model whose config or tokenizer config maps classes to its own modules (auto_map)."""
    for name in ("config.json", "tokenizer_config.json"):
        try:
            cfg = json.loads((model_dir / name).read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise SpecError("model", f"cannot read {name} of {str(model_dir)!r}: {e}") from None
        if isinstance(cfg, dict) and cfg.get("auto_map"):
            return True
    return False


def check_command(spec: CommandSpec, settings: Settings) -> CommandSpec:
    """A command's working directory is confined like dataset paths: resolved, under path_roots, an
    existing directory (on the server's machine; the agent checks again on its own)."""
    if spec.cwd is None:
        return spec
    cwd = confined(settings, spec.cwd, "cwd")
    if not cwd.is_dir():
        raise SpecError("cwd", f"working directory {spec.cwd!r} " + (
            "is not a directory" if cwd.exists() else "does not exist on the server's machine") +
            " (give the directory holding your script, as the workers see it)")
    return spec.model_copy(update={"cwd": str(cwd)})


def check_spec(spec, settings: Settings):
    if isinstance(spec, CommandSpec):
        return check_command(spec, settings)
    if spec.fault is not None and not settings.allow_fault_injection:
        raise SpecError("fault", "fault injection is disabled on this server (TOKENPULSE_ALLOW_FAULT_INJECTION)")
    if spec.model != BUILTIN_MODEL:
        model = confined(settings, spec.model, "model")
        if not model.is_dir():
            raise SpecError("model", f"model directory {spec.model!r} does not exist "
                                     f"(give a local Hugging Face model directory or {BUILTIN_MODEL})")
        if not (model / "config.json").is_file():
            raise SpecError("model", f"{spec.model!r} has no config.json: not a Hugging Face model directory")
        if needs_remote_code(model) and not settings.allow_remote_code:
            raise SpecError("model", f"{spec.model!r} ships its own Python code (auto_map in its config), which "
                                     "would need trust_remote_code; this server does not run a model's code "
                                     "unless its operator allows it (TOKENPULSE_ALLOW_REMOTE_CODE)")
        spec = spec.model_copy(update={"model": str(model)})
    if spec.lora is not None and spec.lora.load_in_4bit and spec.device == "cpu":
        raise SpecError("lora.load_in_4bit", "4-bit QLoRA needs a CUDA GPU; this job is pinned to the CPU")
    if spec.dataset == BUILTIN_DATASET:
        columns: Optional[list[str]] = ["text"]
    else:
        data = confined(settings, spec.dataset, "dataset")
        spec = spec.model_copy(update={"dataset": str(data)})
        columns = dataset_columns(data)
    wanted = [("text_field", spec.text_field), ("prompt_field", spec.prompt_field),
              ("response_field", spec.response_field)]
    if columns is not None:
        for field, name in wanted:
            if name and name not in columns:
                raise SpecError(field, f"column {name!r} is not in the dataset (it has: {', '.join(columns)})")
        if not any(name for _, name in wanted) and "text" not in columns:
            raise SpecError("text_field", f"the dataset has no 'text' column; name one with text_field "
                                          f"or prompt_field/response_field (it has: {', '.join(columns)})")
    return spec


def dataset_columns(path: Path) -> Optional[list[str]]:
    """Column names of a local dataset, or None where it has none (plain text: one 'text' column)."""
    if path.is_dir():
        for info in (path / "dataset_info.json", *path.glob("*/dataset_info.json")):
            if info.is_file():
                return list(json.loads(info.read_text()).get("features", {}))
        raise SpecError("dataset", f"{str(path)!r} is a directory but not a dataset saved with save_to_disk")
    if not path.is_file():
        raise SpecError("dataset", f"dataset file {str(path)!r} does not exist")
    if not os.access(path, os.R_OK):
        raise SpecError("dataset", f"dataset file {str(path)!r} is not readable")
    suffix = path.suffix.lower()
    if suffix not in DATA_SUFFIXES:
        raise SpecError("dataset", f"unsupported dataset type {suffix!r}; use one of {sorted(DATA_SUFFIXES)}")
    try:
        if suffix == ".txt":
            return ["text"]
        if suffix in (".jsonl", ".json"):
            with path.open() as f:
                first = next((line for line in f if line.strip()), None)
            if first is None:
                raise SpecError("dataset", f"dataset file {str(path)!r} is empty")
            row = json.loads(first)
            if not isinstance(row, dict):
                raise SpecError("dataset", "each JSON line must be an object with named fields")
            return list(row)
        if suffix == ".csv":
            with path.open(newline="") as f:
                header = next(csv.reader(f), None)
            if not header:
                raise SpecError("dataset", f"dataset file {str(path)!r} is empty")
            return header
        import pyarrow.parquet as pq
        return list(pq.read_schema(path).names)
    except SpecError:
        raise
    except Exception as exc:  # unreadable or malformed: say so at submit time
        raise SpecError("dataset", f"cannot read {str(path)!r}: {exc}") from exc
