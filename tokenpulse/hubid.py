"""Is a spec's `model` / `dataset` a Hugging Face Hub id ("org/name" or "name")? Pure string rules,
shared by the server's submit checks and the worker. A path that exists locally always wins."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt")


def hub_repo_id(value: str, kind: str = "model") -> Optional[str]:
    """The repo id if `value` names a Hub repo, else None (a local path, builtin:..., or malformed)."""
    v = value.strip()
    if ":" in v or not _REPO_ID.match(v) or ".." in v or "--" in v or v.endswith((".git", ".")):
        return None
    if kind == "dataset" and v.lower().endswith(DATA_SUFFIXES):
        return None  # a data file name, not a repo
    try:
        if Path(v).expanduser().exists():
            return None
    except OSError:
        return None
    return v
