// Layout conversion between NC(D)HW and channels-last, viewed as batched matrix transposes.
#include "common.cuh"

// out[n, b, a] = in[n, a, b] (+ bias[b]) for in of shape (N, A, B), out (N, B, A), both
// contiguous. 32 x 32 tiles through shared memory keep reads and writes coalesced.
// NCHW -> NHWC is (A, B) = (C, H*W); NHWC -> NCHW with the convolution bias is (H*W, C).
// Grid (ceil(B / 32), ceil(A / 32), min(N, 65535)), block (32, 8).
template <bool BIAS>
__global__ void transpose_batched(const float* __restrict__ in, float* __restrict__ out,
                                  const float* __restrict__ bias, index_t N, index_t A,
                                  index_t B) {
    __shared__ float tile[32][33];
    const index_t b0 = (index_t)blockIdx.x * 32, a0 = (index_t)blockIdx.y * 32;
    for (index_t n = blockIdx.z; n < N; n += gridDim.z) {
        const float* src = in + n * A * B;
        float* dst = out + n * A * B;
        const index_t b = b0 + threadIdx.x;
#pragma unroll
        for (int j = threadIdx.y; j < 32; j += 8) {
            const index_t a = a0 + j;
            if (a < A && b < B) tile[j][threadIdx.x] = src[a * B + b];
        }
        __syncthreads();
        const index_t a = a0 + threadIdx.x;
#pragma unroll
        for (int j = threadIdx.y; j < 32; j += 8) {
            const index_t bb = b0 + j;
            if (a < A && bb < B) dst[bb * A + a] = tile[threadIdx.x][j] + (BIAS ? bias[bb] : 0.0f);
        }
        __syncthreads();
    }
}
