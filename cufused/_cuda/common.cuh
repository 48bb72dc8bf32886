// Shared device helpers for the cufused kernels.
#pragma once

// Element offsets are 64-bit everywhere: tensors may pass 2**31 elements.
typedef long long index_t;

// NVRTC compiles without the host math headers.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif

// NaN-propagating max/min (fmaxf/fminf drop NaN; PyTorch's pooling keeps it).
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }
__device__ __forceinline__ float nan_min(float a, float b) { return (a < b || a != a) ? a : b; }

// torch.clamp semantics: NaN stays NaN, and lo > hi gives hi.
__device__ __forceinline__ float clamp_nan(float v, float lo, float hi) {
    return v != v ? v : fminf(fmaxf(v, lo), hi);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Sum over the whole block (blockDim.x * blockDim.y a multiple of 32, at most 1024 threads).
// Every thread gets the result. `scratch` holds 32 values.
template <typename T>
__device__ T block_sum(T v, T* scratch) {
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int nwarps = (blockDim.x * blockDim.y) >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if ((tid & 31) == 0) scratch[tid >> 5] = v;
    __syncthreads();
    v = (tid < nwarps) ? scratch[tid] : T(0);
    if (tid < 32) v = warp_sum(v);
    if (tid == 0) scratch[0] = v;
    __syncthreads();
    return scratch[0];
}

// Combine (max, sum of exp(x - max)) pairs of an online softmax.
__device__ __forceinline__ void softmax_merge(float& m, float& s, float m2, float s2) {
    if (m2 == -INFINITY) return;
    if (m == -INFINITY) { m = m2; s = s2; return; }
    if (m2 != m2 || m != m) { m = m + m2; s = s + s2; return; }  // NaN propagates
    const float mx = fmaxf(m, m2);
    s = s * expf(m - mx) + s2 * expf(m2 - mx);
    m = mx;
}
