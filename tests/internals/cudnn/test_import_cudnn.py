"""cuDNN Frontend's import: a module named cudnn that is not the frontend is refused with the
extras to install."""

from __future__ import annotations

import sys
import types

import pytest

from cufused._cudnn import _config


@pytest.fixture
def fresh_import(monkeypatch):
    monkeypatch.setattr(_config, "_cudnn_module", None)
    return monkeypatch


def test_a_namespace_package_named_cudnn_is_not_the_frontend(fresh_import, tmp_path):
    # What a directory named cudnn on sys.path (without __init__.py) imports as.
    namespace = types.ModuleType("cudnn")
    namespace.__path__ = [str(tmp_path / "cudnn")]
    fresh_import.setitem(sys.modules, "cudnn", namespace)
    with pytest.raises(ImportError, match=r"cufused\[cuda13\].*has no pygraph"):
        _config.import_cudnn()
    assert _config._cudnn_module is None


def test_a_missing_module_names_the_extras(fresh_import):
    fresh_import.setitem(sys.modules, "cudnn", None)
    with pytest.raises(ImportError, match=r"install cufused\[cuda12\] or cufused\[cuda13\]"):
        _config.import_cudnn()


def test_the_frontend_is_imported_once(fresh_import):
    frontend = types.ModuleType("cudnn")
    frontend.pygraph = object
    fresh_import.setitem(sys.modules, "cudnn", frontend)
    assert _config.import_cudnn() is frontend
    fresh_import.setitem(sys.modules, "cudnn", None)
    assert _config.import_cudnn() is frontend
