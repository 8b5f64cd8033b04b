"""Online backups of the store, taken while the server runs.

SQLite: the sqlite3 online-backup API copies a consistent snapshot page by page (writers continue;
a page changed mid-copy restarts that step), into a temp file renamed into place, then checks it.
PostgreSQL: pg_dump in its custom format (restore with pg_restore).
"""
from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

from sqlalchemy.engine import make_url

from server.filemodes import create_private


class BackupError(Exception):
    pass


def backup(db_url: str, out: Path) -> str:
    """Write a backup of the database at db_url to `out`; returns a one-line summary."""
    url = make_url(db_url)
    if url.get_backend_name() == "sqlite":
        return backup_sqlite(Path(url.database), out)
    if url.get_backend_name() == "postgresql":
        return backup_postgres(db_url, out)
    raise BackupError(f"no backup method for {url.get_backend_name()} databases")


def backup_sqlite(db: Path, out: Path) -> str:
    if not db.is_file():
        raise BackupError(f"no database at {db}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    create_private(tmp)  # 0600 before a byte is copied: a backup holds what the database holds
    src = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    dst = sqlite3.connect(tmp)
    try:
        src.backup(dst, pages=4096)  # in steps: the server's writer is never held for long
        check = dst.execute("PRAGMA integrity_check").fetchone()[0]
        if check != "ok":
            raise BackupError(f"the copy failed its integrity check: {check}")
        jobs = dst.execute("SELECT count(*) FROM jobs").fetchone()[0]
    finally:
        dst.close()
        src.close()
    os.replace(tmp, out)
    return f"backed up {db} to {out} ({out.stat().st_size:,} bytes, {jobs:,} jobs, integrity ok)"


def backup_postgres(db_url: str, out: Path) -> str:
    pg_dump = shutil.which("pg_dump")
    if pg_dump is None:
        raise BackupError("pg_dump is not installed (Debian: apt-get install postgresql-client)")
    url = make_url(db_url).set(drivername="postgresql")
    out.parent.mkdir(parents=True, exist_ok=True)
    create_private(out)  # pg_dump truncates it and keeps the mode
    r = subprocess.run([pg_dump, "--format=custom", "--file", str(out),
                        url.render_as_string(hide_password=False)], capture_output=True, text=True)
    if r.returncode != 0:
        raise BackupError(f"pg_dump failed: {r.stderr.strip()[-2000:]}")
    return f"backed up the PostgreSQL database to {out} ({out.stat().st_size:,} bytes; restore with pg_restore)"
