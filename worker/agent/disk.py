"""Words for a write that failed, and a probe for when writing works again (a full disk)."""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Optional


def disk_words(where: Path, e: OSError) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the device of {where}"
    return f"cannot write {where}: {e.strerror or e}"


MIN_FREE_BYTES = 1 << 20  # less free than this under the work dir: no new job (a spec, a journal)


def low_space(where: Path) -> Optional[str]:
    """Why `where` is too full to take a job (under MIN_FREE_BYTES free), or None."""
    try:
        st = os.statvfs(where)
    except OSError:
        return None  # not there yet: the first write says what is wrong
    free = st.f_bavail * st.f_frsize
    if free < MIN_FREE_BYTES:
        return f"no space left on the device of {where} ({free:,} bytes free)"
    return None


def probe_writable(where: Path, size: int = 1 << 16) -> bool:
    """Whether `size` bytes can be written under `where` now (written, synced to the filesystem's
    accounting by the close, then removed)."""
    probe = where / ".tokenpulse-space-probe"
    try:
        where.mkdir(parents=True, exist_ok=True)
        with probe.open("wb") as f:
            f.write(b"\0" * size)
            f.flush()
            os.fsync(f.fileno())
        return True
    except OSError:
        return False
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
