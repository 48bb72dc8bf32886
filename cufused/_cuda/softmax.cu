// Softmax over the trailing S positions of an (N, C, S) tensor, with pipeline C's clamp and
// per-channel scale fused: one statistics pass, one normalize pass.
#include "common.cuh"

template <bool CLAMP>
__device__ __forceinline__ float load_value(const float* p, float b, float lo, float hi) {
    const float v = *p + b;
    return CLAMP ? clamp_nan(v, lo, hi) : v;
}

// Per (n, c, split): the pair (m, sum exp(v - m)) over positions [split * chunk, ...), with
// v = y + bias (clamped to [lo, hi] when CLAMP). ONLINE keeps a running max; without it m = hi,
// valid because clamped values never exceed hi, so exp(v - hi) <= 1 cannot overflow and, for
// hi - lo small enough (checked on the host), does not underflow: no max pass is needed.
// y has strides (sn, sc, ss). Block (32, 8); NCHW: x lanes walk positions, y lanes channels;
// channels-last: x lanes walk channels, y lanes positions (coalesced either way).
template <bool CHANNELS_LAST, bool ONLINE, bool CLAMP>
__global__ void softmax_stats(const float* __restrict__ y, const float* __restrict__ bias,
                              float2* __restrict__ partial, int C, index_t S, int splits,
                              int c_tiles, index_t sn, index_t sc, index_t ss, float lo,
                              float hi) {
    __shared__ float red[2][8][33];
    const int split = blockIdx.x % splits;
    const int tile = (blockIdx.x / splits) % c_tiles;
    const index_t n = blockIdx.x / ((index_t)splits * c_tiles);
    const int c = CHANNELS_LAST ? tile * 32 + threadIdx.x : tile * 8 + threadIdx.y;
    const int lane = CHANNELS_LAST ? threadIdx.y : threadIdx.x;
    const int step = CHANNELS_LAST ? 8 : 32;
    const index_t chunk = (S + splits - 1) / splits;
    const index_t p_begin = split * chunk;
    const index_t p_end = min(S, p_begin + chunk);

    float m = ONLINE ? -INFINITY : hi, s = 0.0f;
    if (c < C) {
        const float b = bias ? bias[c] : 0.0f;
        const float* plane = y + n * sn + c * sc;
        auto take = [&](float v) {
            if (!ONLINE) {
                s += expf(v - hi);
            } else if (v > m) {
                s = s * expf(m - v) + 1.0f;
                m = v;
            } else if (v == v && m != -INFINITY) {
                s += expf(v - m);
            } else if (v != v) {
                m = v;  // NaN propagates through the merges and the finalize
                s = v;
            }
        };
        index_t p = p_begin + lane;
        // Four independent loads in flight per thread before their values are used.
        for (; p + 3 * step < p_end; p += 4 * step) {
            float v[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) v[j] = load_value<CLAMP>(plane + (p + j * step) * ss, b, lo, hi);
#pragma unroll
            for (int j = 0; j < 4; ++j) take(v[j]);
        }
        for (; p < p_end; p += step) take(load_value<CLAMP>(plane + p * ss, b, lo, hi));
    }
    if (CHANNELS_LAST) {
        red[0][threadIdx.y][threadIdx.x] = m;
        red[1][threadIdx.y][threadIdx.x] = s;
        __syncthreads();
        if (threadIdx.y == 0 && c < C) {
            for (int j = 1; j < 8; ++j) {
                if (ONLINE) softmax_merge(m, s, red[0][j][threadIdx.x], red[1][j][threadIdx.x]);
                else s += red[1][j][threadIdx.x];
            }
            partial[(n * C + c) * splits + split] = make_float2(m, s);
        }
    } else {
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
            const float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
            if (ONLINE) softmax_merge(m, s, m2, s2);
            else s += s2;
        }
        if (threadIdx.x == 0 && c < C) partial[(n * C + c) * splits + split] = make_float2(m, s);
    }
}

