"""The ops, one module each: ``convolution``, ``normalization``, ``pooling``, ``softmax``.

Each public op checks its arguments and ends in :func:`cufused._arrays.forward` (the float64
reference on NumPy input, its GPU path of launchers and cuDNN plans on CuPy input); the
pipelines compose them. :mod:`cufused` exports the public functions; this package re-exports
nothing, so that each module stays reachable by attribute (``cufused.softmax`` is the
function).
"""
