"""NumPy emulation of conv_gemm.cu's conv_transpose3d_s2k3 (pipeline C's transposed 3-D
convolution, stride 2, 3 x 3 x 3, padding 1, with the clamped softmax in its epilogues): the
runs of tiles (SampleSegments, tile_origin), the halo and the weights staged swizzled
(ct3_swizzled), the residue classes and their taps, pass 1's per-run sums, the factors, and
pass 2's output positions with the paired stores, with float64 products, against the float64
reference (no GPU); and the staged weights read through the wgmma build's 128-byte-swizzle
descriptor (ct3_weight_desc, its stride and swizzle fields read from the source), against the
weights. It works on positions and channels: the lanes' fragments, the order of the classes
and the output pointers are the GPU tests' to check, but for an NCDHW x (X_NCDHW): there
each block's ring of input planes (ring numbers, slots, the 20-column planes) and the A
fragments that the lanes load from it (ld_fragment_planes' addresses, the reduction's
channel order 0, 2, 4, 6, 1, 3, 5, 7 and the weights staged in it) are emulated too, and
each load's 32 lanes checked for 32 different banks. Run it after changing the kernel's
index math (and change it alongside).

Usage: python scripts/emulate_conv_transpose3d.py
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np
from emulate_conv_halo import segments

from cufused import reference
from cufused._kernels._common import clamp_middle
from cufused._kernels.conv_gemm import _CT3_BN as BN
from cufused._kernels.conv_gemm import _CT3_CI as CI
from cufused._kernels.conv_gemm import _CT3_RING as RING
from cufused._kernels.conv_gemm import _CT3_TILE
from cufused._kernels.conv_gemm import _CT3_XW as XW
from cufused._kernels.conv_gemm import sample_segments

TD, TH, TW = _CT3_TILE
HH, HW = TH + 1, TW + 1
HPOS = (TD + 1) * HH * HW
XCS = HH * XW  # CT3_XCS: a channel's values in a plane
SLOT = CI * XCS

CASES = [  # x shape (N, C_in, D, H, W), C_out, output padding, clamp, resident blocks
    ((1, 5, 3, 6, 19), 7, (1, 1, 0), (-0.5, 1.0), 3),  # C_in % 4 != 0, cut tiles, odd W_out
    ((1, 5, 3, 6, 19), 7, (1, 1, 1), (0.0, 1.0), 2),  # paired stores in a cut tile
    ((2, 32, 5, 4, 16), 40, (1, 1, 1), (-2.0, 3.0), 3),  # every input channel, 2 channel tiles
    ((3, 3, 1, 1, 1), 1, (0, 0, 0), (0.0, 1.0), 132),  # one base position a sample
]
# Through the plane ring also: one block a channel tile takes 24 tiles (the ring goes round).
RING_CASES = CASES + [((2, 6, 9, 6, 20), 5, (1, 1, 1), (-1.0, 1.0), 1)]


def swizzled(row, c):
    """ct3_swizzled: the float offset of value c of a 32-value row, its 16-byte chunks
    swizzled by the row's low 3 bits."""
    return row * CI + (((c >> 2) ^ (row & 7)) << 2) + (c & 3)


def taps_of(r: int) -> int:
    return (1 + (r >> 2)) * (1 + ((r >> 1) & 1)) * (1 + (r & 1))


def tap_at(r: int, t: int):
    """The kernel's tap t of class r = (rd, rh, rw): its kernel index (kd, kh, kw) and input
    offset (a, b, c) from the base position."""
    rd, rh, rw = r >> 2, (r >> 1) & 1, r & 1
    c = t & 1 if rw else 0
    b = (t >> rw) & 1 if rh else 0
    a = t >> (rw + rh) if rd else 0
    kernel = (2 - 2 * a if rd else 1, 2 - 2 * b if rh else 1, 2 - 2 * c if rw else 1)
    return kernel, (a, b, c)


def channel_k(c):
    """ct3_channel_k: the reduction index of input channel c where X_NCDHW (each 8 channels
    in the order 0, 2, 4, 6, 1, 3, 5, 7)."""
    return (c & ~7) | ((c & 1) << 2) | ((c >> 1) & 3)