// One thread per (n, c) row: merge the splits' (m, s) pairs (sums in double) into the row's
// shift and factor: softmax(v) * scale[c] = exp(v - shift) * factor.
__global__ void softmax_finalize(const float2* __restrict__ partial, index_t rows, int C,
                                 int splits, const float* __restrict__ scale,
                                 float* __restrict__ shift, float* __restrict__ factor) {
    const index_t row = blockIdx.x * (index_t)blockDim.x + threadIdx.x;
    if (row >= rows) return;
    const float2* p = partial + row * splits;
    float m = -INFINITY;
    for (int j = 0; j < splits; ++j) m = nan_max(m, p[j].x);
    double s = 0.0;
    for (int j = 0; j < splits; ++j)
        if (p[j].x != -INFINITY) s += (double)p[j].y * exp((double)p[j].x - (double)m);
    // A +inf input makes every value of the row NaN (inf - inf), as in PyTorch.
    if (m == INFINITY) s = NAN;
    shift[row] = m;
    factor[row] = (float)((scale ? (double)scale[row % C] : 1.0) / s);
}

// out[n, c, s] (contiguous) = exp(v - shift[n, c]) * factor[n, c] for a contiguous (N, C, S)
// input (which may be out itself), VEC elements per thread (VEC = 4 needs S % 4 == 0).
template <bool CLAMP, int VEC>
__global__ void softmax_apply(const float* y, float* out, const float* __restrict__ bias,
                              const float* __restrict__ shift, const float* __restrict__ factor,
                              index_t total_vec, index_t S, int C, float lo, float hi) {
    for (index_t i = blockIdx.x * (index_t)blockDim.x + threadIdx.x; i < total_vec;
         i += (index_t)gridDim.x * blockDim.x) {
        const index_t row = i * VEC / S;
        const float b = bias ? bias[row % C] : 0.0f;
        const float m = shift[row], f = factor[row];
        if (VEC == 4) {
            float4 v = reinterpret_cast<const float4*>(y)[i];
            v.x = expf(load_value<CLAMP>(&v.x, b, lo, hi) - m) * f;
            v.y = expf(load_value<CLAMP>(&v.y, b, lo, hi) - m) * f;
            v.z = expf(load_value<CLAMP>(&v.z, b, lo, hi) - m) * f;
            v.w = expf(load_value<CLAMP>(&v.w, b, lo, hi) - m) * f;
            reinterpret_cast<float4*>(out)[i] = v;
        } else {
            out[i] = expf(load_value<CLAMP>(y + i, b, lo, hi) - m) * f;
        }
    }
}

// The same for a channels-last input y[n, s, c] (strides sn, 1 for c, ss), writing the
// contiguous (N, C, S) output: a 32 x 32 shared-memory tile turns the transpose into
// coalesced reads and writes. Grid (ceil(S / 32), ceil(C / 32), N), block (32, 8).
template <bool CLAMP>
__global__ void softmax_apply_transpose(const float* __restrict__ y, float* __restrict__ out,
                                        const float* __restrict__ bias,
                                        const float* __restrict__ shift,
                                        const float* __restrict__ factor, index_t S, int C,
                                        index_t sn, index_t ss, float lo, float hi) {
    __shared__ float tile[32][33];
    const index_t n = blockIdx.z;
    const index_t p0 = (index_t)blockIdx.x * 32;
    const int c0 = blockIdx.y * 32;
    {
        const int c = c0 + threadIdx.x;
        if (c < C) {
            const index_t row = n * C + c;
            const float b = bias ? bias[c] : 0.0f;
            const float m = shift[row], f = factor[row];
            for (int j = threadIdx.y; j < 32; j += 8) {
                const index_t p = p0 + j;
                if (p < S)
                    tile[j][threadIdx.x] =
                        expf(load_value<CLAMP>(y + n * sn + p * ss + c, b, lo, hi) - m) * f;
            }
        }
    }
    __syncthreads();
    const index_t p = p0 + threadIdx.x;
    if (p < S) {
        for (int j = threadIdx.y; j < 32; j += 8) {
            const int c = c0 + j;
            if (c < C) out[(n * C + c) * S + p] = tile[threadIdx.x][j];
        }
    }
}

