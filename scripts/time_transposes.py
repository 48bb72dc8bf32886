"""Device time of the layout conversions (device): B's input NCHW -> NHWC and C's
convolution output NHWC -> NCDHW, with the 4 x 4 register kernel and the tiled one. Median ms,
L2 flushed, with the floor (read + write at the measured copy bandwidth).
"""

import cupy

from cufused._cudnn import empty_in_layout, transpose_channels
from cufused.benchmark import Timer, measure_ceilings


def main():
    timer = Timer(repeat=20)
    copy = measure_ceilings(timer)["copy_TBps"] * 1e12
    for name, shape, to_channels_last in (("B input", (512, 64, 32, 32), True),
                                          ("C conv output", (32, 64, 32, 64, 64), False)):
        src = empty_in_layout(shape, "nhwc" if not to_channels_last else "nchw")
        src[...] = cupy.random.default_rng(0).random(shape, dtype=cupy.float32)
        dst = empty_in_layout(shape, "nhwc" if to_channels_last else "nchw")
        for vec4 in (True, False):
            ms = timer(lambda: transpose_channels(src, dst, to_channels_last=to_channels_last,
                                                  vec4=vec4))
            print(f"{name} {shape}: {'4x4 registers' if vec4 else 'tiled'} {ms:.3f} ms "
                  f"(floor {2 * src.nbytes / copy * 1e3:.3f})", flush=True)


if __name__ == "__main__":
    main()
