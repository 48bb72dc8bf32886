// Softmax over the trailing S positions of an (N, C, S) tensor, with pipeline C's clamp and
// per-channel scale fused: one statistics pass, one normalize pass.
#include "common.cuh"

template <bool CLAMP>
__device__ __forceinline__ float load_value(const float* p, float b, float lo, float hi) {
    const float v = *p + b;
    return CLAMP ? clamp_nan(v, lo, hi) : v;
}

// Add value v to a running (m, s) pair of softmax_stats: s += exp(v - ref) without ONLINE
// (m stays ref, clamp_middle's), else the online update with a running maximum m.
template <bool ONLINE>
__device__ __forceinline__ void softmax_take(float& m, float& s, float v, float ref) {
    if (!ONLINE) {
        s += expf(v - ref);
    } else if (v > m) {
        s = s * expf(m - v) + 1.0f;
        m = v;
    } else if (v == v && m != -INFINITY) {
        s += expf(v - m);
    } else if (v != v) {
        m = v;  // NaN propagates through the merges and the finalize
        s = v;
    }
}

// Combine two pairs of softmax_take: with ONLINE as softmax_merge does; without it both share
// m = ref, so the sums add.
template <bool ONLINE>
__device__ __forceinline__ void softmax_combine(float& m, float& s, float m2, float s2) {
    if (ONLINE) softmax_merge(m, s, m2, s2);
    else s += s2;
}

// Per (n, c, split): the pair (m, sum exp(v - m)) over positions [split * chunk, ...), with
// v = y + bias (clamped to [lo, hi] when CLAMP). ONLINE keeps a running max; without it
// (CLAMP with hi - lo <= 60) m = clamp_middle(lo, hi), whose exponents neither overflow nor
// underflow: no max pass is needed.
// y has strides (sn, sc, ss). Block (32, 8); NCHW: x lanes walk positions, y lanes channels;
// channels-last: x lanes walk channels, y lanes positions (coalesced either way).
template <bool CHANNELS_LAST, bool ONLINE, bool CLAMP>
__global__ void softmax_stats(const float* __restrict__ y, const float* __restrict__ bias,
                              float2* __restrict__ partial, int C, index_t S, int splits,
                              int c_tiles, index_t sn, index_t sc, index_t ss, float lo,
                              float hi) {
    __shared__ float red[2][8][33];
    const SampleBlock block = sample_block_last_first(splits, c_tiles);
    const int split = block.split, tile = block.tile;
    const index_t n = block.n;
    const int c = CHANNELS_LAST ? tile * 32 + threadIdx.x : tile * 8 + threadIdx.y;
    const int lane = CHANNELS_LAST ? threadIdx.y : threadIdx.x;
    const int step = CHANNELS_LAST ? 8 : 32;
    index_t p_begin, p_end;
    split_range(S, splits, split, p_begin, p_end);

    const float ref = clamp_middle(lo, hi);
    float m = ONLINE ? -INFINITY : ref, s = 0.0f;
    if (c < C) {
        const float b = bias ? bias[c] : 0.0f;
        const float* plane = y + n * sn + c * sc;
        auto take = [&](float v) { softmax_take<ONLINE>(m, s, v, ref); };
        index_t p = p_begin + lane;
        // Four independent loads in flight per thread before their values are used.
        for (; p + 3 * step < p_end; p += 4 * step) {
            float v[4];
#pragma unroll
            for (int j = 0; j < 4; ++j)
                v[j] = load_value<CLAMP>(plane + (p + j * step) * ss, b, lo, hi);
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
            for (int j = 1; j < 8; ++j)
                softmax_combine<ONLINE>(m, s, red[0][j][threadIdx.x], red[1][j][threadIdx.x]);
            partial[(n * C + c) * splits + split] = make_float2(m, s);
        }
    } else {
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
            const float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
            softmax_combine<ONLINE>(m, s, m2, s2);
        }
        if (threadIdx.x == 0 && c < C) partial[(n * C + c) * splits + split] = make_float2(m, s);
    }
}