// Thread-block clusters (sm_90): eight blocks of 512 threads share one (n, c) row of a
// contiguous (N, C, S) tensor, S % 4 == 0 and S <= 8 * 512 * VPT. Each thread keeps its VPT
// values in registers from the load to the store, so y is read once and out written once (the
// three-pass path reads y twice). The blocks' (max, sum) pairs meet in distributed shared
// memory. y may be out. Compiled for sm_80 too, where the host never launches it.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CLUSTER_OF_8 __cluster_dims__(8, 1, 1)
#else
#define CLUSTER_OF_8
#endif

__device__ __forceinline__ void cluster_sync_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// Read a float from the shared memory of block `rank` of this cluster.
__device__ __forceinline__ float cluster_load(const float* smem, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned local = (unsigned)__cvta_generic_to_shared(smem), remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
#else
    return smem[0];
#endif
}

template <bool CLAMP, int VPT>
__global__ void CLUSTER_OF_8 __launch_bounds__(512)
softmax_rows_cluster(const float* y, float* out, const float* __restrict__ bias,
                     const float* __restrict__ scale, index_t S, int C, float lo, float hi) {
    __shared__ float scratch[32];
    __shared__ float pair[2];
    const unsigned rank = blockIdx.x % 8;
    const index_t row = blockIdx.x / 8;
    const index_t chunk = ((S + 31) / 32) * 4;  // per block, a multiple of 4
    const index_t begin = rank * chunk;
    const index_t end = min(S, begin + chunk);
    const float* src = y + row * S;
    float* dst = out + row * S;
    const float b = bias ? bias[row % C] : 0.0f;
    float v[VPT];
#pragma unroll
    for (int j = 0; j < VPT / 4; ++j) {
        const index_t i = begin + ((index_t)j * 512 + threadIdx.x) * 4;
        float4 t = make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
        if (i < end) t = *reinterpret_cast<const float4*>(src + i);
        v[4 * j] = t.x; v[4 * j + 1] = t.y; v[4 * j + 2] = t.z; v[4 * j + 3] = t.w;
    }
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
        const index_t i = begin + ((index_t)(j / 4) * 512 + threadIdx.x) * 4 + (j % 4);
        if (i < end) v[j] = load_value<CLAMP>(&v[j], b, lo, hi);
        m = nan_max(m, v[j]);
    }
    // Block max (NaN-propagating), then the block's sum of exp(v - max).
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = m;
    __syncthreads();
    m = scratch[0];
    for (int w = 1; w < 16; ++w) m = nan_max(m, scratch[w]);
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < VPT; ++j) s += (v[j] == -INFINITY) ? 0.0f : expf(v[j] - m);
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) { pair[0] = m; pair[1] = s; }
    cluster_sync_all();
    float gm = -INFINITY, gs = 0.0f;
    for (unsigned r = 0; r < 8; ++r)
        softmax_merge(gm, gs, cluster_load(&pair[0], r), cluster_load(&pair[1], r));
    cluster_sync_all();  // no block may leave while another still reads its pair
    if (gm == INFINITY || gm != gm) gs = NAN;  // +inf or NaN in the row: all NaN, as PyTorch
    const float f = (scale ? scale[row % C] : 1.0f) / gs;
#pragma unroll
    for (int j = 0; j < VPT / 4; ++j) {
        const index_t i = begin + ((index_t)j * 512 + threadIdx.x) * 4;
        if (i < end) {
            float4 t;
            t.x = expf(v[4 * j] - gm) * f;
            t.y = expf(v[4 * j + 1] - gm) * f;
            t.z = expf(v[4 * j + 2] - gm) * f;
            t.w = expf(v[4 * j + 3] - gm) * f;
            *reinterpret_cast<float4*>(dst + i) = t;
        }
    }
}
