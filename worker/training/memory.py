"""Out of memory, on any device: one test for it, and a test-only way to make a process run out.

CUDA raises torch.OutOfMemoryError; host RAM raises MemoryError, or a RuntimeError from the CPU
allocator ("DefaultCPUAllocator: can't allocate memory: you tried to allocate ... bytes"). All are
"does not fit": autotune tries a smaller micro-batch, a training process exits with failure `oom`
and the server retries it with half the micro-batch.
"""
from __future__ import annotations

import os
import resource
from typing import Optional

# oneDNN (torch's CPU kernels) says "could not create a primitive" when its scratchpad cannot be
# allocated: under an address-space limit that is the allocator's no (seen in the suite on a busy run)
OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory", "defaultcpuallocator",
               "could not create a primitive")
# Test-only: cap this process's address space at what it has mapped now plus this many MiB, so a
# micro-batch that needs more really fails in the allocator (no mocks). Read where training sets up
# its batches (session.py), after the model, data and threads are in place.
HEADROOM_ENV = "TOKENPULSE_TEST_MEMORY_HEADROOM_MB"


def is_oom(e: BaseException) -> bool:
    if isinstance(e, MemoryError):
        return True
    try:
        import torch
        if isinstance(e, torch.OutOfMemoryError):
            return True
    except ImportError:
        pass
    return isinstance(e, RuntimeError) and any(m in str(e).lower() for m in OOM_MARKERS)


def mapped_bytes() -> int:
    """This process's virtual memory size (what RLIMIT_AS counts)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def apply_test_headroom() -> Optional[int]:
    """With HEADROOM_ENV set: limit the address space to mapped + headroom; returns the limit."""
    mb = os.environ.get(HEADROOM_ENV)
    if not mb:
        return None
    limit = mapped_bytes() + int(float(mb) * 2 ** 20)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return limit