// softmax_stats for a channels-last y with 16-byte loads: a thread keeps the pairs of 4
// channels (one float4 per position); Q threads (Q dividing 32) cover the 4 Q channels of a
// tile at one position, so 256 threads read 256 / Q positions per step, 4 steps in flight:
// 64 bytes per thread against the scalar kernel's 16, which are too few to cover the DRAM
// latency. Grid splits * c_tiles * N (last samples first), block 256.
// Needs C % (4 Q) == 0, sn and ss multiples of 4, y 16-byte aligned.
template <bool ONLINE, bool CLAMP>
__global__ void softmax_stats_nhwc4(const float* __restrict__ y, const float* __restrict__ bias,
                                    float2* __restrict__ partial, int C, index_t S, int splits,
                                    int c_tiles, int Q, index_t sn, index_t ss, float lo,
                                    float hi) {
    __shared__ float2 red[8][128];  // [warp][channel of the tile]
    const SampleBlock block = sample_block_last_first(splits, c_tiles);
    const int quad = threadIdx.x % Q, lanes = blockDim.x / Q;
    const int c = block.tile * 4 * Q + 4 * quad;
    index_t p_begin, p_end;
    split_range(S, splits, block.split, p_begin, p_end);
    const float ref = clamp_middle(lo, hi);
    float b[4], m[4], s[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        b[k] = bias ? bias[c + k] : 0.0f;
        m[k] = ONLINE ? -INFINITY : ref;
        s[k] = 0.0f;
    }
    const float* base = y + block.n * sn + c;
    auto take1 = [&](int k, float x) {
        softmax_take<ONLINE>(m[k], s[k], load_value<CLAMP>(&x, b[k], lo, hi), ref);
    };
    auto take = [&](float4 v) { take1(0, v.x); take1(1, v.y); take1(2, v.z); take1(3, v.w); };
    index_t p = p_begin + threadIdx.x / Q;
    for (; p + 3 * lanes < p_end; p += 4 * lanes) {
        float4 v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
            v[j] = __ldg(reinterpret_cast<const float4*>(base + (p + j * lanes) * ss));
#pragma unroll
        for (int j = 0; j < 4; ++j) take(v[j]);
    }
    for (; p < p_end; p += lanes) take(__ldg(reinterpret_cast<const float4*>(base + p * ss)));
    // The lanes of a quad: first within the warp (Q, 2 Q, ... apart), then across the warps.
    for (int offset = 16; offset >= Q; offset >>= 1) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m[k], offset);
            const float s2 = __shfl_xor_sync(0xffffffffu, s[k], offset);
            softmax_combine<ONLINE>(m[k], s[k], m2, s2);
        }
    }
    if ((threadIdx.x & 31) < Q) {
#pragma unroll
        for (int k = 0; k < 4; ++k) red[threadIdx.x >> 5][4 * quad + k] = make_float2(m[k], s[k]);
    }
    __syncthreads();
    if (threadIdx.x < 4 * Q) {
        float2 r = red[0][threadIdx.x];
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) {
            softmax_combine<ONLINE>(r.x, r.y, red[w][threadIdx.x].x, red[w][threadIdx.x].y);
        }
        partial[(block.n * C + block.tile * 4 * Q + threadIdx.x) * splits + block.split] = r;
    }
}