def staged_weights(w, k0, planes=False):
    """The block's shared weights: [tap][o][k] in swizzled rows of o, zeros past C and K;
    channel c at reduction index k = c, or channel_k(c) where ``planes`` (X_NCDHW)."""
    c_total, k_total = w.shape[:2]
    wt = np.zeros(27 * BN * CI)
    o, c = np.meshgrid(np.arange(BN), np.arange(CI), indexing="ij")
    keep = (c < c_total) & (k0 + o < k_total)
    for tap in range(27):
        vals = np.zeros((BN, CI))
        vals[keep] = w[c[keep], k0 + o[keep], tap // 9, (tap // 3) % 3, tap % 3]
        wt[tap * BN * CI + swizzled(o, channel_k(c) if planes else c)] = vals
    return wt


class PlaneRing:
    """A block's ring of input planes (X_NCDHW): CT3_RING slots of CI channels x HH rows x
    XW columns, NaN until written; input plane p of the block's i-th tile is ring number
    (TD + 1) i + p, in slot number % CT3_RING. Slots keep what earlier tiles left there, so
    that a read of the wrong slot reads another tile's values."""

    def __init__(self):
        self.slots = np.full(RING * SLOT, np.nan)
        self.tile = 0  # the block's tiles so far
        self.banks_ok = True

    def slot_base(self, p: int) -> int:
        return (self.tile * (TD + 1) + p) % RING * SLOT

    def stage(self, x, n, origin):
        """The tile's TD + 1 planes from (d0 + p, h0, w0), as the tensor copies bring them:
        zeros outside the input and past C."""
        _, c_total, d_in, h_in, w_in = x.shape
        d0, h0, w0 = origin
        h, col = np.meshgrid(h0 + np.arange(HH), w0 + np.arange(XW), indexing="ij")
        inside = (h < h_in) & (col < w_in)
        for p in range(TD + 1):
            plane = np.zeros((CI, HH, XW))
            if d0 + p < d_in:
                for c in range(min(c_total, CI)):
                    plane[c][inside] = x[n, c, d0 + p, h[inside], col[inside]]
            self.slots[self.slot_base(p):self.slot_base(p) + SLOT] = plane.ravel()

    def fragments(self, row: int, offset: tuple[int, int, int]) -> np.ndarray:
        """The A operand [16 rows, CI reduction indices] of tile row ``row`` at input offset
        (a, b, c) as the 32 lanes load it (row_position, plane_address, plane_a_address,
        ld_fragment_planes: a[0] at the lane's address, a[1] 8 positions on, a[2] and a[3]
        a channel on, step ks 8 channels on); every load's lanes on 32 different banks."""
        a, b, c = offset
        lane = np.arange(32)
        gid, tig = lane >> 2, lane & 3
        first = (self.slot_base(row // TH + a) + 2 * tig * XCS + (row % TH) * XW + gid
                 + b * XW + c)
        frag = np.full((16, CI), np.nan)
        for ks in range(CI // 8):
            for dm, dk, step in ((0, 0, 0), (8, 0, 8), (0, 4, XCS), (8, 4, XCS + 8)):
                at = first + ks * 8 * XCS + step
                self.banks_ok &= len(set((at % 32).tolist())) == 32
                frag[gid + dm, 8 * ks + tig + dk] = self.slots[at]
        return frag


def tile_origin(t: int, tiles_h: int, tiles_w: int) -> tuple[int, int, int]:
    """The kernel's tile_origin: tile t's first base position."""
    th, tw = divmod(t, tiles_w)
    td = th // tiles_h
    return td * TD, (th - td * tiles_h) * TH, tw * TW


def tile_classes(x, wt, bias, n, origin, out_shape, ring=None):
    """One tile's classes r = 0 .. 7: ``(r, acc, od, oh, ow, inside)``, acc[row, column,
    channel] = conv + bias over the swizzled halo and weights (or the fragments that the
    lanes load from the block's PlaneRing ``ring``), the rows' and columns' output positions
    and which of them lie inside the output ([row, column, 1])."""
    _, c_total, d_in, h_in, w_in = x.shape
    d_out, h_out, w_out = out_shape[2:]
    d0, h0, w0 = origin
    rows, m, c_idx, o_idx = np.arange(TD * TH), np.arange(TW), np.arange(CI), np.arange(BN)
    pd, ph = rows // TH, rows % TH
    halo = np.zeros(HPOS * CI)
    p = np.arange(HPOS)
    d, h, ww = d0 + p // (HH * HW), h0 + (p // HW) % HH, w0 + p % HW
    inside = (d < d_in) & (h < h_in) & (ww < w_in)
    for c in range(min(c_total, CI)):
        vals = np.zeros(HPOS)
        vals[inside] = x[n, c, d[inside], h[inside], ww[inside]]
        halo[swizzled(p, c)] = vals
    if ring is not None:
        ring.stage(x, n, origin)
    for r in range(8):
        rd, rh, rw = r >> 2, (r >> 1) & 1, r & 1
        acc = np.broadcast_to(bias, (TD * TH, TW, BN)).copy()
        for t in range(taps_of(r)):
            (kd, kh, kw), (a, bb, cc) = tap_at(r, t)
            if ring is None:
                pos = ((pd * HH + ph) * HW + (a * HH + bb) * HW + cc)[:, None] + m[None, :]
                av = halo[swizzled(pos[..., None], c_idx)]
            else:
                av = np.stack([ring.fragments(row, (a, bb, cc)) for row in rows])
            bv = wt[(kd * 9 + kh * 3 + kw) * BN * CI + swizzled(o_idx[:, None], c_idx)]
            acc += av @ bv.T
        od, oh, ow = 2 * (d0 + pd) + rd, 2 * (h0 + ph) + rh, 2 * (w0 + m) + rw
        inside_out = ((od < d_out) & (oh < h_out))[:, None] & (ow < w_out)
        yield r, acc, od, oh, ow, inside_out[..., None]
    if ring is not None:
        ring.tile += 1


def emulate(x, w, bias, out_shape, clamp, scale, slots, rings=None):
    """Both passes over the kernel's run schedule (SampleSegments for ``slots`` resident
    blocks per channel tile, as the launcher cuts them: pass 1 runs of tiles, pass 2 a tile
    a run, in a grid stride): pass 1's per-run sums of exp(clamp(y) - ref) (partial[n, k,
    run], ref the clamp's middle as the launcher passes it), the factors as softmax_finalize
    forms them, and pass 2's outputs exp(clamp(y) - ref) * factor with the paired stores.
    With ``rings`` (a list), each block reads an NCDHW x through its own PlaneRing, appended
    there."""
    n_total, _, d_in, h_in, w_in = x.shape
    k_total = w.shape[1]
    lo, hi = clamp
    ref = clamp_middle(clamp)
    w_out = out_shape[4]
    pairs = w_out % 2 == 0
    tiles_h, tiles_w = -(-h_in // TH), -(-w_in // TW)
    tiles = -(-d_in // TD) * tiles_h * tiles_w
    splits, blocks = sample_segments(n_total, tiles, slots)
    partial = np.full((n_total, k_total, splits), np.nan)
    y = np.full(out_shape, np.nan)
    for out_pass in ("sums", "result"):
        if out_pass == "result":
            factor = scale / partial.sum(axis=2)
        for k0 in range(0, k_total, BN):
            wt = staged_weights(w, k0, rings is not None)
            k = k0 + np.arange(BN)
            bias_k = np.where(k < k_total, bias[np.minimum(k, k_total - 1)], 0.0)
            block_rings: dict[int, PlaneRing] = {}
            runs = ((splits, blocks) if out_pass == "sums"
                    else (tiles, min(n_total * tiles, slots)))
            for block, items in segments(n_total, tiles, *runs):
                ring = None
                if rings is not None:
                    if block not in block_rings:
                        block_rings[block] = PlaneRing()
                        rings.append(block_rings[block])
                    ring = block_rings[block]
                sums = np.zeros(BN)
                for n, t, run in items:
                    origin = tile_origin(t, tiles_h, tiles_w)
                    kept = None
                    for r, acc, od, oh, ow, inside in tile_classes(x, wt, bias_k, n, origin,
                                                                  out_shape, ring):
                        ex = np.exp(np.clip(acc, lo, hi) - ref)
                        if out_pass == "sums":
                            # Every channel of the block, those past K too (never stored).
                            sums += np.where(inside, ex, 0.0).sum(axis=(0, 1))
                            continue
                        v = ex * factor[n, np.minimum(k, k_total - 1)]
                        if pairs and r & 1 == 0:
                            kept = v
                            continue
                        for row, col, o in zip(*np.nonzero(inside & (k < k_total))):
                            at = (n, k[o], od[row], oh[row])
                            if pairs:  # the float2 of outputs ow - 1 and ow
                                y[at + (ow[col] - 1,)] = kept[row, col, o]
                            y[at + (ow[col],)] = v[row, col, o]
                if out_pass == "sums":  # the run's sums, as its last tile stores them
                    n, _, run = items[-1]
                    partial[n, k0:k0 + BN, run] = sums[:k_total - k0]
    return y


def descriptor_fields() -> tuple[int, int]:
    """ct3_weight_desc's stride byte offset and swizzle mode, from conv_gemm.cu."""
    source = (Path(__file__).resolve().parents[1] / "cufused" / "_cuda" / "conv_gemm.cu")
    body = source.read_text().split("ct3_weight_desc(const float* p) {")[1].split("}")[0]
    stride = int(re.search(r"\((\d+)ull << 32\)", body).group(1)) * 16
    mode = int(re.search(r"\((\d+)ull << 62\)", body).group(1))
    return stride, mode


def check_weight_descriptor(rng) -> bool:
    """The staged weights of each tap read through ct3_weight_desc's descriptor (K-major,
    128-byte swizzle: rows of 128 bytes, 8-row groups 1024 bytes apart, the step's 8 values
    32 bytes on; the swizzle XORs address bits 4-6 with bits 7-9 of the address from the
    1024-byte aligned start) give B[n][c] = w[c, k0 + n, tap] for every reduction step."""
    stride, mode = descriptor_fields()
    ok = stride == 1024 and mode == 1  # 8 rows of 128 bytes; 1: the 128-byte swizzle
    for c_total, k_total, k0 in [(32, 64, 32), (5, 7, 0)]:
        w = rng.standard_normal((c_total, k_total, 3, 3, 3))
        wt = staged_weights(w, k0)
        for tap in range(27):
            start = tap * BN * CI * 4  # bytes from the weights' 1024-byte aligned start
            for ks in range(CI // 8):
                n, kk = np.meshgrid(np.arange(BN), np.arange(8), indexing="ij")
                at = start + 32 * ks + (n // 8) * stride + (n % 8) * 128 + kk * 4
                at = at ^ (((at >> 7) & 7) << 4)
                got = wt[at // 4]
                c = 8 * ks + kk
                want = np.zeros((BN, 8))
                keep = (c < c_total) & (k0 + n < k_total)
                want[keep] = w[c[keep], k0 + n[keep], tap // 9, (tap // 3) % 3, tap % 3]
                ok &= bool(np.array_equal(got, want))
    print(f"wgmma weight descriptor: {'ok' if ok else 'FAILED'}")
    return ok


def case_error(rng, shape, cout, op, clamp, slots, rings=None) -> float:
    """The emulation's largest relative error against the float64 reference of the
    convolution, clamp, softmax over each (sample, channel) and scale, on random operands
    (inf where an output was never written); through PlaneRings where ``rings`` is given."""
    x = rng.standard_normal(shape)
    w = rng.standard_normal((shape[1], cout, 3, 3, 3))
    b, scale = rng.standard_normal(cout), rng.standard_normal(cout)
    y = reference.conv_transpose(x, w, b, (2, 2, 2), (1, 1, 1), op, (1, 1, 1), 1)
    ref = reference.softmax(np.clip(y, *clamp), (2, 3, 4)) * scale[:, None, None, None]
    got = emulate(x, w, b, ref.shape, clamp, scale, slots, rings)
    err = (np.abs(got - ref) / np.abs(ref).max()).max()
    read = "NCDHW x, plane ring" if rings is not None else "channels-last x"
    print(f"x {shape} C_out {cout} output padding {op} clamp {clamp} ({read}): "
          f"max error {err:.1e}")
    return float(err) if not np.isnan(err) else float("inf")


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    rng = np.random.default_rng(0)
    errors = [case_error(rng, *case) for case in CASES]
    rings: list[PlaneRing] = []
    errors += [case_error(rng, *case, rings=rings) for case in RING_CASES]
    banks_ok = all(ring.banks_ok for ring in rings) and max(r.tile for r in rings) > RING
    print(f"plane ring fragments: 32 banks a load, rings gone round: "
          f"{'ok' if banks_ok else 'FAILED'}")
    descriptor_ok = check_weight_descriptor(rng)
    return 0 if descriptor_ok and banks_ok and max(errors) < 1e-9 else 1


if __name__ == "__main__":
    sys.exit(main())
