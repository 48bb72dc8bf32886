"""The tensor memory accelerator's maps (``cufused._cuda.float32_tensor_map``) without a GPU:
the driver's encoder replaced by a recorder, or absent."""

from __future__ import annotations

import ctypes

import pytest

import cufused._cuda as cuda


@pytest.fixture
def encoder(monkeypatch):
    """Replace the driver's cuTensorMapEncodeTiled; returns the list of its recorded calls and
    a setter of the status it returns."""
    calls, status = [], [0]

    def encode(out, dtype, rank, address, dims, strides, box, element_strides, interleave,
               swizzle, promotion, fill):
        calls.append(dict(out=out.value, dtype=dtype, rank=rank, address=address.value,
                          dims=list(dims), strides=list(strides), box=list(box),
                          element_strides=list(element_strides), interleave=interleave,
                          swizzle=swizzle, fill=fill))
        ctypes.memset(out.value, 0xAB, cuda.TensorMap.BYTES)
        return status[0]

    cuda.float32_tensor_map.cache_clear()
    monkeypatch.setattr(cuda, "_encode_tiled", lambda: encode)
    yield calls, status
    cuda.float32_tensor_map.cache_clear()


def test_map_geometry_is_what_the_driver_gets(encoder):
    calls, _ = encoder
    got = cuda.float32_tensor_map(1 << 30, (32, 17, 6, 5, 2), (128, 2176, 13056, 65280),
                                  (32, 17, 5, 5, 1))
    assert isinstance(got, cuda.TensorMap)
    (call,) = calls
    assert call["out"] == got.address and got.address % 64 == 0
    assert call == dict(out=got.address, dtype=7, rank=5, address=1 << 30,
                        dims=[32, 17, 6, 5, 2], strides=[128, 2176, 13056, 65280],
                        box=[32, 17, 5, 5, 1], element_strides=[1] * 5, interleave=0,
                        swizzle=3, fill=0)
    # The map's bytes are what the driver wrote, and they are what the launch passes.
    assert bytes(got.words.tobytes()) == b"\xab" * cuda.TensorMap.BYTES
    assert got.as_argument() is not None
    # Cached: the same geometry at the same address is the same map, encoded once.
    same = cuda.float32_tensor_map(1 << 30, (32, 17, 6, 5, 2), (128, 2176, 13056, 65280),
                                   (32, 17, 5, 5, 1))
    assert same is got and len(calls) == 1
    # Without the swizzle (an NCDHW x's planes: 20 columns, 80-byte rows), a map of its own.
    dense = cuda.float32_tensor_map(1 << 30, (32, 32, 16, 32, 32), (128, 4096, 65536, 2097152),
                                    (20, 5, 1, 32, 1), swizzle=False)
    assert dense is not got and len(calls) == 2
    assert calls[-1]["swizzle"] == 0 and calls[-1]["box"] == [20, 5, 1, 32, 1]


def test_refused_or_missing_encoder_gives_no_map(encoder, monkeypatch):
    calls, status = encoder
    status[0] = 1  # CUDA_ERROR_INVALID_VALUE
    assert cuda.float32_tensor_map(4096, (4, 8, 8, 8, 1), (16, 128, 1024, 8192),
                                   (32, 17, 5, 5, 1)) is None
    assert len(calls) == 1
    cuda.float32_tensor_map.cache_clear()
    monkeypatch.setattr(cuda, "_encode_tiled", lambda: None)
    assert cuda.float32_tensor_map(4096, (4, 8, 8, 8, 1), (16, 128, 1024, 8192),
                                   (32, 17, 5, 5, 1)) is None
    assert len(calls) == 1


def test_an_empty_map_is_zeros_and_aligned():
    empty = cuda.TensorMap()
    assert empty.address % 64 == 0 and not empty.words.any()
    assert len(empty.words) * 8 == cuda.TensorMap.BYTES