// One warp per (n, c) row: merge the splits' (m, s) pairs (sums in double) into the row's
// shift and factor: softmax(v) * scale[c] = exp(v - shift) * factor. (A thread per row would
// walk its pairs one after another; a warp merges them 32 at a time.)
// A row may come in `parts` pieces (the residue classes of a sub-pixel convolution), whose
// pairs lie `rows * splits` apart.
__global__ void softmax_finalize(const float2* __restrict__ partial, index_t rows, int C,
                                 int splits, int parts, const float* __restrict__ scale,
                                 float* __restrict__ shift, float* __restrict__ factor) {
    const index_t row = (blockIdx.x * (index_t)blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;  // the whole warp: a row per warp
    const int count = parts * splits;
    auto pair = [&](int j) {
        const int k = j / splits;
        return partial[(k * rows + row) * splits + (j - k * splits)];
    };
    float m = -INFINITY;
    for (int j = lane; j < count; j += 32) m = nan_max(m, pair(j).x);
    m = warp_max(m);
    double s = 0.0;
    for (int j = lane; j < count; j += 32) {
        const float2 p = pair(j);
        if (p.x != -INFINITY) s += (double)p.y * exp((double)p.x - (double)m);
    }
    s = warp_sum(s);
    if (lane != 0) return;
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

// Element (channel ch, position p) of softmax_apply_transpose's 32 x 128 tile: the groups of
// 4 positions XOR the channel's quad (ch / 4).
__device__ __forceinline__ int transpose_slot(int ch, int p) {
    return ch * 128 + (p ^ ((ch >> 2) << 2));
}

// The same for a channels-last input y[n, s, c] (strides sn, 1 for c, ss), writing the
// contiguous (N, C, S) output: a 128-position x 32-channel tile in shared memory turns the
// transpose into coalesced reads and writes. VEC = 1: a thread loads 16 positions of one
// channel (16 loads in flight) and stores scalars. VEC = 4 (C, S and ss multiples of 4,
// 16-byte aligned buffers): a thread loads 4 channels of a position and stores 4 positions of
// a channel, 16-byte accesses, a quarter of the memory instructions.
// Grid (ceil(S / 128), ceil(C / 32), min(N, 65535)), block (32, 8): a block takes the samples
// blockIdx.z + k * gridDim.z. Six blocks a multiprocessor at least (40 registers a thread):
// left to itself the compiler takes 80 for VEC = 4, three blocks, too few loads in flight.
template <bool CLAMP, int VEC>
__global__ void __launch_bounds__(256, 6)
softmax_apply_transpose(const float* __restrict__ y, float* __restrict__ out,
                        const float* __restrict__ bias, const float* __restrict__ shift,
                        const float* __restrict__ factor, index_t N, index_t S, int C,
                        index_t sn, index_t ss, float lo, float hi) {
    const index_t p0 = (index_t)blockIdx.x * 128;
    const int c0 = blockIdx.y * 32;
    // First samples first: the statistics pass read them last, so they may still be in L2.
    for (index_t n = blockIdx.z; n < N; n += gridDim.z) {
        if constexpr (VEC == 1) {
            __shared__ float tile[128][33];  // [position][channel]
            const int c = c0 + threadIdx.x;
            if (c < C) {
                const index_t row = n * C + c;
                const float b = bias ? bias[c] : 0.0f;
                const float m = shift[row], f = factor[row];
                float v[16];
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    const index_t p = min(p0 + threadIdx.y + 8 * j, S - 1);  // in bounds
                    v[j] = load_value<CLAMP>(y + n * sn + p * ss + c, b, lo, hi);
                }
#pragma unroll
                for (int j = 0; j < 16; ++j)
                    tile[threadIdx.y + 8 * j][threadIdx.x] = expf(v[j] - m) * f;
            }
            __syncthreads();
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                const index_t p = p0 + t * 32 + threadIdx.x;
                if (p < S) {
#pragma unroll
                    for (int j = threadIdx.y; j < 32; j += 8) {
                        const int cj = c0 + j;
                        if (cj < C) out[(n * C + cj) * S + p] = tile[t * 32 + threadIdx.x][j];
                    }
                }
            }
        } else {
            // [channel][position], position groups of 4 swizzled by the channel's quad
            // (transpose_slot): a warp's scalar stores (8 quads x 4 positions of one channel
            // offset q) fall in 32 banks, and its float4 reads of a row stay whole.
            __shared__ __align__(16) float tile[32 * 128];
            const int quad = threadIdx.x & 7;
            const int lane = (threadIdx.x >> 3) + 4 * threadIdx.y;
            const int c = c0 + quad * 4;
            if (c < C) {
                float b[4], m[4], f[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    b[q] = bias ? bias[c + q] : 0.0f;
                    m[q] = shift[n * C + c + q];
                    f[q] = factor[n * C + c + q];
                }
                float4 v[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const index_t p = min(p0 + lane + 32 * j, S - 1);  // in bounds
                    v[j] = __ldg(reinterpret_cast<const float4*>(y + n * sn + p * ss + c));
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const float t[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
                    for (int q = 0; q < 4; ++q)
                        tile[transpose_slot(quad * 4 + q, lane + 32 * j)] =
                            expf(load_value<CLAMP>(&t[q], b[q], lo, hi) - m[q]) * f[q];
                }
            }
            __syncthreads();
            const int tid = threadIdx.y * 32 + threadIdx.x;
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int i = tid + 256 * r;
                const int ch = i >> 5, pq = i & 31;
                const index_t p = p0 + pq * 4;
                if (c0 + ch < C && p < S)
                    *reinterpret_cast<float4*>(out + (n * C + c0 + ch) * S + p) =
                        *reinterpret_cast<const float4*>(&tile[transpose_slot(ch, pq * 4)]);
            }
        }
        __syncthreads();  // the next sample's tile overwrites this one's
    }
}

