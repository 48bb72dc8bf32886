// Layout conversion between NC(D)HW and channels-last, viewed as batched matrix transposes.
#include "common.cuh"

// What transpose_batched does to each value on its way out: nothing, + bias[b], or pipeline
// A's GroupNorm affine and clamp, clamp(f(v), lo, hi) with f the ChannelAffine of entry
// n * B + b in coef (rows of N * B entries). The launcher names these codes in the
// instantiations it requests (cufused/_kernels/layout.py).
#define EPILOGUE_NONE 0
#define EPILOGUE_BIAS 1
#define EPILOGUE_AFFINE_CLAMP 2

// out[n, b, a] = epilogue(in[n, a, b]) for in of shape (N, A, B), out (N, B, A), both
// contiguous, A * B < 2**31 (offsets within one sample are 32-bit). A block moves a 32 x
// (32 * TILES) tile through shared memory: 4 * TILES loads per thread in flight, reads and
// writes coalesced. TILES = 4 unless B is short (pipeline A's 64 channels: 2, where a 128-wide
// tile would leave half the threads idle). NCHW -> NHWC is (A, B) = (C, H*W); NHWC -> NCHW
// with the convolution bias or the affine is (H*W, C).
// Grid (ceil(B / (32 * TILES)) * ceil(A / 32), 1, min(N, 65535)), block (32, 8): the tiles of
// a sample are numbered along b first in grid x, which, unlike grid y, takes a long A.
template <int EPILOGUE, int TILES>
__global__ void transpose_batched(const float* __restrict__ in, float* __restrict__ out,
                                  const float* __restrict__ bias,
                                  const float* __restrict__ coef, float lo, float hi,
                                  index_t N, index_t A, index_t B) {
    __shared__ float tile[TILES][32][33];
    const int a_len = (int)A, b_len = (int)B;
    const int b_tiles = (b_len + 32 * TILES - 1) / (32 * TILES);
    const int b0 = (blockIdx.x % b_tiles) * 32 * TILES, a0 = (blockIdx.x / b_tiles) * 32;
    for (index_t n = blockIdx.z; n < N; n += gridDim.z) {
        const float* src = in + n * A * B;
        float* dst = out + n * A * B;
#pragma unroll
        for (int t = 0; t < TILES; ++t) {
            const int b = b0 + t * 32 + threadIdx.x;
#pragma unroll
            for (int k = 0; k < 4; ++k) {  // a constant trip count keeps all 16 loads in flight
                const int j = threadIdx.y + 8 * k;
                const int a = a0 + j;
                if (a < a_len && b < b_len) tile[t][j][threadIdx.x] = src[a * b_len + b];
            }
        }
        __syncthreads();
        const int a = a0 + threadIdx.x;
#pragma unroll
        for (int t = 0; t < TILES; ++t) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int j = threadIdx.y + 8 * k;
                const int b = b0 + t * 32 + j;
                if (a < a_len && b < b_len) {
                    float v = tile[t][threadIdx.x][j];
                    if (EPILOGUE == EPILOGUE_BIAS) v += bias[b];
                    if (EPILOGUE == EPILOGUE_AFFINE_CLAMP)
                        v = clamp_nan(ChannelAffine::load(coef, N * B, n * B + b)(v), lo, hi);
                    dst[b * a_len + a] = v;
                }
            }
        }
        __syncthreads();
    }
}

// Between NC(D)HW and packed channels-last for C % 8 == 0 and 16-byte aligned buffers: a
// thread moves 8 channels of one position, one 4-byte access a channel on the NC(D)HW side
// (coalesced across the warp's positions) and two 16-byte accesses, a full 32-byte sector, on
// the channels-last side. Unlike a 32 x 32 tile it does not idle when there are few channels
// (pipeline A's input has 8). TO_CHANNELS_LAST: out[n, s, c] = in[n, c, s], else
// out[n, c, s] = in[n, s, c].
template <bool TO_CHANNELS_LAST>
__global__ void transpose_channels8(const float* __restrict__ in, float* __restrict__ out,
                                    index_t N, int C, index_t S) {
    const int groups = C / 8;
    const index_t total = N * groups * S;
    for (index_t i = blockIdx.x * (index_t)blockDim.x + threadIdx.x; i < total;
         i += (index_t)gridDim.x * blockDim.x) {
        const index_t s = i % S;
        const index_t rest = i / S;
        const int g = (int)(rest % groups);
        const index_t n = rest / groups;
        const index_t planar = (n * C + g * 8) * S + s, last = (n * S + s) * C + g * 8;
        if (TO_CHANNELS_LAST) {
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = __ldg(in + planar + j * S);
            float4* dst = reinterpret_cast<float4*>(out + last);
            dst[0] = make_float4(v[0], v[1], v[2], v[3]);
            dst[1] = make_float4(v[4], v[5], v[6], v[7]);
        } else {
            const float4* src = reinterpret_cast<const float4*>(in + last);
            const float4 a = __ldg(src), b = __ldg(src + 1);
            const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
            for (int j = 0; j < 8; ++j) out[planar + j * S] = v[j];
        }
    }
}

// y[n, c, s] += bias[c] in place, contiguous (R = N * C rows of S values), VEC values per
// thread (VEC = 4 needs S % 4 == 0 and a 16-byte aligned y).
template <int VEC>
__global__ void add_channel_bias(float* __restrict__ y, const float* __restrict__ bias,
                                 index_t total_vec, index_t S, int C) {
    for (index_t i = blockIdx.x * (index_t)blockDim.x + threadIdx.x; i < total_vec;
         i += (index_t)gridDim.x * blockDim.x) {
        const float b = bias[(i * VEC / S) % C];
        if (VEC == 4) {
            float4 v = reinterpret_cast<float4*>(y)[i];
            v.x += b; v.y += b; v.z += b; v.w += b;
            reinterpret_cast<float4*>(y)[i] = v;
        } else {
            y[i] += b;
        }
    }
}

struct AddChannelBias {
    const float* bias;
    int C;
    float b;
    __device__ void row(index_t r) { b = bias ? bias[r % C] : 0.0f; }
    __device__ float operator()(float v) const { return v + b; }
};

// A sub-pixel transposed convolution's class blocks -> the NC(D)HW result (+ bias[c]).
// Grid-stride over the items of interleave_classes.
template <int SW, int VEC>
__global__ void subpixel_interleave(const float* __restrict__ classes, float* __restrict__ out,
                                    const float* __restrict__ bias, index_t rows, int C, int Md,
                                    int Mh, int Mw, int sd, int sh) {
    interleave_classes<SW, VEC>(classes, out, rows, Md, Mh, Mw, sd, sh,
                                AddChannelBias{bias, C, 0.0f});
}
