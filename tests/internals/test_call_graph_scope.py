"""Scope of cufused._call_graphs.without_call_graphs (no GPU needed)."""

from __future__ import annotations

import threading

import pytest

from cufused._call_graphs import _suspended, without_call_graphs


def test_without_call_graphs_is_scoped_to_its_context():
    # It holds inside its block only, and only for the context that entered it (a Dask
    # worker thread's task, not the other threads).
    seen = []
    assert not _suspended.get()
    with without_call_graphs():
        assert _suspended.get()
        worker = threading.Thread(target=lambda: seen.append(_suspended.get()))
        worker.start()
        worker.join()
        with without_call_graphs():
            assert _suspended.get()
        assert _suspended.get()
    assert not _suspended.get() and seen == [False]
    with pytest.raises(ZeroDivisionError):
        with without_call_graphs():
            1 / 0
    assert not _suspended.get()