template <bool CLAMP>
struct SoftmaxRowOp {
    const float* bias;
    const float* shift;
    const float* factor;
    int C;
    float lo, hi, b, m, f;
    __device__ void row(index_t r) {
        b = bias ? bias[r % C] : 0.0f;
        m = shift[r];
        f = factor[r];
    }
    __device__ float operator()(float v) const {
        return expf(load_value<CLAMP>(&v, b, lo, hi) - m) * f;
    }
};

// The normalize pass reading a sub-pixel convolution's class blocks (see interleave_classes
// in common.cuh) and writing the contiguous NC(D)HW result.
template <bool CLAMP, int SW, int VEC>
__global__ void softmax_apply_subpixel(const float* __restrict__ classes, float* __restrict__ out,
                                       const float* __restrict__ bias,
                                       const float* __restrict__ shift,
                                       const float* __restrict__ factor, index_t rows, int C,
                                       int Md, int Mh, int Mw, int sd, int sh, float lo,
                                       float hi) {
    interleave_classes<SW, VEC>(classes, out, rows, Md, Mh, Mw, sd, sh,
                                SoftmaxRowOp<CLAMP>{bias, shift, factor, C, lo, hi});
}

// ---------------------------------------------------------------------------------------------
// One-read softmax on Hopper (sm_90): a thread-block cluster of 8 blocks per (n, c) row, for a
// clamped row (exp(v - ref), ref = clamp_middle(lo, hi), needs no running maximum). Block
// `rank` owns the rank-th eighth of the row's output, (sd * Md / 8) whole output planes. It
// reads the values of those planes once, from the P = sd * sh * SW class blocks of a
// sub-pixel convolution (blocks [P][R][Md][Mh][Mw], see interleave_classes; a contiguous
// (R, S) tensor is the case P = 1, Md = 8, Mh = 1, Mw = S / 8), keeps exp(v - ref) in shared
// memory (at most 64 KB), and writes its part of the contiguous output once the cluster's 8
// partial sums have met in distributed shared memory. So the conv output is read once instead
// of twice. In place (y == out, P = 1) works: a block writes only what it has read, after the
// cluster barrier.
// SD, SH, SW (1 or 2): the classes along each axis. Needs Md % 8 == 0, Mh * Mw % 4 == 0,
// SW * Mw % 4 == 0 and 16-byte aligned buffers.
// Compiled for sm_80 too, where it traps (the host launches it on sm_90 and later only).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CLUSTER_OF_8 __cluster_dims__(8, 1, 1)
#define HAS_CLUSTERS 1
#else
#define CLUSTER_OF_8
#define HAS_CLUSTERS 0
#endif

