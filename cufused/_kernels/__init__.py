"""Kernel launchers: one module per CUDA source of :mod:`cufused._cuda`, beside it.

Each function launches one kernel (or picks one of a kernel's variants where the choice is a
launch concern) with named arguments: it owns the kernel's name and template instantiation,
the launch geometry (grid, block, shared memory), the conversion of every scalar to the
NumPy type of the kernel's parameter (``numpy.int32`` for ``int``, ``numpy.int64`` for
``index_t``, ``numpy.float32`` for ``float``, ``numpy.float64`` for ``double``) and the
order of the argument tuple. Nothing outside this package calls ``get_kernel``.

The codes that select a kernel's behaviour at compile time (``ACT_*``, ``MODE_*``,
``EPILOGUE_*``) are ``#define``\\ s of the CUDA sources only: the launchers name them in the
template instantiations (``"stats_finalize<MODE_GROUP_NORM>"``), which NVRTC expands.

The layer sits on the core (:mod:`cufused._cuda`, :mod:`cufused._arrays`,
:mod:`cufused._layout`) and is used by the ops, the pipelines and the cuDNN plans; it imports
none of them.
"""
