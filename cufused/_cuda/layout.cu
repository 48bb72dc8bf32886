// Layout conversion between NC(D)HW and channels-last, viewed as batched matrix transposes.
#include "common.cuh"

// out[n, b, a] = in[n, a, b] (+ bias[b]) for in of shape (N, A, B), out (N, B, A), both
// contiguous, A * B < 2**31 (offsets within one sample are 32-bit). A block moves a 32 x 128 tile through shared memory: 16 loads per thread in
// flight, reads and writes coalesced. NCHW -> NHWC is (A, B) = (C, H*W); NHWC -> NCHW with
// the convolution bias is (H*W, C). Grid (ceil(B / 128), ceil(A / 32), min(N, 65535)),
// block (32, 8).
template <bool BIAS>
__global__ void transpose_batched(const float* __restrict__ in, float* __restrict__ out,
                                  const float* __restrict__ bias, index_t N, index_t A,
                                  index_t B) {
    __shared__ float tile[4][32][33];
    const int b0 = blockIdx.x * 128, a0 = blockIdx.y * 32;
    const int a_len = (int)A, b_len = (int)B;
    for (index_t n = blockIdx.z; n < N; n += gridDim.z) {
        const float* src = in + n * A * B;
        float* dst = out + n * A * B;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int b = b0 + t * 32 + threadIdx.x;
#pragma unroll
            for (int j = threadIdx.y; j < 32; j += 8) {
                const int a = a0 + j;
                if (a < a_len && b < b_len) tile[t][j][threadIdx.x] = src[a * b_len + b];
            }
        }
        __syncthreads();
        const int a = a0 + threadIdx.x;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
#pragma unroll
            for (int j = threadIdx.y; j < 32; j += 8) {
                const int b = b0 + t * 32 + j;
                if (a < a_len && b < b_len)
                    dst[b * a_len + a] = tile[t][threadIdx.x][j] + (BIAS ? bias[b] : 0.0f);
            }
        }
        __syncthreads();
    }
}
