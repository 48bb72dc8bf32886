"""Write the small intersphinx inventories that the docs link through (no network at build time).

Each lists only the names cufused's docs reference, with their pages on the projects' sites.
Run from this folder: python make_inventories.py
"""

import zlib

INVENTORIES = {
    "numpy": ("NumPy", {
        "numpy.ndarray": ("py:class", "reference/generated/numpy.ndarray.html"),
        "numpy.float32": ("py:attribute", "reference/arrays.scalars.html#numpy.float32"),
        "numpy.lib.stride_tricks.sliding_window_view": (
            "py:function", "reference/generated/numpy.lib.stride_tricks.sliding_window_view.html"),
    }),
    "cupy": ("CuPy", {
        "cupy.ndarray": ("py:class", "reference/generated/cupy.ndarray.html"),
        "cupy.RawModule": ("py:class", "reference/generated/cupy.RawModule.html"),
        "cupy.cuda.Stream": ("py:class", "reference/generated/cupy.cuda.Stream.html"),
    }),
    "torch": ("PyTorch", {
        "torch.Tensor": ("py:class", "tensors.html#torch.Tensor"),
        "torch.from_dlpack": ("py:function", "generated/torch.from_dlpack.html"),
        "torch.nn.functional.conv2d": ("py:function", "generated/torch.nn.functional.conv2d.html"),
    }),
}

for key, (project, names) in INVENTORIES.items():
    header = (f"# Sphinx inventory version 2\n# Project: {project}\n# Version: \n"
              "# The remainder of this file is compressed using zlib.\n").encode()
    body = "".join(f"{name} {role} 1 {uri} -\n" for name, (role, uri) in names.items()).encode()
    with open(f"{key}.inv", "wb") as fh:
        fh.write(header + zlib.compress(body))
