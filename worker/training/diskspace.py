"""Which filesystem a path lives on, in words for a disk-full message (Linux /proc/self/mounts;
elsewhere just the path)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def mount_point(path: Path) -> Path:
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def describe_fs(path) -> str:
    """e.g. "the disk of /data/job/out (/dev/sdb1 mounted at /data, 0 B free of 20.0 GiB)"."""
    path = Path(path)
    mp = mount_point(path)
    device = None
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[1].replace("\\040", " ") == str(mp):
                device = parts[0]  # the last match is the mount on top
    except OSError:
        pass
    try:
        u = shutil.disk_usage(mp)
        space = f", {human(u.free)} free of {human(u.total)}"
    except OSError:
        space = ""
    on = f"{device} mounted at {mp}" if device else f"the filesystem at {mp}"
    return f"the disk of {path} ({on}{space})"


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def looks_like_disk_full(e: BaseException, path) -> bool:
    """Whether a failed write ran out of space. Not only OSError(ENOSPC): torch.save reports a full disk
    as RuntimeError("... file write failed") and safetensors as its own error ("StorageFull", "os error
    28"); so the error's words count, and so does the filesystem having (next to) nothing left."""
    import errno
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if any(w in text for w in ("No space left", "StorageFull", "os error 28", "Disk quota exceeded")):
            return True
        e = e.__cause__ or e.__context__
    try:
        return shutil.disk_usage(mount_point(Path(path))).free < (1 << 20)
    except OSError:
        return False
