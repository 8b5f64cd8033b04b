"""A real small filesystem for disk-full tests: a tmpfs of a given size mounted on a directory
(needs root and permission to mount, as in CI's container and this project's dev machines). Tests
skip, saying why, where mounting is not allowed. Writes past its size fail with ENOSPC, exactly as on
a full disk: the same error from the same system calls."""
from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_fs(path: Path, size: str = "8m"):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to make a full disk ({r.stderr.strip() or r.returncode}): "
                    "needs root and mount permission")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path) -> Path:
    """Fill the filesystem holding path to the last byte; remove the returned file to free it."""
    import os
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        size = 1 << 20
        while size:
            try:
                os.write(fd, b"\0" * size)
            except OSError:
                size //= 2  # smaller and smaller writes until not one byte fits
    finally:
        os.close(fd)
    return filler
