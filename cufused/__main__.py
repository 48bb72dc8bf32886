"""``python -m cufused``: the command line of :mod:`cufused.bench.cli` (check, bench)."""

from .bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
