"""The benchmark and the command line, beside the library: they use it, it never imports them.

- :mod:`~cufused.bench.cases`: the three pipelines' cases, their float64 reference and their
  PyTorch equivalents, the error metric;
- :mod:`~cufused.bench.timing`: CUDA-event timing with an L2 flush, the device's ceilings,
  the convolution plans of a case, a case's timed calls and floors;
- :mod:`~cufused.bench.report`: the bench result as a table and as a bar chart;
- :mod:`~cufused.bench.cli`: ``python -m cufused check`` and ``bench``.
"""
