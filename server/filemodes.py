"""The data directory and the database files are the server user's alone: the database holds env
values, token hashes and every job's output, the directory the token files. Data dir 0700, the
SQLite file and its WAL/SHM 0600 (SQLite creates those two with the main file's mode), backups
0600. A directory the operator chose elsewhere (a shared mount) is tightened too, with a warning
if it cannot be."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

from sqlalchemy.engine import make_url

log = logging.getLogger("tokenpulse.files")

DIR_MODE, FILE_MODE = 0o700, 0o600


def _chmod(path: Path, mode: int) -> None:
    try:
        if path.exists() and (path.stat().st_mode & 0o777) != mode:
            os.chmod(path, mode)
    except OSError as e:
        log.warning("cannot make %s private (mode %o): %s", path, mode, e)


def sqlite_file(db_url: str) -> Optional[Path]:
    url = make_url(db_url)
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return None
    return Path(url.database)


def create_private(path: Path) -> None:
    """An empty file made 0600 before anything writes it (no moment where it is world-readable)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE))
    except OSError as e:
        log.warning("cannot create %s: %s", path, e)
    _chmod(path, FILE_MODE)


def secure_data_dir(data_dir: Path, db_url: str) -> None:
    """At start, before the database is opened: the directory 0700, the database and its WAL/SHM 0600."""
    data_dir.mkdir(parents=True, exist_ok=True)
    _chmod(data_dir, DIR_MODE)
    db = sqlite_file(db_url)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
        create_private(db)
        for extra in ("-wal", "-shm", "-journal"):
            _chmod(db.with_name(db.name + extra), FILE_MODE)
