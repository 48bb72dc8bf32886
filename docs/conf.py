"""Sphinx configuration for cufused (builds without a GPU and without network access)."""

import json
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import cufused  # noqa: E402
from cufused.bench.report import format_table  # noqa: E402

project = "cufused"
author = "the cufused developers"
copyright = "2026, the cufused developers"
release = version = cufused.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.intersphinx",
    "sphinx.ext.mathjax",
    "numpydoc",
]
autosummary_generate = True
autosummary_generate_overwrite = True
numpydoc_show_class_members = False
numpydoc_xref_param_type = False
autodoc_typehints = "none"  # numpydoc sections carry the types

# Local inventories (see _intersphinx/make_inventories.py): no network at build time.
intersphinx_mapping = {
    "numpy": ("https://numpy.org/doc/stable/", "_intersphinx/numpy.inv"),
    "cupy": ("https://docs.cupy.dev/en/stable/", "_intersphinx/cupy.inv"),
    "torch": ("https://docs.pytorch.org/docs/stable/", "_intersphinx/torch.inv"),
}

html_theme = "pydata_sphinx_theme"
html_static_path = ["_static"]
html_title = f"cufused {release}"
html_theme_options = {"navigation_with_keys": False}
exclude_patterns = ["_build", "_intersphinx"]

# The performance page shows the committed benchmark data as the bench command prints it:
# _static/bench.json (H200) as generated/bench_table.txt, bench_h200_*.json and
# bench_h100*.json as bench_table_h200_*.txt and bench_table_h100*.txt.
_here = os.path.dirname(__file__)
os.makedirs(os.path.join(_here, "generated"), exist_ok=True)
for _suffix in ("", "_h200_all", "_h200_canonical", "_h200_a_compile", "_h200_c",
                "_h200_ac_split", "_h200_ac_sums", "_h200_ac_issue25", "_h200_b_compile",
                "_h200_ab_compile", "_h200_c_compile", "_h200_issue26", "_h100",
                "_h100_canonical", "_h100_batch1", "_h100_batch8"):
    with open(os.path.join(_here, "_static", f"bench{_suffix}.json")) as fh:
        _bench = json.load(fh)
    with open(os.path.join(_here, "generated", f"bench_table{_suffix}.txt"), "w") as fh:
        fh.write(format_table(_bench) + "\n")
