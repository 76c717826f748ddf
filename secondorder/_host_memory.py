"""Keep glibc from handing a step's large temporaries back to the kernel every step.

Nothing here runs unless the user calls :func:`raise_allocator_thresholds` (also
:func:`secondorder.tuning.raise_allocator_thresholds`): it changes the allocator of
the whole process, which a library must not do behind its user's back.

A CPU step of a mid-sized problem allocates and frees tensors of a few megabytes
each (a layer's activations, the gradients a Jacobian rule propagates).  glibc's
``malloc`` maps blocks above its *mmap threshold* afresh and unmaps them on free,
and returns free memory at the top of its heap above its *trim threshold*.  Both
thresholds start small (128 KiB and 256 KiB) and rise only after a mapped block
is freed: the mmap threshold to that block's size, up to 32 MiB, the trim
threshold to twice it (``man 3 mallopt``, "dynamic mmap threshold").  Until then
every page of those temporaries is faulted in again on each step
(``python -m benchmarks.experiments.host_memory`` counts the faults and times the steps).

:func:`raise_allocator_thresholds` frees one untouched block just under 32 MiB,
once per process, which raises both thresholds to that dynamic maximum, the state
any program reaches once it has freed such a block.  The cost is that up to
about 64 MiB of freed memory stays with the process.  Where the thresholds were
set explicitly (``mallopt`` or ``MALLOC_*_``/``GLIBC_TUNABLES`` in the
environment) glibc keeps them fixed and the block changes nothing; elsewhere
than glibc on Linux nothing is done.
"""

from __future__ import annotations

import platform
import threading

import torch

__all__ = ["raise_allocator_thresholds"]

#: Bytes of the block: under glibc's ``DEFAULT_MMAP_THRESHOLD_MAX`` (32 MiB on
#: 64-bit systems) with room for the chunk header and the allocator's alignment.
BLOCK_BYTES = 32 * 1024 * 1024 - 256 * 1024

_lock = threading.Lock()
_done = False


def _glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def raise_allocator_thresholds() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; ``True`` if done now.

    ``False`` where it was done before or where the C library is not glibc.
    The block is a storage from torch's CPU allocator, whatever the default device,
    so the thresholds that rise are those torch's own tensors are allocated under;
    it is never written, so no page of it is touched.
    """
    global _done
    with _lock:
        if _done:
            return False
        _done = True
        if not _glibc():
            return False
        # A bare storage: no default device, dispatch mode or tensor in between.
        block = torch.UntypedStorage(BLOCK_BYTES, device="cpu")
        del block
        return True