constexpr int CLUSTER_ROW_THREADS = 256;

template <int SD, int SH, int SW>
__global__ void CLUSTER_OF_8 __launch_bounds__(CLUSTER_ROW_THREADS)
softmax_rows_cluster(const float* y, float* out, const float* __restrict__ bias,
                     const float* __restrict__ scale, int C, int Md, int Mh, int Mw, float lo,
                     float hi) {
#if HAS_CLUSTERS
    extern __shared__ float4 staged4[];  // exp(v - ref) of this block's values, class-major
    __shared__ float scratch[32];
    __shared__ float block_total;
    const float* staged = reinterpret_cast<const float*>(staged4);
    const unsigned rank = blockIdx.x % 8;
    // Last rows first: the convolution wrote them last, so they may still be in L2.
    const index_t rows = gridDim.x / 8;
    const index_t row = rows - 1 - blockIdx.x / 8;
    constexpr int P = SD * SH * SW;
    const int Mq = Md / 8;
    const int Q = Mq * Mh * Mw;  // values per class in this block
    const int q4 = Q / 4, n4 = P * q4;
    const float inv_q4 = 1.0f / q4;
    const index_t class_block = rows * Md * (index_t)(Mh * Mw);
    const float* src = y + (row * Md + rank * Mq) * (index_t)(Mh * Mw);
    const float b = bias ? bias[row % C] : 0.0f;
    const float ref = clamp_middle(lo, hi);

    // Read: eight 16-byte loads in flight per thread before their values are used.
    constexpr int UNROLL = 8;
    float s = 0.0f;
    for (int i0 = threadIdx.x; i0 < n4; i0 += UNROLL * CLUSTER_ROW_THREADS) {
        float4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = i0 + u * CLUSTER_ROW_THREADS;
            if (i < n4) {
                const int k = P == 1 ? 0 : quotient(i, q4, inv_q4);
                v[u] = *reinterpret_cast<const float4*>(src + k * class_block + 4 * (i - k * q4));
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = i0 + u * CLUSTER_ROW_THREADS;
            if (i < n4) {
                float4 e;
                e.x = expf(clamp_nan(v[u].x + b, lo, hi) - ref);
                e.y = expf(clamp_nan(v[u].y + b, lo, hi) - ref);
                e.z = expf(clamp_nan(v[u].z + b, lo, hi) - ref);
                e.w = expf(clamp_nan(v[u].w + b, lo, hi) - ref);
                s += (e.x + e.y) + (e.z + e.w);
                staged4[i] = e;
            }
        }
    }
    s = block_sum(s, scratch);  // its barriers also publish `staged` to the whole block
    if (threadIdx.x == 0) block_total = s;

    // The row's sum, added in rank order in every block (so all 8 agree bit for bit).
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
    const unsigned local = (unsigned)__cvta_generic_to_shared(&block_total);
    float total = 0.0f;
    for (unsigned r = 0; r < 8; ++r) {
        unsigned remote;
        float t;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(r));
        asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(t) : "r"(remote) : "memory");
        total += t;
    }
    // Arrive now, wait before leaving: no block exits while another may still read its total.
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    const float f = (scale ? scale[row % C] : 1.0f) / total;  // NaN in the row: all NaN

    // Write: 16-byte stores of the contiguous output planes, gathered from the classes.
    const int H = SH * Mh, W4 = SW * Mw / 4;
    const float inv_w4 = 1.0f / W4, inv_h = 1.0f / H;
    float4* dst = reinterpret_cast<float4*>(out + (row * P * Md + (index_t)rank * P * Mq) *
                                            (index_t)(Mh * Mw));
    for (int t = threadIdx.x; t < n4; t += CLUSTER_ROW_THREADS) {
        const int dh = quotient(t, W4, inv_w4), w4 = t - dh * W4;
        const int dl = quotient(dh, H, inv_h), h = dh - dl * H;
        const int k = ((dl % SD) * SH + h % SH) * SW;
        const int base = k * Q + ((dl / SD) * Mh + h / SH) * Mw;
        float4 o;
        if (SW == 2) {  // outputs alternate between classes k and k + 1
            const float2 e0 = reinterpret_cast<const float2*>(staged + base)[w4];
            const float2 e1 = reinterpret_cast<const float2*>(staged + base + Q)[w4];
            o = make_float4(e0.x * f, e1.x * f, e0.y * f, e1.y * f);
        } else {
            const float4 e = reinterpret_cast<const float4*>(staged + base)[w4];
            o = make_float4(e.x * f, e.y * f, e.z * f, e.w * f);
        }
        dst[t] = o;
    }
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __trap();
#endif
}

