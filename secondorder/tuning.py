"""Process-wide tuning the user opts into; the library itself never changes process state.

Each switch here changes something for the whole process (the C library's allocator,
how every family factors on the CPU), so none is turned on by an optimizer: call
them once, at the start of a script, where they help.  The benchmark experiments
``host_memory`` and ``lapack_sizes`` (``python -m benchmarks.experiments.<name>``)
measure what they gain on a given machine.

* :func:`raise_allocator_thresholds`: on glibc, keep a CPU step's temporaries of a
  few MB mapped between steps instead of faulting their pages in again every step
  (up to about 64 MiB of freed memory then stays with the process).
* :func:`pad_cpu_cholesky`: factor CPU Cholesky systems of sizes that ran slowly on
  the machine they were measured on (column lengths a multiple of 1 KiB) padded
  with an identity block.

Example::

    import secondorder as so
    import secondorder.tuning

    secondorder.tuning.raise_allocator_thresholds()
    opt = so.LevenbergMarquardt(model)
"""

from ._host_memory import raise_allocator_thresholds
from ._lapack import pad_cpu_cholesky

__all__ = ["pad_cpu_cholesky", "raise_allocator_thresholds"]
