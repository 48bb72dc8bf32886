"""The launcher layer (cufused/_kernels/) without a GPU: every launch it makes, recorded.

``get_kernel`` is replaced by a recorder and the launchers are called with stand-ins that carry
what they read (shape, strides, pointer); each recorded launch must name a registered
instantiation and pass exactly the arguments of the kernel's ``__global__`` signature in the
CUDA source, each of the NumPy type its parameter needs (``int``: int32, ``index_t``: int64,
``float``: float32, ``double``: float64, a pointer: an array or a null ``uint64``), with a
grid and block the device accepts (a struct passed by value, such as a tensor map: a
pointer to its bytes). Each module's calls below reach every instantiation
registered for its source. Also: only the launchers launch, and imports point down.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import math
import pathlib
import re
import types

import numpy as np
import pytest

import cufused._cuda
from cufused._cuda import KERNELS, source
from cufused._layout import layout_strides

PACKAGE = pathlib.Path(cufused._cuda.__file__).resolve().parent.parent
LAUNCHERS = {filename: importlib.import_module(f"cufused._kernels.{filename[:-3]}")
             for filename in KERNELS}
SCALARS = {"int": np.int32, "index_t": np.int64, "float": np.float32, "double": np.float64}
STRUCTS = {"TensorMap"}  # by value: CuPy's CPointer to the struct's bytes


# ------------------------------------------------------------------- kernel signatures

def _signatures(filename: str) -> dict[str, list[tuple[str, str]]]:
    """``{kernel: [(kind, parameter name), ...]}`` of every ``__global__`` function in the
    source; kind is "pointer" or the scalar type."""
    text = re.sub(r"//[^\n]*", "", source(filename))
    found = {}
    for match in re.finditer(r"__global__\b.*?\b(\w+)\s*\(([^()]*)\)\s*\{", text, re.S):
        params = []
        for param in match.group(2).split(","):
            *type_words, name = param.replace("*", " * ").split()
            kind = "pointer" if "*" in type_words else type_words[-1]
            params.append((kind, name))
        found[match.group(1)] = params
    return found


SIGNATURES = {filename: _signatures(filename) for filename in KERNELS}


def test_signatures_cover_every_registered_kernel():
    for filename, names in KERNELS.items():
        for name in names:
            params = SIGNATURES[filename].get(name.split("<")[0])
            assert params, f"no __global__ signature of {name} in {filename}"
            assert all(kind == "pointer" or kind in SCALARS or kind in STRUCTS
                       for kind, _ in params), params


def test_transposed_conv_geometry_is_the_sources():
    # conv_transpose3d_s2k3's tile, channels and shared memory as conv_gemm.cu defines them
    # (its tensor copy waits for exactly the bytes of one halo: a box of another size would
    # never complete the wait).
    conv = LAUNCHERS["conv_gemm.cu"]
    defines = {}
    for name, expr in re.findall(r"^#define (CT3_\w+) (\(?[\w +*/()-]+\)?)\s*$",
                                 source("conv_gemm.cu"), re.M):
        defines[name] = eval(re.sub(r"\bCT3_\w+\b", lambda m: str(defines[m.group(0)]),
                                    expr).replace("/", "//"))
    assert (defines["CT3_TD"], defines["CT3_TH"], defines["CT3_TW"]) == conv._CT3_TILE
    assert (defines["CT3_CI"], defines["CT3_BN"]) == (conv._CT3_CI, conv._CT3_BN)
    assert 4 * defines["CT3_SHARED_FLOATS"] == conv._CT3_SHARED
    assert defines["CT3_HFLOATS"] == conv._CT3_CI * math.prod(conv._CT3_HALO)
    assert (defines["CT3_HH"], defines["CT3_HW"]) == conv._CT3_HALO[1:]
    # An NCDHW x's input planes: a tensor copy's box of CT3_XW columns (80-byte rows) x 5
    # rows x 32 channels, CT3_XCS = 100 floats a channel. An A fragment's lane (gid, tig)
    # reads position gid of channels 2 tig (a[0]) and 2 tig + 1 (a[2]): each of the two
    # loads' 32 lanes hit 32 different banks.
    assert conv._CT3_PLANE_BOX == (defines["CT3_XW"], defines["CT3_HH"], 1, defines["CT3_CI"], 1)
    assert defines["CT3_XW"] >= defines["CT3_HW"] and 4 * defines["CT3_XW"] % 16 == 0
    xcs = defines["CT3_XCS"]
    for odd in (0, 1):
        assert len({((2 * tig + odd) * xcs + gid) % 32
                    for tig in range(4) for gid in range(8)}) == 32
    assert defines["CT3_SLOT"] == math.prod(conv._CT3_PLANE_BOX)
    assert defines["CT3_RING"] == conv._CT3_RING
    assert 4 * defines["CT3_SHARED_FLOATS_NCDHW"] == conv._CT3_SHARED_NCDHW
    # Each ring slot starts 128-byte aligned (the tensor copies' destinations).
    assert 4 * defines["CT3_WFLOATS"] % 1024 == 0 and 4 * defines["CT3_SLOT"] % 128 == 0


def test_transposed_conv_reads_ncdhw_in_tf32_on_the_warpgroup_build(monkeypatch):
    # The ring of input planes pays where the tiles go in two halves (sm_90a, TF32) and the
    # planes go by tensor copies (W % 4 == 0, x 16-byte aligned); elsewhere (the mma.sync
    # path: 3xTF32, the portable build; copies by cp.async) x takes a channels-last copy.
    conv = LAUNCHERS["conv_gemm.cu"]
    aligned, odd_w = Dev((2, 32, 4, 6, 16), ptr=1 << 20), Dev((2, 32, 4, 6, 17), ptr=1 << 20)
    shifted = Dev((2, 32, 4, 6, 16), ptr=(1 << 20) + 4)
    for target, x, passes, reads in (("sm_90a", aligned, 1, True), ("sm_90a", aligned, 3, False),
                                     (None, aligned, 1, False), ("sm_90a", odd_w, 1, False),
                                     ("sm_90a", shifted, 1, False)):
        monkeypatch.setattr(conv, "arch_target", lambda filename, target=target: target)
        assert conv.transposed_s2k3_reads_ncdhw(x, passes) is reads


def test_channels_last_tensor_store_layout_is_the_maps():
    # conv2d_halo_nhwc's tensor stores: nhwc_box_offset (conv_gemm.cu's expression, evaluated
    # here) puts channel kl of tile pixel px in box kl / 32 (NHWC_BOX_FLOATS floats on, the
    # scratch NHWC_TENSOR_SCRATCH floats for two tiles and the alignment's slack) where the
    # map's 128-byte swizzle expects the box's dense element (32 channels, then HALO_TW
    # columns, then HALO_TH rows): the 16-byte chunk XORed with the 128-byte row's index mod
    # 8. Each half warp's float2 stores of the accumulators (lanes gid, tig: pixel
    # warp_col + gid of a tile row, channels warp_k + 8 j + 2 tig) fall on each bank at most
    # twice (the threads' 72-float pixels: once).
    conv = LAUNCHERS["conv_gemm.cu"]
    text = source("conv_gemm.cu")
    defines = {"HALO_TH": conv._HALO_TH, "HALO_TW": conv._HALO_TW, "CONV_BN": conv._TILE_K}
    for name in ("NHWC_BOX_FLOATS", "NHWC_TENSOR_SCRATCH", "HALO_NHWC_STRIDE"):
        expr = re.search(rf"^#define {name} (.+)$", text, re.M).group(1)
        defines[name] = eval(re.sub(r"\b[A-Z_]+\b", lambda m: str(defines[m.group(0)]), expr))
    body = re.search(r"int nhwc_box_offset\(int px, int kl\) \{\s*return ([^;]+);", text)
    offset = eval(f"lambda px, kl: {' '.join(body.group(1).split())}", dict(defines))
    box = defines["NHWC_BOX_FLOATS"]
    assert box == 32 * conv._HALO_TW * conv._HALO_TH == conv._NHWC_BOX[0] * 32 * 4
    assert defines["NHWC_TENSOR_SCRATCH"] == conv._NHWC_TENSOR_SCRATCH == 4 * box + 255
    assert defines["HALO_NHWC_STRIDE"] == conv._HALO_NHWC_STRIDE
    pixels = conv._HALO_TH * conv._HALO_TW
    seen = set()
    for px in range(pixels):
        for kl in range(conv._TILE_K):
            at = offset(px, kl)
            seen.add(at)
            byte = 4 * (at % box)
            row, chunk = byte // 128, (byte % 128) // 16
            dense = row * 128 + (chunk ^ (row % 8)) * 16 + byte % 16
            assert (at // box, dense // 4) == (kl // 32, px * 32 + kl % 32), (px, kl)
    assert seen == set(range(2 * box))
    for layout, most in ((offset, 2), (lambda px, kl: px * defines["HALO_NHWC_STRIDE"] + kl, 1)):
        for warp_col in range(0, conv._HALO_TW, 8):
            for warp_k in (0, 32):
                for row in range(conv._HALO_TH):
                    for j in range(4):
                        for half_warp in (range(16), range(16, 32)):
                            words = {}
                            for lane in half_warp:
                                gid, tig = lane >> 2, lane & 3
                                at = layout(row * conv._HALO_TW + warp_col + gid,
                                            warp_k + 8 * j + 2 * tig)
                                for word in (at, at + 1):
                                    words.setdefault(word % 32, set()).add(word)
                            assert max(len(w) for w in words.values()) == most


def test_held_weights_operands_are_the_convolutions():
    # conv2d_nhwc_held_weights, read from conv_gemm.cu and run in float64 here: the halo
    # copies' index split (i -> row, k half, column, channel), the descriptor's operand
    # (K-major core matrices without swizzle: pixel n, channel k at 16 bytes a start unit +
    # n // 8 stride units of 128 bytes + k // 4 leading units of HELD_HC * 16 bytes + 16 (n
    # % 8) + 4 (k % 4)) at each step's start (row r, tap), and the accumulators' pixels and
    # channels give the convolution; the shared memory is the launcher's.
    conv = LAUNCHERS["conv_gemm.cu"]
    text = source("conv_gemm.cu")
    defines = {"HALO_TH": conv._HALO_TH, "HALO_TW": conv._HALO_TW}
    for name in ("NHWC_BOX_FLOATS", "HELD_HR", "HELD_HC", "HELD_PLANE", "HELD_SHARED_FLOATS"):
        expr = re.search(rf"^#define {name} (.+)$", text, re.M).group(1)
        defines[name] = eval(re.sub(r"\b[A-Z_]+\b", lambda m: str(defines[m.group(0)]), expr))
    assert defines["HELD_PLANE"] == conv._HELD_PLANE
    assert 4 * defines["HELD_SHARED_FLOATS"] == conv._HELD_SHARED
    hc, plane = defines["HELD_HC"], defines["HELD_PLANE"]
    desc = re.search(r"held_halo_desc\(const float\* p\) \{.*?return ([^;]+);", text, re.S)
    lead, stride = re.search(r"\(unsigned long long\)(\w+) << 16\) \| \((\d+)ull << 32\)",
                             desc.group(1)).groups()
    lead, stride = defines[lead], int(stride)  # in 16-byte units
    step = re.search(r"wgmma_tf32\(acc\[r\], a\[q\]\[tap\],\s*plane \+ ([^;]+)\);",
                     text).group(1)
    start = eval(f"lambda r, tap: {step.replace('/', '//')}", dict(defines))
    split = re.search(r"const int col = ([^,]+), rest = ([^;]+);\s*"
                      r"const int c = ([^,]+), h = p0 \+ \(rest >> 1\)", text)
    col_of, rest_of, c_of = (eval(f"lambda i, rest=0: {e.replace('/', '//')}", dict(defines))
                             for e in split.groups())
    rng = np.random.default_rng(5)
    for c in (8, 3):
        x = rng.standard_normal((c, defines["HELD_HR"], hc))  # one tile's halo
        w = rng.standard_normal((64, c, 3, 3))
        raw = np.zeros(plane)
        for i in range(plane):
            col, rest = col_of(i), rest_of(i)
            ch = c_of(i, rest)
            raw[i] = x[ch, rest >> 1, col] if ch < c else 0.0
        y = np.zeros((64, conv._HALO_TH, conv._HALO_TW))
        for r in range(conv._HALO_TH):
            for tap in range(9):
                for n in range(conv._HALO_TW):
                    for k in range(8):
                        byte = 16 * (start(r, tap) + stride * (n // 8) + lead * (k // 4)
                                     + n % 8) + 4 * (k % 4)
                        if k < c:
                            y[:, r, n] += w[:, k, tap // 3, tap % 3] * raw[byte // 4]
        want = sum(np.einsum("mk,krn->mrn", w[:, :, u, v],
                             x[:, u:u + conv._HALO_TH, v:v + conv._HALO_TW])
                   for u in range(3) for v in range(3))
        np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
    # Each accumulator element (warp, lane, r, j, e) stages one pixel and channel of the tile
    # (the kernel's box index arguments).
    px, kl = re.search(r"boxes\[nhwc_box_offset\((r \* HALO_TW[^,]+),\s*([^\]]+)\)\]",
                       text).groups()
    where = eval(f"lambda warp, gid, tig, r, j, e: ({px}, {kl})", dict(defines))
    staged = {where(warp, lane >> 2, lane & 3, r, j, e)
              for warp in range(4) for lane in range(32) for r in range(conv._HALO_TH)
              for j in range(4) for e in range(4)}
    assert staged == {(px, kl) for px in range(conv._HALO_TH * conv._HALO_TW)
                      for kl in range(64)}


@pytest.mark.parametrize("halves", [True, False])
def test_transposed_conv_plane_ring_holds_each_plane_until_read(halves):
    # conv_transpose3d_s2k3's ring of input planes (NCDHW x), stepped as its loop issues the
    # copies and reads the planes: input plane p of the block's i-th tile is ring number 5 i
    # + p, in slot number % 9. After the barrier that starts tile i go tile i's plane 4 and
    # the next tile's planes 0 to 3. The warpgroup path (halves) reads planes 0 to 2, then
    # planes 2 to 4; the mma.sync path all five. No copy may land in a slot whose plane is
    # still to be read, and every plane read is the one its slot holds.
    conv = LAUNCHERS["conv_gemm.cu"]
    ring, planes = conv._CT3_RING, conv._CT3_TILE[0] + 1
    tiles = 12
    unread = {i * planes + p for i in range(tiles) for p in range(planes)}
    slots: dict[int, int] = {}

    def copy(i, first, last):
        for number in range(i * planes + first, i * planes + last + 1):
            assert slots.get(number % ring) not in unread, (i, number)
            slots[number % ring] = number

    def read(i, done, *also):  # planes read until the next barrier; `done` not read again
        for p in done + also:
            assert slots[(i * planes + p) % ring] == i * planes + p, (i, p)
        unread.difference_update(i * planes + p for p in done)

    copy(0, 0, planes - 2)  # before the weights are staged
    for i in range(tiles):
        copy(i, planes - 1, planes - 1)
        if i + 1 < tiles:
            copy(i + 1, 0, planes - 2)
        if halves:
            read(i, (0, 1), 2)
            read(i, (2, 3, 4))
        else:
            read(i, (0, 1, 2, 3, 4))
    assert not unread


def test_transposed_conv_last_round_goes_in_halves():
    # conv_transpose3d_s2k3's public convolution on the warpgroup path (block_tile): the
    # blocks take the tiles in a grid stride; where the last round holds at most half as many
    # tiles as there are blocks, its tiles go in halves (bits of `halves`) to twice as many
    # blocks. Stepped as the kernel computes it: every half of every tile is taken once, and
    # the busiest block's work is the fewest tiles that whole tiles and halves allow.
    def taken(units, blocks, b):
        leftover = units % blocks
        tail = units - leftover if 2 * leftover <= blocks else units
        for i in range(units + 1):
            u = b + i * blocks
            if u < tail or tail == units:
                if u >= units:
                    return
                yield u, 3
            elif u < tail + blocks and tail + b // 2 < units:
                yield tail + b // 2, 1 << (b & 1)
                return
            else:
                return

    for units in range(1, 40):
        for blocks in range(1, min(units, 20) + 1):
            halves = [(t, h) for b in range(blocks) for t, bits in taken(units, blocks, b)
                      for h in (0, 1) if bits >> h & 1]
            assert sorted(halves) == [(t, h) for t in range(units) for h in (0, 1)]
            busiest = max(sum(bin(bits).count("1") for _, bits in taken(units, blocks, b))
                          for b in range(blocks)) / 2
            rounds, leftover = divmod(units, blocks)
            assert busiest == (rounds + 0.5 * (0 < 2 * leftover <= blocks)
                               + (2 * leftover > blocks))
    # Canonical C: 2048 tiles a channel tile on 66 blocks; the busiest take 31.5, not 32.
    assert max(sum(bin(bits).count("1") for _, bits in taken(2048, 66, b))
               for b in range(66)) == 63


def test_transposed_conv_result_pass_takes_tiles_in_a_grid_stride(launches, monkeypatch):
    # Pass 1 cuts each sample's tiles into runs (its sums reduce per run); pass 2, which
    # stores, makes every tile a run, so that the blocks running together take neighbouring
    # tiles: canonical C (32 samples of 4 x 8 x 2 tiles, 2 channel tiles, 132 SMs).
    conv = LAUNCHERS["conv_gemm.cu"]
    monkeypatch.setattr(conv, "sm_count", lambda: 132)
    shape = (32, 32, 16, 32, 32)
    assert conv.transposed_s2k3_runs(shape, 64) == (2, 64)
    assert conv.transposed_s2k3_runs(shape, 64, stores=True) == (64, 66)
    assert conv.transposed_s2k3_runs((1, 4, 1, 1, 1), 8, stores=True) == (1, 1)
    assert conv.transposed_s2k3_runs((0, 4, 1, 1, 1), 8, stores=True)[1] == 0
    # The launches: 4 samples of 2 x 2 x 2 tiles on 8 SMs (4 blocks a channel tile): pass 1
    # a run a sample, pass 2 a run a tile (the kernel's splits argument).
    monkeypatch.setattr(conv, "sm_count", lambda: 8)
    monkeypatch.setattr(conv, "float32_tensor_map", lambda *args: None)
    x, w = Dev((4, 32, 8, 8, 32), "nhwc"), Dev((32, 64, 3, 3, 3))
    conv.conv_transpose3d_softmax_sums(FakeXp, x, w, None, out_shape=(4, 64, 16, 16, 64),
                                       clamp=(0.0, 1.0), passes=1)
    assert launches[-1].grid == (4, 2) and launches[-1].args[-5] == 1
    conv.conv_transpose3d_softmax(x, w, None, Dev((4, 64, 16, 16, 64)), Dev((256,)),
                                  clamp=(0.0, 1.0), passes=1)
    assert launches[-1].grid == (4, 2) and launches[-1].args[-5] == 8


def test_one_launcher_module_per_cuda_source():
    for filename, module in LAUNCHERS.items():
        assert module._FILE == filename


# -------------------------------------------------------------- recorder and stand-ins

@dataclasses.dataclass
class Launch:
    filename: str
    name: str
    grid: tuple
    block: tuple
    args: tuple
    shared_mem: int
    shared_bytes: int


class Dev:
    """A CuPy-array stand-in (float32 unless ``dtype`` says) of logical ``shape`` stored in
    ``layout``."""

    _next_ptr = 1 << 20

    def __init__(self, shape, layout="nchw", *, ptr=None, dtype=np.float32):
        self.layout = layout
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.shape = tuple(int(v) for v in shape)
        self.ndim = len(self.shape)
        self.size = math.prod(self.shape)
        elements = layout_strides(self.shape, layout)
        self.strides = tuple(self.itemsize * s for s in elements)
        if ptr is None:
            ptr = Dev._next_ptr
            Dev._next_ptr += 1 << 20
        self.data = types.SimpleNamespace(ptr=ptr)
        self.flags = types.SimpleNamespace(
            c_contiguous=elements == layout_strides(self.shape, "nchw"))

    def __getitem__(self, i):  # a row of a 2-D buffer (coef[0]), or a slice of the batch
        if isinstance(i, slice):
            start, stop, step = i.indices(self.shape[0])
            assert step == 1
            return Dev((stop - start, *self.shape[1:]), self.layout,
                       ptr=self.data.ptr + start * self.strides[0])
        assert self.ndim == 2 and isinstance(i, int)
        return Dev(self.shape[1:], ptr=self.data.ptr + i * self.strides[0])


class FakeXp:
    """The array module the launchers allocate their temporaries with."""

    float32 = np.float32
    float64 = np.float64
    uint8 = np.uint8
    uint32 = np.uint32

    @staticmethod
    def empty(shape, dtype=None):
        assert dtype in (np.float32, np.float64, np.uint8, np.uint32)
        return Dev(shape if isinstance(shape, tuple) else (shape,), dtype=dtype)

    zeros = empty

    @staticmethod
    def ascontiguousarray(a):
        return a


@pytest.fixture
def launches(monkeypatch):
    recorded: list[Launch] = []

    def get_kernel(filename, name, *, shared_bytes=0):
        def kernel(grid, block, args, *, shared_mem=0):
            recorded.append(Launch(filename, name, grid, block, args, shared_mem, shared_bytes))
        return kernel

    for module in LAUNCHERS.values():
        monkeypatch.setattr(module, "get_kernel", get_kernel)
    monkeypatch.setattr(cufused._cuda, "sm_count", lambda: 132)  # launch_1d's grid
    monkeypatch.setattr(LAUNCHERS["softmax.cu"], "_compute_capability", lambda: 90)
    monkeypatch.setattr(LAUNCHERS["conv_gemm.cu"], "shared_per_block", lambda: 227 * 1024)
    # A multiprocessor of 228 KB, 1 KB reserved a block (compute capability 9.0).
    monkeypatch.setattr(LAUNCHERS["conv_gemm.cu"], "resident_blocks",
                        lambda shared: 228 * 1024 // (shared + 1024))
    return recorded


def argument(launch: Launch, name: str):
    """The value ``launch`` passes for the kernel parameter called ``name``."""
    params = SIGNATURES[launch.filename][launch.name.split("<")[0]]
    assert len(launch.args) == len(params), (launch.name, len(launch.args), len(params))
    return launch.args[[pname for _, pname in params].index(name)]


def check_launch(launch: Launch) -> None:
    assert launch.name in KERNELS[launch.filename], launch.name
    params = SIGNATURES[launch.filename][launch.name.split("<")[0]]
    assert len(launch.args) == len(params), (launch.name, len(launch.args), len(params))
    for arg, (kind, pname) in zip(launch.args, params):
        if kind == "pointer":
            assert isinstance(arg, Dev) or (type(arg) is np.uint64 and arg == 0), \
                (launch.name, pname, arg)
        elif kind in STRUCTS:
            from cupy.cuda.function import CPointer

            assert isinstance(arg, CPointer), (launch.name, pname, arg)
        else:
            assert type(arg) is SCALARS[kind], (launch.name, pname, type(arg).__name__, kind)
    assert 1 <= len(launch.grid) <= 3 and 1 <= len(launch.block) <= 3, launch
    assert all(isinstance(v, (int, np.integer)) and v >= 1 for v in launch.grid + launch.block)
    assert launch.grid[0] < 2**31 and all(v <= 65535 for v in launch.grid[1:]), launch.grid
    assert math.prod(launch.block) <= 1024, launch.block
    # Dynamic shared memory must be declared with the kernel: get_kernel grants it where it
    # and the kernel's static shared memory pass the default 48 KB.
    assert launch.shared_mem <= launch.shared_bytes, launch


def check_all(launches: list[Launch], filename: str) -> None:
    assert launches
    for launch in launches:
        assert launch.filename == filename
        check_launch(launch)
    # The calls of each test reach every instantiation that CI compiles for the source.
    assert {launch.name for launch in launches} == set(KERNELS[filename])


# ---------------------------------------------------------------------- the launchers

def test_layout_launchers(launches):
    layout = LAUNCHERS["layout.cu"]
    # Back to NC(D)HW, B = C: 1, 2 and 4 tiles per block (plain, 16 channels: 8 a thread).
    for c in (16, 48, 100):
        src, dst = Dev((2, c, 3, 5), "nhwc"), Dev((2, c, 3, 5))
        layout.transpose_channels(src, dst, to_channels_last=False)
        layout.transpose_channels(src, dst, to_channels_last=False, bias=Dev((c,)))
        layout.transpose_channels(src, dst, to_channels_last=False,
                                  affine=(Dev((3, 2 * c)), -1.0, 1.0))
    with pytest.raises(ValueError, match="coefficients have shape"):  # (3, N * C) needed
        layout.transpose_channels(src, dst, to_channels_last=False, affine=(Dev((3, c)), 0, 1))
    layout.transpose_channels(Dev((2, 8, 4, 4)), Dev((2, 8, 4, 4), "nhwc"), to_channels_last=True)
    layout.transpose_channels(Dev((2, 5, 4, 4)), Dev((2, 5, 4, 4), "nhwc"), to_channels_last=True)
    layout.add_channel_bias(Dev((2, 3, 4, 4)), Dev((3,)))
    layout.add_channel_bias(Dev((2, 3, 3, 3)), Dev((3,)))
    for sw in (1, 2):
        for mw in (3, 4):
            classes = Dev((4 * sw, 2, 3, 4, 4, mw))
            layout.interleave_classes(classes, Dev((2, 3, 8, 8, sw * mw)), Dev((3,)))
            layout.interleave_classes(classes, Dev((2, 3, 8, 8, sw * mw)))
    check_all(launches, "layout.cu")
    affine = [launch for launch in launches if "AFFINE" in launch.name]
    assert [launch.args[4:6] for launch in affine] == [(-1.0, 1.0)] * 3  # lo, hi


def test_split_mean_is_a_float32_head_and_its_remainder():
    # head + remainder is the float64 mean to float32's precision on the remainder; a head
    # past float32's range or not finite has no remainder (NormMoments' rule), and -0 stays.
    from cufused._ops.normalization import split_mean

    mean = np.array([7e4 + 1 / 3, -1234.5 + 1e-6, 0.1, -0.0, 1e300, -np.inf, np.nan])
    with np.errstate(over="ignore", invalid="ignore"):  # the casts of 1e300, inf, NaN
        head, remainder = split_mean(np, mean)
    assert head.dtype == remainder.dtype == np.float32
    assert np.array_equal(head[:4], mean[:4].astype(np.float32))
    finite = slice(0, 4)
    err = np.abs(head[finite] + remainder[finite].astype(np.float64) - mean[finite])
    assert (err <= np.abs(mean[finite]) * 2.0 ** -46).all()
    assert remainder[0] != 0 and np.signbit(head[3]) and remainder[3] == 0
    assert np.isposinf(head[4]) and np.isneginf(head[5]) and np.isnan(head[6])
    assert not remainder[4:].any()


def test_normalization_launchers(launches):
    norm = LAUNCHERS["normalization.cu"]
    partial, shift, splits = norm.key_stats_partial(FakeXp, Dev((2, 8, 4, 4)), 8, n_outer=2,
                                                    outer_stride=128, key_stride=16, inner=16)
    assert partial.shape == (8, splits, 2) and shift.shape == (8,)
    assert partial.dtype == np.float64 and shift.dtype == np.float32  # see key_stats_partial
    assert launches[-1].grid == (8 * splits,)
    for centered_sums in (False, True):
        norm.group_norm_coefficients(Dev((4, 3, 2), dtype=np.float64), Dev((4,)), Dev((3, 8)),
                                     rows=4,
                                     row_len=3, count=48, channels=4, num_groups=2, eps=1e-5,
                                     centered_sums=centered_sums, gamma=Dev((4,)),
                                     scale=Dev((4,)), moments=Dev((4, 2)))
        assert argument(launches[-1], "centered_sums") == centered_sums
    # Pipeline A's statistics from partials of their own shifts, and the affine: 16-byte
    # vectors where a row's values allow them (4 channels x 9), else scalars (3 x 9).
    for shape, vec, centered_sums in (((2, 8, 3, 3), 4, False), ((2, 6, 3, 3), 1, True)):
        norm.group_affine_rows(Dev(shape), Dev(shape), Dev((2, shape[1], 5, 4)), num_groups=2,
                               count=100, eps=1e-5, centered_sums=centered_sums,
                               gamma=Dev((shape[1],)), beta=None, scale=None, lo=0.0, hi=1.0,
                               moments=Dev((4, 2)))
        assert launches[-1].name == f"group_affine_rows<ACT_CLAMP, {vec}>"
        assert launches[-1].grid == (4,)
        assert argument(launches[-1], "centered_sums") == centered_sums
    for training in (True, False):
        # In inference, a float64 mean's float32 remainder (cufused.dask's statistics).
        mean_lo = None if training else Dev((4,))
        norm.batch_norm_coefficients(
            Dev((2, 4, 3, 2), dtype=np.float64) if training else None,
            Dev((4,)) if training else None,
            Dev((3, 4)), n_outer=2 if training else 0, outer_stride=12 if training else 0,
            row_len=3 if training else 1, count=50, channels=4, eps=1e-5, training=training,
            gamma=Dev((4,)), beta=None, running_mean=Dev((4,)), running_var=Dev((4,)),
            mean_offset=None, momentum=0.1, moments=Dev((4, 2)), running_mean_lo=mean_lo)
        assert argument(launches[-1], "centered_sums") == 1
        lo_arg = argument(launches[-1], "running_mean_lo")
        assert lo_arg is mean_lo if mean_lo is not None else lo_arg == 0
    for activation in (None, "tanh", "clamp"):
        for shape in ((2, 4, 4, 4), (2, 3, 3, 3)):  # 16-byte vectors, scalars
            norm.channel_affine(Dev(shape), Dev(shape), Dev((3, 8)), inner=16,
                                activation=activation, lo=0.0, hi=1.0)
    for with_pre in (False, True):
        for shape, layout in [((2, 8, 4, 4), "nchw"), ((2, 8, 3, 1), "nchw"),  # cached rows
                              ((2, 8, 8, 8), "nchw"), ((2, 6, 33, 1), "nchw"),  # by channel
                              ((2, 8, 4, 4), "nhwc"), ((2, 8, 3, 1), "nhwc")]:  # channels-last
            groups = 2
            norm.group_norm_rows(Dev(shape, layout), Dev(shape), Dev((shape[1],)), None,
                                 num_groups=groups, eps=1e-5,
                                 pre=Dev((3, shape[1])) if with_pre else None)
        norm.group_norm_rows(Dev((2, 8, 4, 4)), Dev((2, 8, 4, 4)), None, None, num_groups=2,
                             eps=1e-5, pre=Dev((3, 8)) if with_pre else None, x_block=4)
    with pytest.raises(ValueError, match=r"needs \(3, 8\)"):  # one coefficient per channel
        norm.group_norm_rows(Dev((2, 8, 4, 4)), Dev((2, 8, 4, 4)), None, None, num_groups=2,
                             eps=1e-5, pre=Dev((3, 16)))
    for shape in ((2, 64, 16, 16), (1, 63, 257, 1)):  # rows past the cache, read twice
        norm.group_norm_rows(Dev(shape), Dev(shape), None, None, num_groups=1, eps=1e-5,
                             pre=Dev((3, shape[1])))
    # More (n, group) rows than a grid holds: launches over slices of the batch.
    n, first = 2**28 + 5, len(launches)
    x, y = Dev((n, 8, 1, 1)), Dev((n, 8, 1, 1))
    norm.group_norm_rows(x, y, None, None, num_groups=8, eps=1e-5)
    parts = launches[first:]
    assert len(parts) == 2 and sum(launch.grid[0] for launch in parts) == n * 8
    step = (2**31 - 1) // 8 * x.strides[0]
    assert [launch.args[0].data.ptr for launch in parts] == [x.data.ptr, x.data.ptr + step]
    assert [launch.args[1].data.ptr for launch in parts] == [y.data.ptr, y.data.ptr + step]
    check_all(launches, "normalization.cu")
    finalize = [launch for launch in launches if launch.name.startswith("stats_finalize")]
    training = [int(argument(launch, "training")) for launch in finalize]
    assert training == [1, 1, 1, 0]
    assert [launch.grid for launch in finalize] == [(4,)] * 4


@pytest.mark.parametrize("shape,centered_only", [
    ((3, 8), 1), ((3, 8, 1), 1), ((3, 8, 1, 1), 1), ((3, 8, 1, 1, 1), 1),  # one value each
    ((2, 24578), 1),  # rows past the row cache: statistics, then the affine pass
    ((3, 8, 2), 0), ((3, 8, 1, 2), 0), ((2, 4, 80, 80), 0)])
def test_group_norm_of_one_value_per_channel_keeps_the_centered_form(launches, shape,
                                                                      centered_only):
    # PyTorch CUDA's GroupNorm of one value per channel computes (x - mean) * rstd * w + b
    # whatever the coefficients; other shapes a * x + b where they are not finite.
    from cufused._ops.normalization import _group_norm_gpu

    c = shape[1]
    _group_norm_gpu(FakeXp, Dev(shape), 2, Dev((c,)), Dev((c,)), 1e-5, Dev(shape))
    coefficients = [launch for launch in launches
                    if launch.name.split("<")[0] in ("group_norm_rows", "stats_finalize")]
    assert len(coefficients) == 1
    assert argument(coefficients[0], "centered_only") == centered_only


@pytest.mark.parametrize("centered_only", [False, True])
def test_batch_norm_hands_its_form_to_the_coefficients(launches, centered_only):
    import cufused._ops.normalization as ops

    stats = (Dev((4,)), Dev((4,)), True, 0.1, 1e-5)
    ops._batch_norm_gpu(FakeXp, Dev((3, 4, 5)), Dev((4,)), None, stats, None, centered_only,
                        Dev((3, 4, 5)))
    finalize = [launch for launch in launches if launch.name.startswith("stats_finalize")]
    assert len(finalize) == 1 and argument(finalize[0], "centered_only") == centered_only


def run_pipeline_a_fused(monkeypatch, *, size: int, k: int, with_bias: bool,
                         epilogue: bool) -> None:
    """Pipeline A's fused path on a (2, 3, size, size) input, 8 channels of a 3 x 3
    convolution with padding 1 and pool ``k``, its convolution output a fake array."""
    from cufused._ops._conv_args import cached_conv_args
    from cufused.pipelines import pipeline_a

    n, cin, c = 2, 3, 8
    args = cached_conv_args((n, cin, size, size), (c, cin, 3, 3), 2, transposed=False,
                            stride=1, padding=1, dilation=1, groups=1)
    monkeypatch.setattr(pipeline_a, "conv_on_gpu",
                        lambda x, weight, args, precision, convert_output, definition_nans,
                        definition_inputs: (Dev(args.out_shape), None))
    monkeypatch.setattr(LAUNCHERS["conv_gemm.cu"], "sm_count", lambda: 132)
    pipeline_a._fused(FakeXp, Dev((n, cin, size, size)), Dev((c, cin, 3, 3)), args, "tf32",
                      Dev((n, c, size // k, size // k)), k=k, num_groups=2,
                      conv_bias=Dev((c,)) if with_bias else None, gn_weight=Dev((c,)),
                      gn_bias=Dev((c,)), scale=Dev((c,)), eps=1e-5, lo=0.0, hi=1.0,
                      epilogue=epilogue)


@pytest.mark.parametrize("epilogue", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_pipeline_a_centers_where_its_sums_are_of_the_normalized_values(
        launches, monkeypatch, epilogue, with_bias):
    # Both of pipeline A's fused routes sum y + (bias - shift) and normalize fl(y + bias):
    # the float64 mean only without a convolution bias, or a constant row whose bias rounds y
    # away normalizes to beta - a * mean_lo instead of exactly beta.
    run_pipeline_a_fused(monkeypatch, size=10, k=2, with_bias=with_bias, epilogue=epilogue)
    for launch in launches:
        check_launch(launch)
    (stats,) = [launch for launch in launches
                if launch.name.startswith(("stats_finalize", "group_affine_rows"))]
    assert stats.name.startswith("group_affine_rows" if epilogue else "stats_finalize")
    assert argument(stats, "centered_sums") == (not with_bias)


@pytest.mark.parametrize("size,k,one_value", [(1, 1, 1), (2, 2, 0), (4, 1, 0)])
def test_pipeline_a_recomputes_one_value_per_channel_in_the_centered_form(
        launches, monkeypatch, size, k, one_value):
    # A 1 x 1 convolution output's GroupNorm is PyTorch CUDA's form for one value per channel
    # where the exact path recomputes channels with non-finite coefficients (the epilogue
    # route, for pools of 2 and 4, never has one).
    run_pipeline_a_fused(monkeypatch, size=size, k=k, with_bias=False, epilogue=False)
    (exact,) = [launch for launch in launches
                if launch.name.startswith("pool_affine_nonfinite")]
    check_launch(exact)
    assert exact.name == "pool_affine_nonfinite" and argument(exact, "centered") == one_value


def test_pipeline_b_statistics_center_on_the_float64_mean(launches, monkeypatch):
    # The single call's fused pass sums y (mean_offset carries the bias) and normalizes y;
    # cufused.dask's phase 1 sums y + (bias - shift) with a bias, so its phase 3 centers on
    # the float64 mean only without one.
    from cufused._ops._conv_args import cached_conv_args
    from cufused.dask._pipelines import _phases
    from cufused.pipelines import pipeline_b

    n, cin, c, h, w = 2, 3, 8, 8, 8
    args = cached_conv_args((n, cin, h, w), (cin, c, 3, 3), 2, transposed=True, stride=1,
                            padding=1, output_padding=0, groups=1)
    monkeypatch.setattr(pipeline_b, "conv_on_gpu",
                        lambda x, weight, args, precision, convert_output,
                        batch_statistics, definition_nans, definition_inputs: (
                            Dev(args.out_shape), None))
    oh, ow = args.out_shape[2:]
    pipeline_b._fused(FakeXp, Dev((n, cin, h, w)), Dev((cin, c, 3, 3)), args, "ieee",
                      Dev((n, c, oh // 2, ow // 2)), k=2, num_groups=2, conv_bias=Dev((c,)),
                      bn_weight=Dev((c,)), bn_bias=Dev((c,)), gn_weight=Dev((c,)),
                      gn_bias=Dev((c,)), running_mean=Dev((c,)), running_var=Dev((c,)),
                      momentum=0.1, eps=1e-5)
    (finalize,) = [launch for launch in launches if launch.name.startswith("stats_finalize")]
    check_launch(finalize)
    assert argument(finalize, "training") == 1 and argument(finalize, "centered_sums") == 1
    for conv_bias in (None, np.zeros(4, np.float32)):
        # Any array module but NumPy takes the single call's kernels.
        phase3 = _phases(FakeXp, np.ones((3, 4, 3, 3), np.float32), conv_bias, None,
                         conv_shape=(1, 4, 8, 8), pool=2, num_groups=2, eps=1e-5,
                         dtype=np.float32, precision="ieee", stride=1, padding=0,
                         output_padding=0, groups=1)[2]
        assert phase3.keywords["centered_sums"] is (conv_bias is None)


@pytest.mark.parametrize("size,one_value", [(2, True), (8, False)])
def test_pipeline_b_groupnorm_of_one_pooled_value_keeps_the_centered_form(
        launches, monkeypatch, size, one_value):
    # A 1 x 1 pooled plane takes PyTorch CUDA's GroupNorm form for one value per channel, on
    # NCHW extrema even where a channels-last convolution output would store them in blocks.
    from cufused._ops._conv_args import cached_conv_args
    from cufused.pipelines import pipeline_b

    n, cin, c = 2, 3, 8
    args = cached_conv_args((n, cin, size, size), (cin, c, 3, 3), 2, transposed=True,
                            stride=1, padding=1, output_padding=0, groups=1)
    monkeypatch.setattr(pipeline_b, "conv_on_gpu",
                        lambda x, weight, args, precision, convert_output,
                        batch_statistics, definition_nans, definition_inputs: (
                            Dev(args.out_shape, "nhwc"), None))
    oh, ow = args.out_shape[2:]
    pipeline_b._fused(FakeXp, Dev((n, cin, size, size)), Dev((cin, c, 3, 3)), args, "ieee",
                      Dev((n, c, oh // 2, ow // 2)), k=2, num_groups=2, conv_bias=None,
                      bn_weight=Dev((c,)), bn_bias=Dev((c,)), gn_weight=Dev((c,)),
                      gn_bias=Dev((c,)), running_mean=None, running_var=None, momentum=0.1,
                      eps=1e-5)
    (gn,) = [launch for launch in launches if launch.name.startswith("group_norm_rows")]
    check_launch(gn)
    assert gn.name.startswith("group_norm_rows<") == one_value  # NCHW rows, not blocks
    if one_value:
        assert argument(gn, "centered_only") == 1


def test_pipeline_b_dask_phase_3_keeps_the_centered_form_for_one_value(launches, monkeypatch):
    # cufused.dask's phase 3 of pipeline B: the GroupNorm of 1 x 1 pooled extrema takes the
    # single call's (and PyTorch CUDA's) centered form.
    from cufused.pipelines import pipeline_b

    fake_xp = types.SimpleNamespace(empty_like=lambda a: Dev(a.shape))
    monkeypatch.setattr(pipeline_b, "get_array_module", lambda **arrays: fake_xp)
    monkeypatch.setattr(pipeline_b, "coefficients_of_statistics", lambda *a, **kw: Dev((3, 8)))
    monkeypatch.setattr(pipeline_b, "per_channel", lambda value, c, xp: value)
    for size, one_value in ((1, 1), (2, 0)):
        pipeline_b._chunk_normalized(Dev((2, 8, size, size)), None, None, None, None,
                                     Dev((8,)), Dev((8,)), num_groups=2, eps=1e-5,
                                     centered_sums=True)
        check_launch(launches[-1])
        assert argument(launches[-1], "centered_only") == one_value


def test_pooling_launchers(launches):
    pool = LAUNCHERS["pooling.cu"]
    for is_max in (True, False):
        for nd in (2, 3):
            x = Dev((2, 3) + (8,) * nd)
            for y_layout in ("nchw", "nhwc"):  # the unrolled 2-window kernels
                pool.pool_into(x, Dev((2, 3) + (4,) * nd, y_layout), (2,) * nd, (2,) * nd,
                               (0,) * nd, is_max=is_max)
            pool.pool_into(Dev((2, 3) + (9,) * nd), Dev((2, 3) + (5,) * nd), (3,) * nd,
                           (2,) * nd, (1,) * nd, is_max=is_max)
    cases = [  # (conv output shape, its layout, pool, kernel variant, ext: layout or block)
        ((2, 4, 9, 9), "nchw", 3, "scalar", "nchw"), ((2, 4, 9, 9), "nchw", 2, "scalar", "nchw"),
        ((2, 4, 8, 8), "nchw", 2, "scalar", "nchw"), ((2, 4, 9, 9), "nchw", 4, "scalar", "nchw"),
        ((2, 4, 8, 8), "nchw", 4, "scalar", "nchw"), ((2, 4, 9, 9), "nhwc", 3, "scalar", "nchw"),
        ((2, 4, 8, 8), "nhwc", 2, "scalar", "nchw"), ((2, 4, 8, 8), "nhwc", 4, "scalar", "nchw"),
        ((2, 4, 8, 8), "nchw", 2, "bands", "nchw"), ((2, 4, 8, 8), "nchw", 4, "bands", "nchw"),
        ((2, 8, 8, 8), "nhwc", 2, "vec4", "nchw"), ((2, 8, 8, 8), "nhwc", 2, "vec4", "nhwc"),
        ((2, 8, 8, 8), "nhwc", 4, "vec4", "nchw"), ((2, 64, 8, 8), "nhwc", 2, "rows", "nchw"),
        ((2, 128, 8, 8), "nhwc", 2, "rows", "nchw"), ((2, 32, 8, 8), "nhwc", 4, "rows", "nchw"),
        ((2, 64, 8, 8), "nhwc", 4, "rows", "nchw"), ((2, 32, 8, 8), "nhwc", 4, "rows", "nhwc"),
        ((2, 64, 8, 8), "nhwc", 4, "rows", 16), ((2, 8, 8, 8), "nhwc", 2, "vec4", 4),
    ]
    for shape, layout, k, variant, ext_as in cases:
        y = Dev(shape, layout)
        ext_shape = shape[:2] + (shape[2] // k, shape[3] // k)
        ext = Dev(ext_shape, ext_as if isinstance(ext_as, str) else "nchw")
        per_sample = variant != "bands"
        partial, shift, splits = pool.pool_extremum_stats(
            FakeXp, y, ext, k, bias=Dev((shape[1],)), sign_a=None, sign_b=None, shift_group=2,
            per_sample=per_sample, variant=pool.fused_pass_variant(y, k, variant),
            ext_block={"nchw": 0, "nhwc": shape[1]}.get(ext_as, ext_as))
        assert partial.shape == (shape[0], shape[1], splits, 2) and partial.dtype == np.float64
        assert shift.shape == ((shape[0] if per_sample else 1) * shape[1] // 2,)
        assert launches[-1].args[-1] == (0 if ext_as == "nchw" else
                                         shape[1] if ext_as == "nhwc" else ext_as)  # ext_block
    y, out = Dev((2, 8, 9, 9)), Dev((2, 8, 4, 4))
    pool.pool_affine_nonfinite(y, out, Dev((4, 2)), bias=None, gamma=Dev((8,)), beta=None,
                               scale=Dev((8,)), num_groups=2, pool=2, lo=0.0, hi=1.0)
    assert launches[-1].args[7:13] == (2, 8, 2, 2, 4, 4)  # N, C, G, k, Ho, Wo
    pool.pool_affine_nonfinite_conv(Dev((2, 3, 11, 11)), Dev((8, 3, 3, 3)), out, Dev((4, 2)),
                                    bias=Dev((8,)), gamma=Dev((8,)), beta=None, scale=None,
                                    num_groups=2, pool=2, stride=(1, 1), padding=(0, 0),
                                    dilation=(1, 1), lo=0.0, hi=1.0)
    assert launches[-1].args[8:19] == (2, 8, 2, 2, 4, 4, 3, 11, 11, 3, 3)
    pool.pool_bn_tanh_nonfinite(y, out, Dev((8, 2)), Dev((3, 8)), bias=Dev((8,)), gamma=None,
                                beta=None, pool=2, ext_block=4)
    assert launches[-1].args[7:12] == (2, 8, 2, 4, 4)  # N, C, k, Ho, Wo
    check_all(launches, "pooling.cu")


def test_fused_pass_rejects_a_channels_last_ext_it_cannot_store(launches):
    pool = LAUNCHERS["pooling.cu"]
    y = Dev((2, 8, 8, 8), "nhwc")
    with pytest.raises(ValueError, match="channels-last ext"):
        pool.pool_extremum_stats(FakeXp, y, Dev((2, 8, 4, 4), "nhwc"), 2, bias=None,
                                 sign_a=None, sign_b=None, shift_group=1, per_sample=False,
                                 variant="scalar", ext_block=8)
    assert not launches


def test_conv_gemm_launchers(launches, monkeypatch):
    conv = LAUNCHERS["conv_gemm.cu"]
    monkeypatch.setattr(conv, "sm_count", lambda: 132)
    monkeypatch.setattr(conv, "arch_target", lambda filename: None)  # the portable build
    monkeypatch.setattr(conv, "float32_tensor_map", lambda *args: cufused._cuda.TensorMap())
    direct_shared, held_map = conv.nhwc_direct_shared, conv.held_weights_map
    cases = [  # x, w, y, stride, dilation, kernel, its template arguments after passes
        ((2, 8, 20, 18), (64, 8, 3, 3), (2, 64, 18, 16), (1, 1), (1, 1), "conv2d_halo",
         ", 3, 1"),
        ((2, 8, 20, 18), (64, 8, 3, 3), (2, 64, 9, 16), (2, 1), (1, 1), "conv2d_halo", ", 0, 1"),
        ((1, 3, 70, 70), (5, 3, 3, 3), (1, 5, 10, 10), (1, 1), (30, 30), "conv2d_igemm", ""),
        ((1, 2, 12, 12), (5, 2, 9, 9), (1, 5, 4, 4), (1, 1), (1, 1), "conv2d_igemm", ""),
    ]
    for x, w, y, stride, dilation, kernel, rest in cases:
        for passes in (1, 3):
            for bias in (None, Dev((w[0],))):
                conv.conv2d_implicit_gemm(Dev(x), Dev(w), bias, Dev(y), stride=stride,
                                          padding=(0, 0), dilation=dilation, passes=passes)
                assert launches[-1].name == f"{kernel}<{passes}{rest}>"
                if kernel != "conv2d_halo":
                    continue
                # A channels-last y: the same geometry, its tiles stored by the threads (the
                # portable build) or on sm_90a by tensor stores; there 3xTF32 with the
                # geometry compiled in runs with the weights held in registers (then the
                # channels of non-finite weights by the definition), else from the
                # accumulators (and by tensor stores where neither applies).
                monkeypatch.setattr(conv, "arch_target", lambda filename: "sm_90a")
                conv.conv2d_implicit_gemm(Dev(x), Dev(w), bias, Dev(y, "nhwc"), stride=stride,
                                          padding=(0, 0), dilation=dilation, passes=passes)
                if passes == 3 and rest == ", 3, 1":
                    held, rows = launches[-2:]
                    assert (held.name, rows.name) == ("conv2d_nhwc_held_weights",
                                                      "conv_nonfinite_weight_rows<ForwardConvDefinition>")
                    assert held.grid == (10, 1) and held.block == (128,)  # 2 x 5 tiles
                    assert held.shared_mem == 4 * (2 * 4096 + 6 * 6 * 2 * 34 * 4 + 255)
                    if bias is not None:
                        assert argument(held, "bias") is bias and argument(rows, "bias") is bias
                    monkeypatch.setattr(conv, "held_weights_map", lambda *args: None)
                    conv.conv2d_implicit_gemm(Dev(x), Dev(w), bias, Dev(y, "nhwc"),
                                              stride=stride, padding=(0, 0),
                                              dilation=dilation, passes=passes)
                    monkeypatch.setattr(conv, "held_weights_map", held_map)
                assert launches[-1].name == (
                    "conv2d_halo_nhwc_direct<3, 3>" if passes == 3 and rest == ", 3, 1"
                    else f"conv2d_halo_nhwc<{passes}{rest[:-3]}, NHWC_TENSOR>")
                monkeypatch.setattr(conv, "held_weights_map", lambda *args: None)
                monkeypatch.setattr(conv, "nhwc_direct_shared", lambda *args: 0)
                conv.conv2d_implicit_gemm(Dev(x), Dev(w), bias, Dev(y, "nhwc"), stride=stride,
                                          padding=(0, 0), dilation=dilation, passes=passes)
                assert launches[-1].name == f"conv2d_halo_nhwc<{passes}{rest[:-3]}, NHWC_TENSOR>"
                monkeypatch.setattr(conv, "nhwc_direct_shared", direct_shared)
                monkeypatch.setattr(conv, "held_weights_map", held_map)
                monkeypatch.setattr(conv, "arch_target", lambda filename: None)
                conv.conv2d_implicit_gemm(Dev(x), Dev(w), bias, Dev(y, "nhwc"), stride=stride,
                                          padding=(0, 0), dilation=dilation, passes=passes)
                assert launches[-1].name == f"conv2d_halo_nhwc<{passes}{rest[:-3]}, NHWC_THREADS>"
    # Tiles in pairs past one wave of blocks (here 10 tiles, one multiprocessor: 2 blocks);
    # one at a time where a block's shared memory holds one staged tile but not two.
    monkeypatch.setattr(conv, "sm_count", lambda: 1)
    device = conv.shared_per_block
    for stride, ksize in (((1, 1), 3), ((2, 1), 0)):
        for passes in (1, 3):
            monkeypatch.setattr(conv, "shared_per_block", device)
            alone = conv.halo_geometry(8, (3, 3), stride, (1, 1), passes)[-1]
            for shared, span in ((device(), 2), (alone, 1)):
                monkeypatch.setattr(conv, "shared_per_block", lambda shared=shared: shared)
                conv.conv2d_implicit_gemm(Dev((2, 8, 20, 18)), Dev((64, 8, 3, 3)), None,
                                          Dev((2, 64, 18 // stride[0], 16)), stride=stride,
                                          padding=(0, 0), dilation=(1, 1), passes=passes)
                assert launches[-1].name == f"conv2d_halo<{passes}, {ksize}, {span}>"
                assert launches[-1].shared_mem == (alone if span == 1 else
                                                   conv.halo_shared_bytes(*conv.halo_geometry(
                                                       8, (3, 3), stride, (1, 1), passes)[:4],
                                                       passes, span=2))
    monkeypatch.setattr(conv, "shared_per_block", device)
    monkeypatch.setattr(conv, "sm_count", lambda: 132)
    # Past one chunk of 8 input channels, 3xTF32 on the wgmma build (sm_90a) takes the 3 x 3
    # geometry as arguments (its one-accumulator sum is as accurate as float32 for one chunk
    # only); TF32, and the portable build's step sums, keep it compiled in.
    for target in ("sm_90a", None):
        monkeypatch.setattr(conv, "arch_target", lambda filename, target=target: target)
        for c in (8, 9, 19):
            for passes in (1, 3):
                ksize = 0 if passes == 3 and target and c > 8 else 3
                conv.conv2d_implicit_gemm(Dev((2, c, 20, 18)), Dev((64, c, 3, 3)), None,
                                          Dev((2, 64, 18, 16)), stride=(1, 1), padding=(0, 0),
                                          dilation=(1, 1), passes=passes)
                assert launches[-1].name == f"conv2d_halo<{passes}, {ksize}, 1>"
                conv.conv2d_pool_stats(FakeXp, Dev((2, c, 20, 18)), Dev((64, c, 3, 3)), None,
                                       Dev((2, 64, 9, 8)), sign_a=None, sign_b=None,
                                       stride=(1, 1), padding=(0, 0), dilation=(1, 1), pool=2,
                                       passes=passes)
                assert launches[-1].name == f"conv2d_halo_pool_stats<{passes}, {ksize}, 2>"
                # 4 x 4 windows in 3xTF32 with the geometry compiled in: the held weights on
                # the wgmma build, 5 tiles a sample in runs for 396 slots (3 blocks a
                # multiprocessor).
                partial, splits = conv.conv2d_pool_stats(
                    FakeXp, Dev((2, c, 20, 18)), Dev((64, c, 3, 3)), None, Dev((2, 64, 4, 4)),
                    sign_a=None, sign_b=Dev((64,)), stride=(1, 1), padding=(1, 1),
                    dilation=(1, 1), pool=4, passes=passes)
                if passes == 3 and target and ksize:
                    held = launches[-1]
                    assert held.name == "conv2d_held_weights_pool_stats"
                    assert (splits, held.grid, held.block) == (5, (10, 1), (128,))
                    assert held.shared_mem == 4 * (6 * 1632 + 3 * 64)
                    assert argument(held, "splits") == 5 and partial.shape == (2, 64, 5, 4)
                else:
                    assert launches[-1].name == f"conv2d_halo_pool_stats<{passes}, {ksize}, 4>"
    # Rows of 70 columns in TF32 on the wgmma build: bands of 4 whole rows (2 samples x 5),
    # 32 channels a block (2 channel blocks sharing the 264 slots), each channel's staged band
    # 4 * 70 + 4 floats apart.
    monkeypatch.setattr(conv, "arch_target", lambda filename: "sm_90a")
    y = Dev((2, 64, 18, 70))
    conv.conv2d_implicit_gemm(Dev((2, 8, 20, 72)), Dev((64, 8, 3, 3)), Dev((64,)), y,
                              stride=(1, 1), padding=(0, 0), dilation=(1, 1), passes=1)
    band = launches[-1]
    assert band.name == "conv2d_halo_bands"
    assert band.grid == (10, 2) and argument(band, "cs") == 284
    assert band.shared_mem == conv.halo_bands_shared(2, 64, 18, 70, y.data.ptr) == 4 * (
        conv.halo_shared_bytes(8, 6, 66, 3, 1) // 4 - 64 * conv.halo_out_stride(1) + 32 * 284)
    monkeypatch.setattr(conv, "arch_target", lambda filename: None)
    # Stride 1: the compiled-in 3 x 3 geometry, 18 x 16 outputs in 5 tiles; stride 2: the
    # geometry as arguments, 9 x 16 in 3.
    for stride, ksize, p, splits_want in (((1, 1), 3, 18, 5), ((2, 1), 0, 9, 3)):
        for pool in (2, 4):
            for passes in (1, 3):
                partial, splits = conv.conv2d_pool_stats(
                    FakeXp, Dev((2, 8, 20, 18)), Dev((64, 8, 3, 3)), Dev((64,)),
                    Dev((2, 64, p // pool, 16 // pool)), sign_a=Dev((64,)), sign_b=None,
                    stride=stride, padding=(0, 0), dilation=(1, 1), pool=pool, passes=passes)
                assert launches[-1].name == (
                    f"conv2d_halo_pool_stats<{passes}, {ksize}, {pool}>")
                assert splits == splits_want and partial.shape == (2, 64, splits, 4)
    with pytest.raises(ValueError, match="pool 2 or 4"):
        conv.conv2d_pool_stats(FakeXp, Dev((2, 8, 20, 18)), Dev((64, 8, 3, 3)), None,
                               Dev((2, 64, 6, 5)), sign_a=None, sign_b=None, stride=(1, 1),
                               padding=(0, 0), dilation=(1, 1), pool=3, passes=1)
    # Pipeline C's transposed 3-D convolution, both passes: 2 x 2 x 2 tiles of 4 x 4 x 16 base
    # positions per sample, each its own run (16 blocks) for each of 2 channel tiles; the
    # halo copied 16 bytes at a time (C_in % 4 == 0), pass 2's stores paired (W_out even);
    # here no tensor map (by_four, pairs, tma, then the map).
    monkeypatch.setattr(conv, "float32_tensor_map", lambda *args: None)
    x, w = Dev((2, 32, 5, 6, 17), "nhwc"), Dev((32, 64, 3, 3, 3))
    for passes in (1, 3):
        partial, splits = conv.conv_transpose3d_softmax_sums(
            FakeXp, x, w, Dev((64,)), out_shape=(2, 64, 10, 12, 34), clamp=(0.0, 1.0),
            passes=passes)
        assert launches[-1].name == f"conv_transpose3d_s2k3<{passes}, CT3_SOFTMAX_SUMS, false>"
        assert splits == 8 and partial.shape == (2, 64, 8, 2)
        assert launches[-1].grid == (16, 2) and launches[-1].args[-4:-1] == (1, 0, 0)
        conv.conv_transpose3d_softmax(x, w, None, Dev((2, 64, 10, 12, 34)), Dev((128,)),
                                      clamp=(0.0, 1.0), passes=passes)
        assert launches[-1].name == f"conv_transpose3d_s2k3<{passes}, CT3_SOFTMAX, false>"
        assert launches[-1].grid == (16, 2) and launches[-1].args[-4:-1] == (1, 1, 0)
        # The public conv_transpose3d's route: the convolution stored; non-finite weights'
        # outputs rewritten by the definition in that launch (TF32), or after it by blocks
        # (channel, samples) that check the channel's weight (3xTF32).
        before = len(launches)
        conv.conv_transpose3d_implicit_gemm(x, w, Dev((64,)), Dev((2, 64, 10, 12, 34)),
                                            passes=passes)
        stored = launches[before]
        assert stored.name == f"conv_transpose3d_s2k3<{passes}, CT3_CONV, false>"
        assert stored.grid == (16, 2) and stored.args[-4:-1] == (1, 1, 0)
        assert stored.shared_mem == conv._CT3_SHARED
        assert len(launches) == before + (2 if passes == 3 else 1)
        if passes == 3:
            assert launches[-1].name == "conv_nonfinite_weight_rows<TransposedConvDefinition>"
            assert launches[-1].grid == (64, 2) and launches[-1].args[4:7] == (2, 32, 64)
            # x's element strides (channels-last), then y's (contiguous): n, c, d, h, w.
            assert launches[-1].args[-10:-5] == (32 * 5 * 6 * 17, 1, 32 * 6 * 17, 32 * 17, 32)
            assert launches[-1].args[-5:] == (64 * 10 * 12 * 34, 10 * 12 * 34, 12 * 34, 34, 1)
        # An NCDHW x is read as it is in TF32, by input planes (here without a tensor map:
        # by cp.async), in the ring's shared memory.
        x_first = Dev((2, 32, 5, 6, 17))
        if passes == 3:
            with pytest.raises(ValueError, match="in TF32"):
                conv.conv_transpose3d_implicit_gemm(x_first, w, None, Dev((2, 64, 10, 12, 34)),
                                                    passes=passes)
            continue
        conv.conv_transpose3d_implicit_gemm(x_first, w, None, Dev((2, 64, 10, 12, 34)),
                                            passes=passes)
        assert launches[-1].name == "conv_transpose3d_s2k3<1, CT3_CONV, true>"
        assert launches[-1].args[-4:-1] == (0, 1, 0)
        assert launches[-1].shared_mem == conv._CT3_SHARED_NCDHW
    # The public forward convolutions' check of each output channel's weight: a block per
    # channel and sample slot, a 2-D problem as 3-D with a unit depth, y in its strides.
    conv.conv_nonfinite_weight_rows(Dev((2, 4, 8, 3)), Dev((6, 2, 2, 5)), Dev((6,)),
                                    Dev((2, 6, 4, 1), "nhwc"), groups=2, stride=(3, 2),
                                    padding=(2, 1), dilation=(1, 1))
    assert launches[-1].name == "conv_nonfinite_weight_rows<ForwardConvDefinition>"
    assert launches[-1].grid == (6, 2) and launches[-1].args[4:7] == (2, 2, 3)
    assert launches[-1].args[7:22] == (1, 8, 3, 1, 4, 1, 1, 2, 5, 1, 3, 2, 0, 2, 1)
    assert launches[-1].args[-10:] == (96, 24, 0, 3, 1, 24, 1, 0, 6, 6)
    # After a plan that spreads a non-finite input: the scan (a thread a position of x, its
    # channels in turn) and the outputs of the flagged samples, forward or transposed; each
    # block reads 256 samples' flags, the channels on grid.y.
    x_cl = Dev((300, 4, 8, 3), "nhwc")
    flags = conv.conv_nonfinite_input_flags(FakeXp, x_cl)
    scan = launches[-1]
    assert scan.name == "conv_nonfinite_input_scan" and scan.block == (256,)
    assert scan.grid == (-(-300 * 24 // 256),)
    assert flags.shape == (300,) and flags.dtype == np.uint32
    assert argument(scan, "flags") is flags
    assert argument(scan, "N") == 300 and argument(scan, "C") == 4
    assert (argument(scan, "Di"), argument(scan, "Hi"), argument(scan, "Wi")) == (1, 8, 3)
    assert scan.args[-5:] == (96, 1, 0, 12, 4)
    for transposed, w_shape, y_shape in ((False, (6, 2, 2, 5), (300, 6, 4, 1)),
                                         (True, (4, 3, 2, 5), (300, 6, 9, 9))):
        conv.conv_nonfinite_input_samples(
            x_cl, Dev(w_shape), None, Dev(y_shape), flags, transposed=transposed,
            groups=2, stride=(3, 2), padding=(2, 1), dilation=(1, 1))
        samples = launches[-1]
        kind = "TransposedConvDefinition" if transposed else "ForwardConvDefinition"
        assert samples.name == f"conv_nonfinite_input_samples<{kind}>"
        assert samples.grid == (2, 6) and samples.block == (256,)
        assert argument(samples, "flags") is flags
        assert (argument(samples, "c_in_group"), argument(samples, "c_out_group")) == (2, 3)
        assert argument(samples, "C") == 6 and argument(samples, "N") == 300
    # Where the driver makes x's map: its geometry (dims C, W, H, D, N; byte strides; the
    # box of one halo), the flag on. C_in not a multiple of 4 (4-byte strides): no map asked.
    maps = []
    monkeypatch.setattr(conv, "float32_tensor_map",
                        lambda *args: maps.append(args) or cufused._cuda.TensorMap())
    conv.conv_transpose3d_softmax(x, w, None, Dev((2, 64, 10, 12, 34)), Dev((128,)),
                                  clamp=(0.0, 1.0), passes=1)
    assert maps == [(x.data.ptr, (32, 17, 6, 5, 2), (128, 2176, 13056, 65280), (32, 17, 5, 5, 1))]
    assert launches[-1].args[-4:-1] == (1, 1, 1)
    conv.conv_transpose3d_softmax(Dev((2, 6, 5, 6, 17), "nhwc"), Dev((6, 64, 3, 3, 3)), None,
                                  Dev((2, 64, 10, 12, 34)), Dev((128,)), clamp=(0.0, 1.0),
                                  passes=1)
    assert len(maps) == 1 and launches[-1].args[-4:-1] == (0, 1, 0)
    # conv_transpose3d_s2k3_groups, with the softmax sums too
    # (test_transposed_3d_class_groups: its geometry).
    operands = (Dev((2, 32, 5, 6, 17), "nhwc"), Dev((32, 64, 3, 3, 3)), None,
                Dev((2, 64, 10, 12, 34), "nhwc"))
    assert conv.conv_transpose3d_groups(*operands)
    assert conv.conv_transpose3d_groups_softmax_sums(FakeXp, *operands, clamp=(0.0, 1.0))
    check_all(launches, "conv_gemm.cu")
    halo = [launch for launch in launches if launch.name.startswith("conv2d_halo<")]
    # 2 samples x 5 x 1 tiles of 4 x 32 pixels: a block per tile (fewer tiles than 2 blocks
    # per multiprocessor); the 8 input channels in one chunk, halos of 6 x 34 (stride 1) and
    # 9 x 34 (stride 2: 2 samples x 3 tiles); the tiles staged and stored in pairs, or alone
    # (one tile a row here: the same blocks).
    assert {(launch.name[-2], launch.grid, launch.args[-3:]) for launch in halo} == {
        ("1", (10, 1), (8, 6, 34)), ("1", (6, 1), (8, 9, 34)),  # a block per tile
        *((span, (2, 1), geometry) for span in "12"             # one multiprocessor's 2
          for geometry in ((8, 6, 34), (8, 9, 34)))}
    # 3 tiles a row (70 columns), 48 samples: 2 groups a row (a pair, the last tile alone),
    # 48 x 5 x 2 groups on 264 blocks; the scratch holds a pair.
    for passes in (1, 3):
        conv.conv2d_implicit_gemm(Dev((48, 8, 20, 72)), Dev((64, 8, 3, 3)), None,
                                  Dev((48, 64, 18, 70)), stride=(1, 1), padding=(0, 0),
                                  dilation=(1, 1), passes=passes)
        assert launches[-1].grid == (264, 1) and launches[-1].name.endswith(", 2>")
        assert launches[-1].shared_mem == conv.halo_shared_bytes(8, 6, 34, 3, passes, span=2)


def test_halo_span(monkeypatch):
    # Pairs of tiles where there are more tiles than one wave of blocks, the pair's scratch
    # fits a block, and a multiprocessor holds as many blocks of it as of one tile's, up to
    # the launch bounds: on 228 KB multiprocessors (9.0) TF32's pair of 3 x 3 tiles keeps 2
    # blocks; on 164 KB (8.0) it would leave 1 of 2, and the tiles go alone; 3xTF32's kernel
    # holds one block a multiprocessor either way.
    conv = LAUNCHERS["conv_gemm.cu"]
    monkeypatch.setattr(conv, "sm_count", lambda: 132)
    monkeypatch.setattr(conv, "shared_per_block", lambda: 227 * 1024)
    for per_sm, want in ((228, (2, 2)), (164, (1, 2))):
        monkeypatch.setattr(conv, "resident_blocks",
                            lambda shared, per_sm=per_sm: per_sm * 1024 // (shared + 1024))
        for passes, span in zip((1, 3), want):
            alone = conv.halo_shared_bytes(8, 6, 34, 3, passes)
            paired = conv.halo_shared_bytes(8, 6, 34, 3, passes, span=2)
            assert conv.halo_span(16384, passes, alone, paired) == span
            assert conv.halo_span(264, passes, alone, paired) == 1  # one wave of blocks
            assert conv.halo_span(265, passes, alone, paired) == span
    monkeypatch.setattr(conv, "shared_per_block", lambda: 99 * 1024)
    assert conv.halo_span(16384, 1, 70 * 1024, 100 * 1024) == 1  # the pair does not fit


def test_channels_last_stores(launches, monkeypatch):
    # On the wgmma build 3xTF32 with the geometry compiled in runs with the weights held in
    # registers (conv2d_nhwc_held_weights: tensor stores through y's map, three blocks a
    # multiprocessor, then conv_nonfinite_weight_rows), else into a channels-last y with K
    # even, 8-byte aligned it stores its tiles from the accumulators
    # (conv2d_halo_nhwc_direct: two blocks a multiprocessor). conv2d_halo_nhwc stores them by
    # tensor stores where K % 4 == 0, y is 16-byte aligned, the driver makes the map (dims K,
    # Q, P, N; 16-byte strides; boxes of 32 channels x 32 x 4 pixels) and the scratch of two
    # tiles keeps the blocks a multiprocessor that the threads' scratch has (two in TF32,
    # one in 3xTF32); else its threads store them.
    conv = LAUNCHERS["conv_gemm.cu"]
    monkeypatch.setattr(conv, "sm_count", lambda: 132)
    maps = []
    made = {"map": True}
    monkeypatch.setattr(conv, "float32_tensor_map", lambda *args, **kw: maps.append(args)
                        or (conv.TensorMap() if made["map"] else None))

    def launch(y, passes=1, target="sm_90a", c=8):
        monkeypatch.setattr(conv, "arch_target", lambda filename: target)
        conv.conv2d_implicit_gemm(Dev((2, c, 20, 18)), Dev((y.shape[1], c, 3, 3)), None, y,
                                  stride=(1, 1), padding=(0, 0), dilation=(1, 1),
                                  passes=passes)
        if launches[-1].name == "conv_nonfinite_weight_rows<ForwardConvDefinition>":
            assert launches[-2].name == "conv2d_nhwc_held_weights"
            return launches[-2]
        return launches[-1]

    thread_shared = conv.halo_geometry(8, (3, 3), (1, 1), (1, 1), 1, channels_last=True)[-1]
    offset = {passes: conv._halo_scratch_offset(8, 6, 34, 3, passes) for passes in (1, 3)}
    y = Dev((2, 64, 18, 16), "nhwc", ptr=1 << 20)
    run = launch(y, 1)
    assert run.name == "conv2d_halo_nhwc<1, 3, NHWC_TENSOR>"
    assert run.shared_mem == 4 * (offset[1] + 4 * 32 * 4 * 32 + 255) > thread_shared
    assert maps[-1] == ((1 << 20), (64, 16, 18, 2), (4 * 64, 4 * 64 * 16, 4 * 64 * 16 * 18),
                        (32, 32, 4, 1))
    run = launch(y, 3)
    assert run.name == "conv2d_nhwc_held_weights" and len(maps) == 2 and maps[1] == maps[0]
    assert run.shared_mem == 4 * (2 * 4096 + 6 * 1632 + 255) and run.grid == (10, 1)
    made["map"] = False  # the driver refuses the map: the stores from the accumulators
    run = launch(y, 3)
    assert run.name == "conv2d_halo_nhwc_direct<3, 3>"
    assert run.shared_mem == 4 * (offset[3] + 64) and run.grid == (10, 1)
    made["map"] = True
    assert launch(Dev((2, 64, 18, 16)), 3).name == "conv2d_halo<3, 3, 1>"  # NCHW: staged
    # 3xTF32 past one chunk of input channels takes the geometry as arguments: tensor stores.
    assert launch(Dev((2, 64, 18, 16), "nhwc"), 3, c=9).name == (
        "conv2d_halo_nhwc<3, 0, NHWC_TENSOR>")
    assert launch(Dev((2, 64, 18, 16)), 3, c=9).name == "conv2d_halo<3, 0, 1>"
    for y, target, passes, name in (
            (Dev((2, 64, 18, 16), "nhwc", ptr=(1 << 20) + 8), "sm_90a", 3, "direct"),
            (Dev((2, 64, 18, 16), "nhwc", ptr=(1 << 20) + 8), "sm_90a", 1, "NHWC_THREADS"),
            (Dev((2, 64, 18, 16), "nhwc", ptr=(1 << 20) + 4), "sm_90a", 3, "NHWC_THREADS"),
            (Dev((2, 70, 18, 16), "nhwc"), "sm_90a", 1, "NHWC_THREADS"),
            (Dev((2, 70, 18, 16), "nhwc"), "sm_90a", 3, "direct"),
            (Dev((2, 7, 18, 16), "nhwc"), "sm_90a", 3, "NHWC_THREADS"),
            (Dev((2, 64, 18, 16), "nhwc"), None, 1, "NHWC_THREADS"),
            (Dev((2, 64, 18, 16), "nhwc"), None, 3, "NHWC_THREADS")):
        run = launch(y, passes, target)
        want = ("conv2d_halo_nhwc_direct<3, 3>" if name == "direct"
                else f"conv2d_halo_nhwc<{passes}, 3, {name}>")
        assert run.name == want, (y.shape, passes, target)
        if name == "NHWC_THREADS":
            assert run.shared_mem == conv.halo_geometry(8, (3, 3), (1, 1), (1, 1), passes,
                                                        channels_last=True)[-1]
    made["map"] = False  # the driver refuses the map
    assert launch(Dev((2, 64, 18, 16), "nhwc"), 1).name == "conv2d_halo_nhwc<1, 3, NHWC_THREADS>"
    made["map"] = True
    # A multiprocessor holding two blocks of the held weights' shared memory, not three.
    held_blocks = {"n": 2}
    monkeypatch.setattr(conv, "resident_blocks", lambda shared: held_blocks["n"]
                        if shared == conv._HELD_SHARED else 228 * 1024 // (shared + 1024))
    assert launch(Dev((2, 64, 18, 16), "nhwc"), 3).name == "conv2d_halo_nhwc_direct<3, 3>"
    held_blocks["n"] = 3
    assert launch(Dev((2, 64, 18, 16), "nhwc"), 3).name == "conv2d_nhwc_held_weights"
    # The sm_90a build failing when the held kernels are first built (an NVRTC without the
    # target) leaves the portable build, whose held kernels trap: the halo kernels run.
    fetch = conv.get_kernel
    build = {"target": "sm_90a"}

    def get_kernel(filename, name, **kw):
        if "held" in name:
            build["target"] = None
        return fetch(filename, name, **kw)

    monkeypatch.setattr(conv, "get_kernel", get_kernel)
    monkeypatch.setattr(conv, "arch_target", lambda filename: build["target"])
    count = len(launches)
    conv.conv2d_implicit_gemm(Dev((2, 8, 20, 18)), Dev((64, 8, 3, 3)), None,
                              Dev((2, 64, 18, 16), "nhwc"), stride=(1, 1), padding=(0, 0),
                              dilation=(1, 1), passes=3)
    assert [run.name for run in launches[count:]] == ["conv2d_halo_nhwc<3, 3, NHWC_THREADS>"]
    build["target"] = "sm_90a"
    partial, splits = conv.conv2d_pool_stats(
        FakeXp, Dev((2, 8, 20, 18)), Dev((64, 8, 3, 3)), None, Dev((2, 64, 4, 4)),
        sign_a=None, sign_b=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), pool=4,
        passes=3)
    assert launches[-1].name == "conv2d_halo_pool_stats<3, 3, 4>"
    assert splits == conv.sample_segments(2, 5, 132 * 2)[0] == argument(launches[-1], "splits")
    # A multiprocessor holding one block of the two tiles' scratch, or of the direct stores'
    # shared memory, but two of the threads' staged tile: tensor stores in 3xTF32 (one block
    # either way), the threads' in TF32.
    monkeypatch.setattr(conv, "resident_blocks", lambda shared: 2 if shared <= thread_shared
                        else 1)
    assert launch(Dev((2, 64, 18, 16), "nhwc"), 1).name == "conv2d_halo_nhwc<1, 3, NHWC_THREADS>"
    assert launch(Dev((2, 64, 18, 16), "nhwc"), 3).name == "conv2d_halo_nhwc<3, 3, NHWC_TENSOR>"


def test_transposed_3d_class_groups(launches, monkeypatch):
    # conv_transpose3d_s2k3_groups: 3xTF32 on the wgmma build into a packed channels-last y
    # of an even number of channels, 8-byte aligned, from C_in % 4 == 0; a block a
    # multiprocessor for each channel tile of 64, shared among the four groups by their costs;
    # the rows of non-finite weights checked after it, y in its (channels-last) strides.
    conv = LAUNCHERS["conv_gemm.cu"]
    monkeypatch.setattr(conv, "sm_count", lambda: 132)
    monkeypatch.setattr(conv, "arch_target", lambda filename: "sm_90a")
    y = Dev((2, 64, 10, 12, 34), "nhwc")
    assert conv.transposed_s2k3_groups_take(32, y, 3)
    assert conv._CTG_SHARED == 4 * (2 * 8 * 64 * 32 + 2 * 10752 + 4 + 8 * 64) <= 227 * 1024
    for c_in, y_other, passes in ((32, y, 1), (30, y, 3), (32, Dev((2, 64, 10, 12, 34)), 3),
                                  (32, Dev((2, 63, 10, 12, 34), "nhwc"), 3),
                                  (32, Dev((2, 64, 10, 12, 34), "nhwc", ptr=(1 << 20) + 4), 3)):
        assert not conv.transposed_s2k3_groups_take(c_in, y_other, passes)
    monkeypatch.setattr(conv, "arch_target", lambda filename: None)  # the portable build
    assert not conv.transposed_s2k3_groups_take(32, y, 3)
    monkeypatch.setattr(conv, "arch_target", lambda filename: "sm_90a")
    monkeypatch.setattr(conv, "shared_per_block", lambda: 200 * 1024)
    assert not conv.transposed_s2k3_groups_take(32, y, 3)
    # Shares 35 : 37 : 41 : 19 of 132 blocks, and of 44 for each of 3 channel tiles.
    assert conv.transposed_s2k3_group_blocks(64) == (35, 72, 113, 132)
    assert conv.transposed_s2k3_group_blocks(130) == (12, 24, 38, 44)
    monkeypatch.setattr(conv, "sm_count", lambda: 2)  # one block a group at least
    assert conv.transposed_s2k3_group_blocks(64) == (1, 2, 3, 4)
    monkeypatch.setattr(conv, "sm_count", lambda: 132)
    monkeypatch.setattr(conv, "float32_tensor_map", lambda *args: None)
    x, w = Dev((2, 32, 5, 6, 17), "nhwc"), Dev((32, 64, 3, 3, 3))
    assert not conv.conv_transpose3d_groups(x, w, None, y) and not launches
    monkeypatch.setattr(conv, "float32_tensor_map", lambda *args: conv._NO_TENSOR_MAP)
    assert conv.conv_transpose3d_groups(x, w, Dev((64,)), y)
    run, rows = launches
    assert run.name == "conv_transpose3d_s2k3_groups" and run.grid == (132, 1)
    assert run.shared_mem == conv._CTG_SHARED and run.args[4:13] == (2, 32, 5, 6, 17, 64, 10,
                                                                     12, 34)
    assert run.args[13:16] == (35, 72, 113)
    assert rows.name == "conv_nonfinite_weight_rows<TransposedConvDefinition>"
    assert rows.args[-5:] == (64 * 10 * 12 * 34, 1, 64 * 12 * 34, 64 * 34, 64)
    # Pipeline C's softmax sums in the epilogue: a (ref, sum) pair a row a block, the clamp's
    # bounds.
    sums = conv.conv_transpose3d_groups_softmax_sums(FakeXp, x, w, None, y, clamp=(-0.5, 1.0))
    run = launches[2]
    assert sums.shape == (2 * 64, 132, 2)
    assert run.name == "conv_transpose3d_s2k3_groups_softmax_sums" and run.grid == (132, 1)
    assert run.args[13:19] == (33, 68, 110, sums, -0.5, 1.0)  # shares 33 : 35 : 42 : 22
    monkeypatch.setattr(conv, "float32_tensor_map", lambda *args: None)
    assert conv.conv_transpose3d_groups_softmax_sums(FakeXp, x, w, None, y,
                                                     clamp=(-0.5, 1.0)) is None
    # The partials fit where no larger than y: twice the 132 blocks' pairs a row at most.
    assert conv.transposed_s2k3_groups_sums_fit((2, 64, 1, 12, 22))
    assert not conv.transposed_s2k3_groups_sums_fit((2, 64, 1, 1, 263))
    monkeypatch.setattr(conv, "shared_per_block", lambda: 227 * 1024)
    assert conv.transposed_s2k3_groups_take_channels(32, 64, 3)
    for c_in, c_out, passes in ((32, 64, 1), (30, 64, 3), (32, 63, 3)):
        assert not conv.transposed_s2k3_groups_take_channels(c_in, c_out, passes)
    for launch in launches:
        check_launch(launch)


def test_halo_bands_shared(monkeypatch):
    # conv2d_halo_bands takes rows of 65 to 128 columns on the wgmma build where each band's
    # run of rows is a multiple of 16 bytes at a 16-byte aligned address (P * Q and
    # (P % 4) * Q multiples of 4) and two blocks fit a multiprocessor.
    conv = LAUNCHERS["conv_gemm.cu"]
    monkeypatch.setattr(conv, "shared_per_block", lambda: 227 * 1024)
    monkeypatch.setattr(conv, "resident_blocks", lambda shared: 228 * 1024 // (shared + 1024))
    monkeypatch.setattr(conv, "arch_target", lambda filename: "sm_90a")
    for q, cs in ((65, 260), (70, 284), (101, 404), (128, 516)):
        assert conv.band_channel_stride(q) == cs and cs % 8 == 4
    assert conv.halo_bands_shared(128, 64, 126, 126, 1 << 20) == 4 * (5184 + 72 + 2 * 8 * 424
                                                                       + 32 * 508)
    for p, q in ((18, 70), (8, 101), (7, 100), (126, 128), (4, 65 + 3), (2, 66), (4, 65)):
        assert conv.halo_bands_shared(2, 64, p, q, 1 << 20)
    for p, q, address in ((18, 64, 0), (18, 130, 0), (7, 101, 0), (9, 102, 0), (18, 70, 8)):
        assert not conv.halo_bands_shared(2, 64, p, q, address)
    assert not conv.halo_bands_shared(0, 64, 18, 70, 0)
    assert conv.halo_bands_shared(1, 65535 * 32, 18, 70, 0)
    assert not conv.halo_bands_shared(1, 65535 * 32 + 1, 18, 70, 0)  # past the grid's y
    monkeypatch.setattr(conv, "resident_blocks", lambda shared: 1)
    assert not conv.halo_bands_shared(2, 64, 18, 70, 0)
    monkeypatch.setattr(conv, "resident_blocks", lambda shared: 2)
    monkeypatch.setattr(conv, "arch_target", lambda filename: None)  # the portable build
    assert not conv.halo_bands_shared(2, 64, 18, 70, 0)


def test_halo_kernels_within_the_devices_shared_memory(launches, monkeypatch):
    # Where a block may have 99 KB (compute capability 8.6, 8.9, 12.0), 3xTF32's 3 x 3
    # convolution (three weight planes, two halo planes and the output tile) goes to the
    # gathering kernel; its TF32 one (its tiles staged one at a time) and the pooling
    # epilogues in either precision fit.
    conv = LAUNCHERS["conv_gemm.cu"]
    monkeypatch.setattr(conv, "sm_count", lambda: 132)
    monkeypatch.setattr(conv, "shared_per_block", lambda: 99 * 1024)
    monkeypatch.setattr(conv, "arch_target", lambda filename: None)  # the portable build
    x, w = Dev((2, 8, 20, 18)), Dev((64, 8, 3, 3))
    for passes, kernel in ((1, "conv2d_halo<1, 3, 1>"), (3, "conv2d_igemm<3>")):
        conv.conv2d_implicit_gemm(x, w, None, Dev((2, 64, 18, 16)), stride=(1, 1),
                                  padding=(0, 0), dilation=(1, 1), passes=passes)
        assert launches[-1].name == kernel
        if passes == 1:  # one tile staged at a time: a pair's scratch does not fit
            assert launches[-1].shared_mem <= 99 * 1024
        for pool in (2, 4):
            conv.conv2d_pool_stats(FakeXp, x, w, None, Dev((2, 64, 18 // pool, 16 // pool)),
                                   sign_a=None, sign_b=None, stride=(1, 1), padding=(0, 0),
                                   dilation=(1, 1), pool=pool, passes=passes)
            assert launches[-1].name == f"conv2d_halo_pool_stats<{passes}, 3, {pool}>"
            assert launches[-1].shared_mem <= 99 * 1024
    assert conv.halo_geometry(8, (3, 3), (1, 1), (1, 1), 3, pool=4) is not None
    assert conv.halo_geometry(8, (3, 3), (1, 1), (1, 1), 3) is None
    monkeypatch.setattr(conv, "shared_per_block", lambda: 48 * 1024)
    with pytest.raises(ValueError, match="a halo that fits"):
        conv.conv2d_pool_stats(FakeXp, x, w, None, Dev((2, 64, 4, 4)), sign_a=None,
                               sign_b=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1),
                               pool=4, passes=3)


def test_halo_layout_helpers():
    # The launcher gives the pooling epilogue's scratch room to start at the next 16-byte
    # boundary (float4 loads) after halos of any size, odd ones (the first two) included,
    # each in two planes and the weights in three (3xTF32 with the geometry compiled in) or
    # one, and the
    # run schedule covers the edge cases.
    conv = LAUNCHERS["conv_gemm.cu"]
    assert [conv.halo_planes(passes, ksize) for passes in (1, 3) for ksize in (0, 3)] == [
        1, 1, 1, 2]
    assert [conv.weight_planes(passes, ksize) for passes in (1, 3) for ksize in (0, 3)] == [
        1, 1, 1, 3]
    for cc, hr, hc, ksize in [(3, 9, 65, 0), (1, 4, 33, 0), (8, 6, 34, 3), (2, 8, 36, 0)]:
        for passes in (1, 3):
            planes = 2 if passes == 3 and ksize else 1
            halos = 2 * planes * cc * conv.halo_channel_stride(hr, hc, ksize)
            weights = (planes + planes // 2) * conv._HALO_RC * (conv._TILE_K + 8)
            scratch = -(-(weights + conv._HALO_RC + halos) // 4) * 4
            assert conv.halo_shared_bytes(cc, hr, hc, ksize, passes, pool=4) == 4 * (
                scratch + conv._POOL_SCRATCH_FLOATS)
    assert conv.halo_row_stride(34, 3) == 36 and conv.halo_row_stride(34, 0) == 34
    assert conv.sample_segments(0, 5, 264) == (1, 0)
    assert conv.sample_segments(3, 0, 264) == (1, 0)
    assert conv.sample_segments(128, 128, 264) == (2, 256)  # pipeline A on 132 SMs
    for n, tiles, slots in [(1, 128, 264), (5, 15, 2), (300, 128, 264), (7, 3, 264)]:
        splits, blocks = conv.sample_segments(n, tiles, slots)
        assert 1 <= splits <= tiles and 1 <= blocks <= min(n * splits, slots)


def test_softmax_launchers(launches, monkeypatch):
    softmax = LAUNCHERS["softmax.cu"]
    narrow, wide = (0.0, 1.0), (-80.0, 80.0)  # no running max / the online softmax
    for length in (100, 99):  # 16-byte normalize pass or not; no cluster (length % 8 != 0)
        for clamp in (None, wide, narrow):
            softmax.softmax_rows(FakeXp, Dev((6, length)), Dev((6, length)), rows=6,
                                 length=length, channels=6, strides=(0, length, 1),
                                 clamp=clamp)
    for channels in (6, 8):  # channels-last rows: scalar or 16-byte passes
        for clamp in (wide, narrow):
            y = Dev((2, 64, channels))
            softmax.softmax_rows(FakeXp, y, Dev((2, channels, 64)), rows=2 * channels,
                                 length=64, channels=channels,
                                 strides=(64 * channels, 1, channels), layout="nhwc",
                                 bias=Dev((channels,)), scale=Dev((channels,)), clamp=clamp)
    for channels in (6, 8):  # more samples than a grid's z takes: the blocks loop over them
        n = 70000
        softmax.softmax_rows(FakeXp, Dev((n, 64, channels)), Dev((n, channels, 64)),
                             rows=n * channels, length=64, channels=channels,
                             strides=(64 * channels, 1, channels), layout="nhwc", clamp=wide)
        assert launches[-1].name.startswith("softmax_apply_transpose")
        assert launches[-1].grid[2] == 65535 and launches[-1].args[5] == n
    for sd in (1, 2):  # class blocks: one read per row (clusters), or the two passes
        for sh in (1, 2):
            for sw in (1, 2):
                y = Dev((sd * sh * sw, 2, 3, 8, 2, 4))
                out = Dev((2, 3, sd * 8, sh * 2, sw * 4))
                for clamp in (narrow, wide):
                    softmax.softmax_rows(FakeXp, y, out, rows=6, length=out.size // 6,
                                         channels=3, strides=None, layout="classes",
                                         bias=Dev((3,)), clamp=clamp)
    for out_shape in ((2, 3, 16, 4, 3), (2, 3, 16, 2, 6)):  # classes of 3 columns, SW 1 or 2
        softmax.softmax_rows(FakeXp, Dev((4, 2, 3, 8, 2, 3)), Dev(out_shape), rows=6,
                             length=192, channels=3, strides=None, layout="classes",
                             clamp=wide)
    monkeypatch.setattr(softmax, "_compute_capability", lambda: 80)
    softmax.softmax_rows(FakeXp, Dev((6, 64)), Dev((6, 64)), rows=6, length=64, channels=6,
                         strides=(0, 64, 1), clamp=narrow)
    softmax.softmax_rows_nonfinite_weight(
        FakeXp, Dev((2, 4, 3, 4, 5)), Dev((4, 3, 3, 3, 3)), Dev((2, 6, 6, 8, 10)), groups=2,
        stride=(2, 2, 2), padding=(1, 1, 1), dilation=(1, 1, 1), bias=None, scale=Dev((6,)),
        clamp=narrow)
    check_all(launches, "softmax.cu")
    # N, C, input and output channels a group; no sample flags
    assert launches[-1].grid == (6, 2) and launches[-1].args[6:10] == (2, 6, 2, 3)
    assert argument(launches[-1], "sample_flags") == 0
    flags = Dev((2,), dtype=np.uint32)
    softmax.softmax_rows_nonfinite_weight(
        FakeXp, Dev((2, 4, 3, 4, 5)), Dev((4, 3, 3, 3, 3)), Dev((2, 6, 6, 8, 10)), groups=2,
        stride=(2, 2, 2), padding=(1, 1, 1), dilation=(1, 1, 1), bias=None, scale=None,
        clamp=narrow, sample_flags=flags)
    check_launch(launches[-1])
    assert argument(launches[-1], "sample_flags") is flags
    clusters = [launch for launch in launches if launch.name.startswith("softmax_rows_cluster")]
    assert all(launch.shared_mem == launch.shared_bytes > 0 for launch in clusters)


# ------------------------------------------------------------------------- the layers

def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        yield path, parts[:-1] if parts[-1] == "__init__" else parts


def test_a_failed_architecture_build_leaves_the_portable_one(monkeypatch):
    """Where NVRTC cannot build a source for the device's own target, the kernel comes in
    the portable build with a warning, and arch_target names no target for that source on
    that device from then on (the launchers then choose as for the portable build)."""
    cupy = pytest.importorskip("cupy")
    cuda = cufused._cuda
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(cuda, "_arch_target", lambda filename, device: "sm_90a")
    monkeypatch.setattr(cuda, "_arch_failed", set())
    built = []

    def no_target(filename, name, arch):
        built.append((name, arch))
        raise RuntimeError("NVRTC_ERROR_INVALID_OPTION: invalid value for --gpu-architecture")

    class Module:
        def __init__(self, **kwargs):
            self.names = kwargs["name_expressions"]

        def get_function(self, name):
            built.append((name, None))
            return name

    monkeypatch.setattr(cuda, "_CubinKernel", no_target)
    monkeypatch.setattr(cupy, "RawModule", Module)
    assert cuda.arch_target("conv_gemm.cu") == "sm_90a"
    with pytest.warns(RuntimeWarning, match="not built for sm_90a"):
        assert cuda._build("conv_gemm.cu", "conv2d_halo_bands", 0, False) == "conv2d_halo_bands"
    assert cuda.arch_target("conv_gemm.cu") is None
    assert cuda._build("conv_gemm.cu", "conv2d_igemm<1>", 0, False) == "conv2d_igemm<1>"
    assert built == [("conv2d_halo_bands", "sm_90a"), ("conv2d_halo_bands", None),
                     ("conv2d_igemm<1>", None)]


def test_bands_route(launches, monkeypatch):
    """conv2d_implicit_gemm takes conv2d_halo_bands for TF32 only, y 16-byte aligned, and the
    sm_90a build it asked for: where that build fails (the portable kernel would trap) the
    pairs of conv2d_halo run."""
    conv = LAUNCHERS["conv_gemm.cu"]
    monkeypatch.setattr(conv, "sm_count", lambda: 132)
    monkeypatch.setattr(conv, "arch_target", lambda filename: "sm_90a")
    x, w = Dev((48, 8, 20, 72)), Dev((64, 8, 3, 3))
    for passes, y, name in ((1, Dev((48, 64, 18, 70)), "conv2d_halo_bands"),
                            (3, Dev((48, 64, 18, 70)), "conv2d_halo<3, 3, 2>"),
                            (1, Dev((48, 64, 18, 70), ptr=(1 << 30) + 8), "conv2d_halo<1, 3, 2>")):
        conv.conv2d_implicit_gemm(x, w, None, y, stride=(1, 1), padding=(0, 0),
                                  dilation=(1, 1), passes=passes)
        assert launches[-1].name == name
    answers = iter(("sm_90a", None))  # the decision, then after the failed build
    monkeypatch.setattr(conv, "arch_target", lambda filename: next(answers))
    conv.conv2d_implicit_gemm(x, w, None, Dev((48, 64, 18, 70)), stride=(1, 1),
                              padding=(0, 0), dilation=(1, 1), passes=1)
    assert launches[-1].name == "conv2d_halo<1, 3, 2>" and len(launches) == 4


def test_channels_last_route(launches, monkeypatch):
    """conv2d_implicit_gemm writes a packed channels-last y with conv2d_halo_nhwc (the
    geometry compiled in or as arguments, both precisions) and gives it the halo kernel's
    shared memory with the pixel-major tile's scratch."""
    conv = LAUNCHERS["conv_gemm.cu"]
    monkeypatch.setattr(conv, "sm_count", lambda: 132)
    monkeypatch.setattr(conv, "arch_target", lambda filename: "sm_90a")
    monkeypatch.setattr(conv, "float32_tensor_map", lambda *args: None)  # threads store
    monkeypatch.setattr(conv, "nhwc_direct_shared", lambda *args: 0)
    x = Dev((48, 8, 20, 72))
    for passes in (1, 3):
        for w, stride, ksize in ((Dev((64, 8, 3, 3)), (1, 1), 3), (Dev((64, 8, 5, 5)), (2, 2), 0)):
            name = f"conv2d_halo_nhwc<{passes}, {ksize}, NHWC_THREADS>"
            kh = w.shape[2]
            y = Dev((48, 64, (20 - kh) // stride[0] + 1, (72 - kh) // stride[1] + 1), "nhwc")
            assert conv.takes_channels_last(8, (kh, kh), stride, (1, 1), passes)
            conv.conv2d_implicit_gemm(x, w, None, y, stride=stride, padding=(0, 0),
                                      dilation=(1, 1), passes=passes)
            launch = launches[-1]
            assert launch.name == name
            cc, hr, hc, ksize, shared = conv.halo_geometry(8, (kh, kh), stride, (1, 1), passes,
                                                           channels_last=True)
            assert launch.shared_mem == shared == conv.halo_shared_bytes(
                cc, hr, hc, ksize, passes) - 4 * 64 * (4 * 32 + 4) + 4 * 128 * 72
            tiles = 48 * -(-y.shape[2] // 4) * -(-y.shape[3] // 32)
            assert launch.grid == (min(tiles, 264), 1)


def test_channels_last_tensor_stores_need_the_sm90a_build(launches, monkeypatch):
    """conv2d_halo_nhwc stores through y's tensor map (NHWC_TENSOR) where the sm_90a build it
    asked for came; where that build fails when the kernel is first built (the portable
    kernel would trap), its threads store the tiles with the threads' scratch."""
    conv = LAUNCHERS["conv_gemm.cu"]
    monkeypatch.setattr(conv, "sm_count", lambda: 132)
    monkeypatch.setattr(conv, "float32_tensor_map", lambda *args: types.SimpleNamespace(
        as_argument=lambda: "map"))
    monkeypatch.setattr(conv, "nhwc_direct_shared", lambda *args: 0)
    x, w = Dev((48, 8, 20, 72)), Dev((64, 8, 3, 3))
    thread_shared = conv.halo_geometry(8, (3, 3), (1, 1), (1, 1), 1, channels_last=True)[4]
    for answers, store in ((["sm_90a"] * 2, "NHWC_TENSOR"), (["sm_90a", None], "NHWC_THREADS")):
        answers = iter(answers)  # the decision, then after the build
        monkeypatch.setattr(conv, "arch_target", lambda filename: next(answers))
        conv.conv2d_implicit_gemm(x, w, None, Dev((48, 64, 18, 70), "nhwc"), stride=(1, 1),
                                  padding=(0, 0), dilation=(1, 1), passes=1)
        launch = launches[-1]
        assert launch.name == f"conv2d_halo_nhwc<1, 3, {store}>"
        assert (argument(launch, "ymap") == "map") == (store == "NHWC_TENSOR")
        assert (launch.shared_mem == thread_shared) == (store == "NHWC_THREADS")


def test_get_kernel_grants_what_the_static_shared_memory_leaves(monkeypatch):
    """A launch gets 48 KB less the kernel's static shared memory without a grant: past that
    the kernel is granted what the launch declares, once."""
    cupy = pytest.importorskip("cupy")
    cuda = cufused._cuda

    class Kernel:
        shared_size_bytes = 256
        max_dynamic_shared_size_bytes = 48 * 1024 - 256

    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(cuda, "_build", lambda *args: Kernel())
    for table in ("_kernels", "_shared_default", "_shared_granted"):
        monkeypatch.setattr(cuda, table, {})
    name = next(iter(KERNELS["normalization.cu"]))
    kernel = cuda.get_kernel("normalization.cu", name, shared_bytes=48 * 1024 - 256)
    assert kernel.max_dynamic_shared_size_bytes == 48 * 1024 - 256  # fits: no grant
    for need in (48 * 1024 - 252, 48 * 1024, 48 * 1024 - 100):
        assert cuda.get_kernel("normalization.cu", name, shared_bytes=need) is kernel
    assert kernel.max_dynamic_shared_size_bytes == 48 * 1024  # the largest, kept


def test_channel_sample_grid():
    # The non-finite-weight kernels' grid: a block per channel and at least 256 a problem,
    # a block per 256 samples, within the grid's y limit.
    from cufused._kernels._common import channel_sample_grid

    assert channel_sample_grid(64, 32) == (64, 4)  # pipeline C's: 256 blocks for 2048 rows
    assert channel_sample_grid(6, 2) == (6, 2) and channel_sample_grid(300, 7) == (300, 1)
    assert channel_sample_grid(1, 1) == (1, 1) and channel_sample_grid(1, 1000) == (1, 256)
    assert channel_sample_grid(1024, 2**21) == (1024, 8192)
    assert channel_sample_grid(64, 2**25) == (64, 65535)


def test_launcher_calls_match_their_signatures():
    """Every call of a launcher in the package, most of them on GPU-only paths, passes as many
    positional arguments as the launcher takes and only keywords it names: checked here by
    binding each call's shape to the launcher's signature."""
    import importlib
    import importlib.util
    import inspect

    checked = 0
    for path, parts in _modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        package = ".".join(parts if path.name == "__init__.py" else parts[:-1])
        launchers = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = importlib.util.resolve_name("." * node.level + (node.module or ""),
                                                     package) if node.level else node.module
                if module and module.startswith("cufused._kernels"):
                    imported = importlib.import_module(module)
                    for alias in node.names:
                        fn = getattr(imported, alias.name, None)
                        if inspect.isfunction(fn):
                            launchers[alias.asname or alias.name] = fn
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in launchers):
                continue
            if (any(isinstance(a, ast.Starred) for a in node.args)
                    or any(k.arg is None for k in node.keywords)):
                continue  # *args or **kwargs: the shape is not known statically
            try:
                inspect.signature(launchers[node.func.id]).bind(
                    *node.args, **{k.arg: k.value for k in node.keywords})
            except TypeError as exc:
                raise AssertionError(f"{path}:{node.lineno}: {node.func.id}: {exc}") from None
            checked += 1
    assert checked > 50  # the pipelines' and ops' launcher calls


def test_only_the_launchers_launch_kernels():
    for path, parts in _modules():
        if parts[1:2] in (("_kernels",), ("_cuda",)):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                assert called not in ("get_kernel", "launch_1d"), f"{path}:{node.lineno}"


# Higher layers may import lower ones and their own; the front ends (dask, torch, benchmark,
# the CLI) sit on top and are not listed.
LAYERS = {"_arrays": 0, "_precision": 0, "_cuda": 0, "_blas": 0, "_layout": 0, "_subpixel": 0,
          "_scoped": 0, "_settings": 0, "_timing": 0, "reference": 0, "_kernels": 1,
          "_cudnn": 2, "_ops": 3, "_capture": 3, "_call_graphs": 3, "_prepared": 3,
          "pipelines": 4}


def test_imports_point_down():
    for path, parts in _modules():
        if len(parts) < 2 or parts[1] not in LAYERS:
            continue
        package = parts if path.name == "__init__.py" else parts[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[:len(package) - node.level + 1]
                targets = ([(*base, *node.module.split("."))] if node.module else
                           [(*base, alias.name) for alias in node.names])
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [
                    alias.name for alias in node.names]
                targets = [tuple(name.split(".")) for name in names]
            else:
                continue
            for target in targets:
                if target[0] != "cufused":
                    continue
                # The package root imports every layer: below it, a module may not import it.
                assert len(target) >= 2, f"{path}:{node.lineno} imports the package root"
                assert target[1] in LAYERS, f"{path}: imports {'.'.join(target)}"
                assert LAYERS[target[1]] <= LAYERS[parts[1]], \
                    f"{path}:{node.lineno} imports {'.'.join(target)} from a higher layer"