// Pipeline C's exact rows for an output channel whose transposed-convolution weight holds a
// non-finite value (TransposedConvDefinition): one NaN where the definition has no product
// turns a whole softmax row into NaN. Block (c, j) checks the weight slice of output channel
// c and returns where it is finite, so a finite-weight call costs a few blocks' reads of
// each channel's weight. Otherwise it recomputes the rows (n, c) of the samples n = j, j +
// gridDim.y, ... from the pooled input x (element strides xn, xc, xd, xh, xw) by the
// definition plus bias[c], clamps them to [lo, hi], and rewrites out[n, c, :] (contiguous, C
// channels) with the softmax times scale[c]. Where sample_flags is given (a convolution
// algorithm that spreads a non-finite input past its products: cuDNN's FFT and Winograd
// plans), the rows of every sample it flags are recomputed too.
__global__ void softmax_rows_nonfinite_weight(
    const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
    const float* __restrict__ scale, const unsigned* __restrict__ sample_flags,
    float* __restrict__ out, index_t N, int C,
    int c_in_group, int c_out_group, int Di, int Hi, int Wi, int Do, int Ho, int Wo, int KD,
    int KH, int KW, int sd, int sh, int sw, int pd, int ph, int pw, int dd, int dh, int dw,
    index_t xn, index_t xc, index_t xd, index_t xh, index_t xw, float lo, float hi) {
    __shared__ double2 scratch[32];
    __shared__ float maxima[32];
    const TransposedConvDefinition conv{x,  w,  c_in_group, c_out_group, Di, Hi, Wi, Do, Ho,
                                        Wo, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd, dh, dw,
                                        xn, xc, xd, xh, xw};
    const int c = blockIdx.x;
    const bool finite_weight = conv.block_finite_weight(c);
    if (finite_weight && !sample_flags) return;
    const index_t length = conv.plane();
    // The reductions' barriers are uniform: the block's threads take every row alike.
    for (index_t n = blockIdx.y; n < N; n += gridDim.y) {
        if (finite_weight && !sample_flags[n]) continue;
        float* row = conv.rewrite_row(bias, out, C, n, c);
        // Each thread clamps the outputs it wrote.
        float m = -INFINITY;
        for (index_t o = threadIdx.x; o < length; o += blockDim.x) {
            const float v = clamp_nan(row[o], lo, hi);
            row[o] = v;
            m = nan_max(m, v);
        }
        // The row's maximum as the shift (a clamp may be wide): exp(v - m) <= 1, and a NaN
        // anywhere makes m, the sum and so the whole row NaN, as in PyTorch's softmax.
        m = block_max(m, maxima);
        double sum = 0.0;
        for (index_t o = threadIdx.x; o < length; o += blockDim.x)
            sum += exp((double)row[o] - m);
        const double total = block_sum(make_double2(sum, 0.0), scratch).x;
        const float factor = (float)((scale ? (double)scale[c] : 1.0) / total);
        for (index_t o = threadIdx.x; o < length; o += blockDim.x)
            row[o] = expf(row[o] - m) * factor;
    }
}
