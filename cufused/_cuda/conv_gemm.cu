// Implicit-GEMM 2-D convolution on tensor cores (mma.sync m16n8k8, TF32 inputs, float32
// accumulation), NCHW input, OIHW weight, NCHW output, groups = 1.
//
// GEMM view: rows m = (n, p, q) output pixels (M = N * P * Q), columns k = output channels
// (K = C_out), reduction r = (c, u, v) over C_in * kH * kW (the OIHW weight's inner order).
// A block computes a BM x BN = 128 x 64 tile of the output with 8 warps (4 along m, 2 along
// k), each warp 32 x 32 = 2 x 4 MMA tiles; the reduction advances BR = 16 at a time through
// shared memory: the block gathers the 128 x 16 input slice (im2col on the fly, zero padding)
// and the 16 x 64 weight slice, then each warp issues its 2 x 8 MMAs while the next slice's
// global loads are in flight (held in registers until the tiles are free).
//
// PASSES = 1 is plain TF32 (each product of 10-bit mantissas); PASSES = 3 splits each float32
// operand into a TF32 high part and a TF32 residual and sums hi*hi + hi*lo + lo*hi (the
// "3xTF32" scheme): products to about float32 accuracy at a third of the tensor rate, each
// stage's sum added to the accumulator in float32.
#include "common.cuh"

#define CONV_BM 128
#define CONV_BN 64
#define CONV_BR 16
#define CONV_THREADS 256

// Hopper's warpgroup MMA where the build targets it (sm_90a): the FixedHalo steps and
// conv_transpose3d_s2k3's TF32 steps as wgmma.mma_async m64n32k8 with A from registers and B
// from shared memory.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HALO_WGMMA 1
#else
#define HALO_WGMMA 0
#endif

// A tensor map of the tensor memory accelerator (the driver's CUtensorMap), by value.
struct alignas(64) TensorMap {
    unsigned long long words[16];
};

#if HALO_WGMMA
// The shared-memory descriptor of a K-major 8 x 32 TF32 operand without swizzle at p: core
// matrices of 8 rows x 4 values (128 bytes), the two along K 128 bytes apart (leading
// offset), those 8 rows apart 256 bytes apart (stride offset).
__device__ __forceinline__ unsigned long long wgmma_desc(const float* p) {
    const unsigned long long a = (unsigned)__cvta_generic_to_shared(p);
    return ((a & 0x3FFFF) >> 4) | (8ull << 16) | (16ull << 32);
}

#define WGMMA_D16(d)                                                                      \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]),           \
        "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])

// d += a * b for one 64 x 32 x 8 step of the warpgroup: d[j][e] is this thread's element of
// 8-column tile j in mma_tf32's accumulator order, a its A fragment (mma_tf32's order).
// Always accumulating: with scale-d false, ptxas drops some MMAs of a commit group.
__device__ __forceinline__ void wgmma_tf32(float (&d)[4][4], const unsigned (&a)[4],
                                           unsigned long long b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, 1, 1, 1;"
        : WGMMA_D16(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// Keep the compiler from moving accesses of registers that wgmma reads or writes across the
// points where the warpgroup's MMAs are fenced or waited for.
template <int N>
__device__ __forceinline__ void pin_registers(float* r) {
#pragma unroll
    for (int e = 0; e < N; ++e) asm volatile("" : "+f"(r[e])::"memory");
}

template <int N>
__device__ __forceinline__ void pin_registers(unsigned* r) {
#pragma unroll
    for (int e = 0; e < N; ++e) asm volatile("" : "+r"(r[e])::"memory");
}
#endif

// A TF32 high part with non-finite values zeroed (split_operand's plane 1).
__device__ __forceinline__ unsigned finite_part(unsigned hi) {
    return fabsf(__uint_as_float(hi)) < INFINITY ? hi : 0u;
}

// A value's operand planes: [0] its TF32 value (PASSES = 1) or high part, infinities and
// NaN included (the hi*hi product carries them); for PASSES = 3 also [1] the high part with
// non-finite values zeroed, the residual products' factor (an infinite high part times a
// finite residual of the other operand, zero or of the opposite sign, would turn an infinite
// product into NaN), and [2] the TF32 residual (none for an infinite or NaN value: inf - inf
// would be NaN). ROUNDED: the value is TF32 already (PASSES = 1 only).
template <int PASSES, bool ROUNDED = false>
__device__ __forceinline__ void split_operand(float x, unsigned& hi, unsigned& hi_finite,
                                              unsigned& lo) {
    static_assert(!ROUNDED || PASSES == 1, "a staged TF32 value has no residual left");
    hi = ROUNDED ? __float_as_uint(x) : to_tf32(x);
    if (PASSES == 3) {
        hi_finite = finite_part(hi);
        lo = to_tf32(fabsf(x) < INFINITY ? x - __uint_as_float(hi) : 0.0f);
    }
}

// split_operand<3>'s planes of a value in five to seven instructions instead of about
// thirteen, for operands that go straight to the tensor cores: the high part is the value
// truncated to TF32, which the tensor cores do themselves to the raw value (hi: the value as
// it is; a NaN quieted, so that no payload in the dropped bits alone leaves an infinity), and
// the residual, exact in float32, is truncated by them too (its lowest two of up to thirteen
// bits, 2^-22 of the value). The planes' roles are split_operand's.
__device__ __forceinline__ void split_truncated(unsigned raw, unsigned& hi, unsigned& hi_finite,
                                                unsigned& lo) {
    const float x = __uint_as_float(raw);
    const bool finite = fabsf(x) < INFINITY;
    const unsigned high = raw & 0xFFFFE000u;
    hi = finite ? raw : __float_as_uint(x + x);
    hi_finite = finite ? high : 0u;
    lo = finite ? __float_as_uint(x - __uint_as_float(high)) : 0u;
}

// One 8-deep reduction step of a warp's 32 x 32 tile from split operands (split_operand's
// planes: a[plane][i] the A fragment of 16-row MMA tile i, b[plane][j] the B fragment of
// 8-column tile j) into sum (the accumulator, or for PASSES = 3 the registers of the current
// step sums): hi*hi, lo*hi, then hi*lo. fresh (PASSES = 3): the step opens the step sums,
// which the hi*hi products overwrite.
template <int PASSES>
__device__ __forceinline__ void mma_split_step(const unsigned (&a)[3][2][4],
                                               const unsigned (&b)[3][4][2],
                                               float (&sum)[2][4][4], bool fresh = false) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (PASSES == 3 && fresh)
                mma_tf32<true>(sum[i][j], a[0][i], b[0][j]);
            else
                mma_tf32(sum[i][j], a[0][i], b[0][j]);
        }
    if (PASSES == 3) {
        // Each accumulator's next product is 8 MMAs on (its previous one's latency hidden).
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) mma_tf32(sum[i][j], a[2][i], b[1][j]);
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) mma_tf32(sum[i][j], a[1][i], b[2][j]);
    }
}

// The same step from float32 fragments, split here (ROUNDED: they hold TF32 values already).
template <int PASSES, bool ROUNDED = false>
__device__ __forceinline__ void mma_warp_step(const float (&af)[2][4], const float (&bf)[4][2],
                                              float (&sum)[2][4][4], bool fresh = false) {
    unsigned a[3][2][4], b[3][4][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            split_operand<PASSES, ROUNDED>(af[i][e], a[0][i][e], a[1][i][e], a[2][i][e]);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e)
            split_operand<PASSES, ROUNDED>(bf[j][e], b[0][j][e], b[1][j][e], b[2][j][e]);
    mma_split_step<PASSES>(a, b, sum, fresh);
}

// 3xTF32: add the step sums to the accumulator in float32 (the next step opens new ones:
// mma_split_step's fresh).
__device__ __forceinline__ void flush_step_sums(float (&acc)[2][4][4],
                                                const float (&stage)[2][4][4]) {
    float* a = &acc[0][0][0];
    const float* s = &stage[0][0][0];
#pragma unroll
    for (int e = 0; e < 32; ++e) a[e] += s[e];  // constant indices once unrolled: registers
}

// The B fragments of a warp's four 8-column MMA tiles at reduction step ks, from a [r][k]
// shared tile (weights by reduction index and output channel).
__device__ __forceinline__ void load_b_fragments(float (&bf)[4][2],
                                                 const float (*tile)[CONV_BN + 8], int ks,
                                                 int tig, int gid, int warp_k) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int k = warp_k + j * 8 + gid;
        bf[j][0] = tile[ks + tig][k];
        bf[j][1] = tile[ks + tig + 4][k];
    }
}

// The accumulators of a warp's 32 x 32 tile, cleared (3xTF32's step sums need not be: each
// step sum opens with a fresh step).
__device__ __forceinline__ void clear_tiles(float (&acc)[2][4][4]) {
    float* a = &acc[0][0][0];
#pragma unroll
    for (int e = 0; e < 32; ++e) a[e] = 0.0f;
}

// The bias of a lane's 8 output channels in a warp's 32 (k_base + 8 j + 2 tig + e), loaded
// once per block (0 past K); `any` false without a bias: nothing is added, -0.0 stays.
struct ChannelBias {
    float b[4][2];
    bool any;
};

__device__ __forceinline__ ChannelBias channel_bias(const float* __restrict__ bias, int k_base,
                                                    int tig, int K) {
    ChannelBias cb;
    cb.any = bias != nullptr;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int k = k_base + j * 8 + 2 * tig + e;
            cb.b[j][e] = cb.any && k < K ? __ldg(bias + k) : 0.0f;
        }
    return cb;
}

// Each accumulator of a warp's 32 x 32 tile (row gid or gid + 8 of MMA tile i, column
// 2 * tig + e of tile j) with its output channel k = k_base + 8 * j + 2 * tig + e below K,
// bias added: store(row in 0..31, k, value). For one column, the 8 row groups of a warp hold
// 8 consecutive rows.
template <typename Store>
__device__ __forceinline__ void each_output(const float (&acc)[2][4][4], int gid, int tig,
                                            int k_base, int K, const ChannelBias& bias,
                                            Store store) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int k = k_base + j * 8 + 2 * tig + e;
            if (k >= K) continue;
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    float v = acc[i][j][half * 2 + e];
                    if (bias.any) v += bias.b[j][e];
                    store(i * 16 + gid + half * 8, k, v);
                }
        }
}

// y[n, k, p, q] = bias[k] + sum_{c, u, v} x[n, c, p*sh - ph + u*dh, q*sw - pw + v*dw]
//                                        * w[k, c, u, v]
// Grid (ceil(M / 128), ceil(K / 64)), block 256. bias may be null.
template <int PASSES>
__global__ void __launch_bounds__(CONV_THREADS)
conv2d_igemm(const float* __restrict__ x, const float* __restrict__ w,
             const float* __restrict__ bias, float* __restrict__ y, int N, int C, int H, int W,
             int K, int kh, int kw, int P, int Q, int sh, int sw, int ph, int pw, int dh,
             int dw) {
    __shared__ float a_tile[CONV_BR][CONV_BM + 8];  // [r][m]: conflict-free fragment loads
    __shared__ float b_tile[CONV_BR][CONV_BN + 8];  // [r][k]
    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int gid = lane >> 2, tig = lane & 3;  // the MMA fragments' row group and column
    const int warp_m = (warp & 3) * 32, warp_k = (warp >> 2) * 32;
    const long long M = (long long)N * P * Q;
    const long long m0 = (long long)blockIdx.x * CONV_BM;
    const int k0 = blockIdx.y * CONV_BN;
    const int R = C * kh * kw, khw = kh * kw;

    // This thread gathers input row m0 + (tid % 128), reduction columns tid / 128 + 2 * i.
    const long long m_load = m0 + (tid & (CONV_BM - 1));
    const bool m_valid = m_load < M;
    int h_base = 0, w_base = 0;
    const float* x_sample = x;
    if (m_valid) {
        const long long pq = (long long)P * Q;
        const long long n = m_load / pq;
        const long long rest = m_load - n * pq;  // a plane may pass 2**31 positions
        const int p = (int)(rest / Q), q = (int)(rest - (long long)p * Q);
        h_base = p * sh - ph;
        w_base = q * sw - pw;
        x_sample = x + n * (long long)C * H * W;
    }
    const int r_load = tid >> 7;  // 0 or 1

    // One stage's gathers by this thread: 8 input values (rows tid % 128, reduction columns
    // tid / 128 + 2 * i) and 4 weight values (k fastest: 64 threads per reduction column).
    auto gather = [&](int r0, float (&ra)[8], float (&rb)[4]) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int r = r0 + r_load + 2 * i;
            float v = 0.0f;
            if (m_valid && r < R) {
                const int c = r / khw, uv = r - c * khw;
                const int u = uv / kw, vv = uv - u * kw;
                const int h = h_base + u * dh, ww = w_base + vv * dw;
                if (h >= 0 && h < H && ww >= 0 && ww < W)
                    v = __ldg(x_sample + ((long long)c * H + h) * W + ww);
            }
            ra[i] = v;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int idx = tid + i * CONV_THREADS;
            const int r = r0 + (idx >> 6), k = k0 + (idx & (CONV_BN - 1));
            rb[i] = (r < R && k < K) ? __ldg(w + (long long)k * R + r) : 0.0f;
        }
    };

    // 3xTF32 sums each stage's products in registers of their own and adds the stage's sum to
    // the accumulator in float32 (round to nearest): the tensor cores' accumulation truncates,
    // and over the whole reduction its bias would cost several times float32's error.
    float acc[2][4][4], stage[2][4][4];
    clear_tiles(acc);
    float (&sum)[2][4][4] = PASSES == 3 ? stage : acc;  // where the MMAs accumulate

    float ra[8], rb[4];
    gather(0, ra, rb);
    for (int r0 = 0; r0 < R; r0 += CONV_BR) {
#pragma unroll
        for (int i = 0; i < 8; ++i) a_tile[r_load + 2 * i][tid & (CONV_BM - 1)] = ra[i];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int idx = tid + i * CONV_THREADS;
            b_tile[idx >> 6][idx & (CONV_BN - 1)] = rb[i];
        }
        __syncthreads();
        // The next stage's loads are in flight while this stage's MMAs run.
        if (r0 + CONV_BR < R) gather(r0 + CONV_BR, ra, rb);
#pragma unroll
        for (int ks = 0; ks < CONV_BR; ks += 8) {
            float af[2][4], bf[4][2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int m = warp_m + i * 16 + gid;
                af[i][0] = a_tile[ks + tig][m];
                af[i][1] = a_tile[ks + tig][m + 8];
                af[i][2] = a_tile[ks + tig + 4][m];
                af[i][3] = a_tile[ks + tig + 4][m + 8];
            }
            load_b_fragments(bf, b_tile, ks, tig, gid, warp_k);
            mma_warp_step<PASSES>(af, bf, sum, ks == 0);
        }
        if (PASSES == 3) flush_step_sums(acc, stage);
        __syncthreads();  // the next stage overwrites the tiles
    }

    // Row m of the GEMM is pixel (n, p, q) of the output.
    const long long pq = (long long)P * Q;
    each_output(acc, gid, tig, k0 + warp_k, K, channel_bias(bias, k0 + warp_k, tig, K),
                [&](int row, int k, float v) {
        const long long m = m0 + warp_m + row;
        if (m >= M) return;
        const long long n = m / pq;
        y[(n * K + k) * pq + (m - n * pq)] = v;
    });
}

// The same convolution for inputs whose patches overlap (small C_in: pipeline A's 8 channels,
// where conv2d_igemm gathers each input value up to kh * kw times through global memory):
// a block stages an input halo once per chunk of input channels and reads the MMA fragments
// from it.
//
// A tile is HALO_TH x HALO_TW = 4 x 32 output pixels of one sample x 64 output channels.
// Warp w computes columns 8 * (w % 4) .. + 7 of all 4 rows for 32 channels (w / 4): MMA tile
// i's fragment row gid + 8 * half is pixel (row 2 * i + half, column gid), so a lane holds
// one column's 4 rows and a 4 x 4 pooling window lies in 4 neighbouring lanes. The
// reduction runs over chunks of cc input channels: the block stages their halo (cc x hr x hc
// values, hr = 3 * sh + (kh - 1) * dh + 1, hc = 31 * sw + (kw - 1) * dw + 1,
// zeros outside the input), their weights (the chunk's cc * kh * kw reduction values x 64
// channels, zero past K, rounded up to a multiple of 8 with zero weights) and each reduction
// value's offset in the halo (-1 for the rounding: those fragment values are 0, not a halo
// value, which may be infinite). A fragment value is then one shared load at the pixel's
// offset plus the reduction value's. With one chunk (C * kh * kw <= HALO_RC) the weights are
// staged once per block; blocks loop over tiles (a schedule: TileGroups over N * tiles, or
// SampleSegments), the next stage's halo copied (cp.async) while this one's MMAs run.
//
// Grid (blocks, ceil(K / 64)), block 256, dynamic shared memory as halo_shared lays it out.
// bias may be null. cc * hr * hc <= HALO_MAX and cc * kh * kw <= HALO_RC (the launcher's
// choice of cc).
#define HALO_TH 4
#define HALO_TW 32
#define HALO_RC 72
#define HALO_MAX 4800
#define HALO_BLOCKS_PER_SM 2

// A halo kernel's output tile: HALO_TH x TW pixels x BN output channels, its 8 warps TW / 8
// along the columns (8 columns each) by BN / 32 along the channels (32 each).
template <int TW, int BN>
struct HaloTile {
    static constexpr int W = TW, N = BN, COL_WARPS = TW / 8;
    static_assert(COL_WARPS * (BN / 32) == CONV_THREADS / 32, "8 columns x 32 channels a warp");
    // Warp w's first column and first output channel in the tile.
    static __device__ __forceinline__ int warp_col(int w) { return (w & (COL_WARPS - 1)) * 8; }
    static __device__ __forceinline__ int warp_k(int w) {
        return (int)((unsigned)w / COL_WARPS) * 32;
    }
};
using NarrowTile = HaloTile<HALO_TW, CONV_BN>;  // conv2d_halo, conv2d_halo_pool_stats
using BandTile = HaloTile<2 * HALO_TW, CONV_BN / 2>;  // conv2d_halo_bands

// The blocks a multiprocessor that a halo kernel's launch bounds promise: two (128 registers a
// thread) in TF32, and in 3xTF32 where the wgmma build compiles the geometry in and the
// epilogue stages no output tile (UNSTAGED: it pools, or stores straight from the
// accumulators; halo_tiles' residuals-first sum; a staged output tile does not fit twice);
// else one. The launcher's grid is sm_count x HALO_BLOCKS_PER_SM either way (blocks past
// those resident wait).
template <int PASSES, int KSIZE, bool UNSTAGED>
__host__ __device__ constexpr int halo_blocks_per_sm() {
    return PASSES == 1 || (HALO_WGMMA && KSIZE > 0 && UNSTAGED) ? HALO_BLOCKS_PER_SM : 1;
}

// V consecutive floats as one access (8- or 16-byte aligned for V = 2, 4).
template <int V> struct FloatVec;
template <> struct FloatVec<1> { using type = float; };
template <> struct FloatVec<2> { using type = float2; };
template <> struct FloatVec<4> { using type = float4; };

// Split the V staged float32 values at v (plane 0) into PLANES planes, plane_stride floats
// apart: PASSES = 1, TF32-rounded in place; PLANES = 2, the high part and the residual
// (split_operand's [0] and [2]: its [1] follows from [0]); PLANES = 3, all three.
template <int PASSES, int PLANES, int V>
__device__ __forceinline__ void split_staged(float* v, int plane_stride) {
    using Vec = typename FloatVec<V>::type;
    Vec in = *reinterpret_cast<const Vec*>(v), out[PLANES];
    const float* x = reinterpret_cast<const float*>(&in);
#pragma unroll
    for (int e = 0; e < V; ++e) {
        unsigned p[3];
        split_operand<PASSES>(x[e], p[0], p[1], p[2]);
#pragma unroll
        for (int q = 0; q < PLANES; ++q)
            reinterpret_cast<float*>(&out[q])[e] = __uint_as_float(p[PLANES == 2 ? 2 * q : q]);
    }
#pragma unroll
    for (int q = 0; q < PLANES; ++q) *reinterpret_cast<Vec*>(v + q * plane_stride) = out[q];
}

// One cp.async of V floats (1 or 4: 16-byte aligned dst and src) into shared memory,
// zero-filled where the source is not valid (padding or past the input: no global byte is
// read, src only has to be a global address).
template <int V>
__device__ __forceinline__ void copy_or_zero_async(float* dst, const float* src, bool valid) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    if constexpr (V == 4)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                     ::"r"(d), "l"(src), "r"(valid ? 16 : 0) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
                     ::"r"(d), "l"(src), "r"(valid ? 4 : 0) : "memory");
}

// The planes that a halo kernel stages its halo in (split_staged): one (float32 values,
// TF32-rounded for PASSES = 1) but where the geometry is compiled in (KSIZE > 0) at PASSES =
// 3: two (high part, residual), so that each value is split once where staged, not at every
// fragment that reads it; the finite high parts are formed from the registers.
template <int PASSES, int KSIZE>
__host__ __device__ constexpr int halo_planes() {
    return PASSES == 3 && KSIZE > 0 ? 2 : 1;
}

// The planes of the staged weights: three where the halo has two (all of split_operand's:
// wgmma reads them from shared memory, and a tap's B fragments are loaded, not formed).
template <int PASSES, int KSIZE>
__host__ __device__ constexpr int weight_planes() {
    return halo_planes<PASSES, KSIZE>() == 2 ? 3 : 1;
}

// Floats of one plane of the staged weights.
#define HALO_WPLANE (HALO_RC * (CONV_BN + 8))

// The dynamic shared memory of a halo kernel, in this order: the staged weights'
// weight_planes planes [plane][r][k] (HALO_RC x (CONV_BN + 8) a plane: conflict-free
// fragment loads; FixedHalo lays them out per lane or per wgmma operand instead,
// stage_weights), each reduction value's halo offset (HALO_RC), then two halo buffers of
// halo_planes planes of hsize floats (the stage the MMAs read and the next one in flight);
// an epilogue's scratch follows (halo_scratch). The launcher sizes it (conv_gemm.py:
// halo_shared_bytes).
struct HaloShared {
    float (*wt)[CONV_BN + 8];
    int* roff;
    float* halo;  // buffer b at halo + b * halo_planes * hsize, its plane p hsize * p on
    int hsize;
};

template <int PASSES, int KSIZE>
__device__ __forceinline__ HaloShared halo_shared(float* smem, int hsize) {
    constexpr int WPLANES = weight_planes<PASSES, KSIZE>();
    return {reinterpret_cast<float (*)[CONV_BN + 8]>(smem),
            reinterpret_cast<int*>(smem + WPLANES * HALO_WPLANE),
            smem + WPLANES * HALO_WPLANE + HALO_RC, hsize};
}

// The scratch starts 16-byte aligned (float4 loads there; hsize may be odd).
template <int PASSES, int KSIZE>
__device__ __forceinline__ float* halo_scratch(float* smem, int hsize) {
    return smem + ((weight_planes<PASSES, KSIZE>() * HALO_WPLANE + HALO_RC
                    + 2 * halo_planes<PASSES, KSIZE>() * hsize + 3) & ~3);
}

// The halo geometry compiled in for KSIZE x KSIZE kernels at stride and dilation 1 (pipeline
// A's 3 x 3): chunks of 8 input channels, their reduction values in (u, v, c) order, so that
// each 8-deep MMA step is one kernel tap (u, v) over the chunk's 8 channels and a lane's
// fragment value sits at a base of its own (channel tig or tig + 4, its pixel) plus the
// tap's offset: no offset table (halo_tiles loads a lane's column of the halo once per
// kernel column and takes each tap's fragments from it). A halo row takes
// HCS floats, its HC rounded up to 4 (16-byte rows, copied 4 floats at a time where the
// input's rows allow it); channel c of the halo starts at c * CSTRIDE, a stride of 8 mod 32
// floats: the four tig lanes' channels fall on distinct banks.
template <int KSIZE, int TW = HALO_TW>
struct FixedHalo {
    static constexpr int CC = 8;
    static constexpr int TAPS = KSIZE * KSIZE;
    static constexpr int HR = HALO_TH + KSIZE - 1, HC = TW + KSIZE - 1;
    static constexpr int HCS = (HC + 3) / 4 * 4;
    static constexpr int CSTRIDE = (HR * HCS + 23) / 32 * 32 + 8;
    static_assert(TAPS * CONV_BN * CC <= HALO_RC * (CONV_BN + 8), "the weights fit");
};

// Floats of one halo buffer (conv_gemm.py: halo_channel_stride).
template <int KSIZE, int TW = HALO_TW>
__device__ __forceinline__ int halo_floats(int cc, int hr, int hc) {
    if constexpr (KSIZE > 0)
        return FixedHalo<KSIZE, TW>::CC * FixedHalo<KSIZE, TW>::CSTRIDE;
    return cc * hr * hc;
}

// A compile-time constant as a value, for a generic lambda's instantiations.
template <int V>
struct Flag {
    static constexpr int value = V;
};

// Where a tile lies: sample n, its index t within the sample (row-major over tile rows tr
// and columns tc of tiles_w), its run (the index within the sample of its schedule's run of
// consecutive tiles) and end (one past the run's last t).
struct TilePos {
    int n, t, tr, tc, run, end;
};

// The order in which a block visits its tiles: first(pos) and next(pos) set pos to the
// block's first and next tile, false past the last; next steps without a division within a
// run.
//
// TileGroups<SPAN>: the tiles (4 x 32 pixels of P x Q a sample, N samples) in groups of
// SPAN (1 or 2) neighbours along a tile row (tc = SPAN * j .. SPAN * j + SPAN - 1; a row's
// last group shorter where SPAN does not divide the row's tiles), groups blockIdx.x, +
// gridDim.x, ... of all N * groups, a block taking the tiles of its group one after the
// other, each tile its own run. It keeps the kernel's arguments only (constant memory, no
// registers through the MMAs) and derives the rest where it steps to a new group.
template <int SPAN>
struct TileGroups {
    int N, P, Q;
    __device__ int tiles_w() const { return (Q + HALO_TW - 1) / HALO_TW; }
    __device__ int groups_w() const { return (tiles_w() + SPAN - 1) / SPAN; }
    __device__ bool at(long long index, TilePos& pos) const {
        const int per_row = groups_w();
        const int groups = ((P + HALO_TH - 1) / HALO_TH) * per_row;
        if (index >= (long long)N * groups) return false;
        pos.n = (int)(index / groups);
        const int group = (int)(index - (long long)pos.n * groups);
        pos.tr = group / per_row;
        pos.tc = SPAN * (group - pos.tr * per_row);
        pos.t = pos.tr * tiles_w() + pos.tc;
        pos.run = 0;
        pos.end = pos.t + 1;
        return true;
    }
    __device__ bool first(TilePos& pos) const { return at(blockIdx.x, pos); }
    __device__ bool next(TilePos& pos) const {
        if ((pos.tc + 1) % SPAN != 0 && (pos.tc + 1) * HALO_TW < Q) {
            ++pos.tc;
            pos.end = ++pos.t + 1;
            return true;
        }
        const long long group = ((long long)pos.n * ((P + HALO_TH - 1) / HALO_TH) + pos.tr)
                                * groups_w() + pos.tc / SPAN;
        return at(group + gridDim.x, pos);
    }
};

// BandTiles: the bands of 4 output rows (sample n, tile row tr) of conv2d_halo_bands, bands
// blockIdx.x, + gridDim.x, ... of all N * ceil(P / 4), a block taking each band's tiles of
// BandTile::W columns last first (tc = ceil(Q / W) - 1 .. 0), each tile its own run.
struct BandTiles {
    int N, P, Q;
    __device__ int last() const { return (Q - 1) / BandTile::W; }
    __device__ bool at(long long index, TilePos& pos) const {
        const int rows = (P + HALO_TH - 1) / HALO_TH;
        if (index >= (long long)N * rows) return false;
        pos.n = (int)(index / rows);
        pos.tr = (int)(index - (long long)pos.n * rows);
        pos.tc = last();
        pos.t = pos.tr * (last() + 1) + pos.tc;
        pos.run = 0;
        pos.end = pos.t + 1;
        return true;
    }
    __device__ bool first(TilePos& pos) const { return at(blockIdx.x, pos); }
    __device__ bool next(TilePos& pos) const {
        if (pos.tc > 0) {
            --pos.tc;
            pos.end = pos.t--;
            return true;
        }
        return at((long long)pos.n * ((P + HALO_TH - 1) / HALO_TH) + pos.tr + gridDim.x, pos);
    }
};

// SampleSegments: each sample's tiles cut into `splits` runs of consecutive tiles (run s:
// tiles [s * tiles / splits, (s + 1) * tiles / splits), none empty: splits <= tiles); the
// block takes runs blockIdx.x, + gridDim.x, ... of the N * splits (index n * splits + s),
// each from its first tile to its last, so that an epilogue can sum over a run and reduce
// once.
struct SampleSegments {
    int tiles, tiles_w, splits;
    long long runs;
    __device__ int begin(int s) const { return (int)((long long)s * tiles / splits); }
    __device__ bool open(long long index, TilePos& pos) const {
        if (index >= runs) return false;
        pos.n = (int)(index / splits);
        pos.run = (int)(index - (long long)pos.n * splits);
        pos.t = begin(pos.run);
        pos.end = begin(pos.run + 1);
        pos.tr = pos.t / tiles_w;
        pos.tc = pos.t - pos.tr * tiles_w;
        return true;
    }
    __device__ bool first(TilePos& pos) const { return open(blockIdx.x, pos); }
    __device__ bool next(TilePos& pos) const {
        if (pos.t + 1 == pos.end)
            return open((long long)pos.n * splits + pos.run + gridDim.x, pos);
        ++pos.t;
        if (++pos.tc == tiles_w) {
            pos.tc = 0;
            ++pos.tr;
        }
        return true;
    }
};

// The tiles of a conv2d_halo-style kernel: each block visits its tiles in the order of
// `schedule` (TileGroups, SampleSegments, BandTiles), computes a tile's HALO_TH x Tile::W
// pixels x Tile::N channels (NarrowTile: 4 x 32 x 64, or BandTile's 4 x 64 x 32 for the
// wgmma build's TF32 3 x 3 kernels) into acc and calls epilogue(pos, acc) (TilePos; the
// tile's first pixel is row pos.tr * HALO_TH, column pos.tc * Tile::W); every thread calls it
// (it may hold barriers; between two calls every thread passes at least one barrier here).
// The stages (tile, chunk of input channels) run as a two-buffer pipeline: a stage's halo is
// copied with cp.async while the previous stage's MMAs run, so the block waits on global
// memory only where one stage's copies take longer than another's MMAs and epilogue.
// KSIZE = 0 takes the geometry from the arguments; KSIZE > 0 compiles it in (FixedHalo:
// the launcher passes cc, hr, hc = 8, HR, HC, and stride and dilation 1). BLOCKS: the
// kernel's halo_blocks_per_sm.
// The weights of output channel k are staged times sign(k) (+1 or -1), so acc holds
// sign(k) times the convolution without its bias.
template <int PASSES, int KSIZE, int BLOCKS, class Tile = NarrowTile, class Schedule,
          class Epilogue, class Sign>
__device__ __forceinline__ void halo_tiles(const float* __restrict__ x,
                                           const float* __restrict__ w, int C, int H, int W,
                                           int K, int kh, int kw, int P, int Q, int sh, int sw,
                                           int ph, int pw, int dh, int dw, int cc, int hr,
                                           int hc, const HaloShared& s,
                                           const Schedule& schedule, Epilogue epilogue,
                                           Sign sign) {
    constexpr bool FIXED = KSIZE > 0;
    constexpr int PLANES = halo_planes<PASSES, KSIZE>();
    constexpr int WPLANES = weight_planes<PASSES, KSIZE>();
    using Fixed = FixedHalo<FIXED ? KSIZE : 1, Tile::W>;
    static_assert((Tile::W == HALO_TW && Tile::N == CONV_BN)
                      || (FIXED && PASSES == 1 && HALO_WGMMA),
                  "other tiles: the wgmma build's TF32 steps over a compiled-in geometry");
    if constexpr (FIXED) {
        kh = kw = KSIZE;
        sh = sw = 1;  // (dilation: the generic path only)
        cc = Fixed::CC;
        hr = Fixed::HR;
        hc = Fixed::HC;
    }
    const int rstride = FIXED ? Fixed::HCS : hc;            // between a halo's rows
    const int cstride = FIXED ? Fixed::CSTRIDE : hr * hc;  // between a halo's channels
    // The halo copied 4 floats at a time: every 4 columns of a halo row are inside the input
    // or outside together (w0 = 32 * tc - pw and W multiples of 4, stride 1).
    const bool by_four = FIXED && (W & 3) == 0 && (pw & 3) == 0
                         && (reinterpret_cast<unsigned long long>(x) & 15) == 0;
    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int warp_col = Tile::warp_col(warp), warp_k = Tile::warp_k(warp);
    const int k0 = blockIdx.y * Tile::N;
    const int khw = kh * kw;
    const bool one_chunk = C <= cc;
    // KSIZE = 0: this lane's fragment rows (gid, gid + 8 of MMA tile i: pixel row 2 * i +
    // half, column warp_col + gid) as offsets into a channel's halo.
    int pofs[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int half = 0; half < 2; ++half)
            pofs[i][half] = (2 * i + half) * sh * rstride + (warp_col + gid) * sw;

    // The weights of input channels [c0, c0 + cc) times sign(k) (zero past C and K;
    // TF32-rounded for PASSES = 1, split into their PLANES planes: exact for either sign, the
    // rounding is symmetric) in the reduction order, and for KSIZE = 0 their halo offsets;
    // returns the reduction length rounded up to 8.
    auto stage_weights = [&](int c0) {
        const int ccn = FIXED ? Fixed::CC : min(cc, C - c0);
        const int rn = ccn * khw, rpad = (rn + 7) & ~7;
        auto staged = [&](float v, int k) {
            v *= sign(k);
            return PASSES == 1 ? __uint_as_float(to_tf32(v)) : v;
        };
        if constexpr (FIXED) {
            // wgmma: per tap and 32 channels (warp_k / 32) an 8 x 32 K-major operand
            // (wgmma_desc), [tap][warp_k / 32][8-column tile][half][column][c % 4], the value
            // of output channel k0 + warp_k + 8 tile + column and input channel c0 + 4 half +
            // c % 4. mma.sync: each lane's B fragments of a tap, all four 8-column tiles j, as
            // 8 consecutive floats (two 16-byte loads), [tap][warp_k / 32][lane][j][half], the
            // value of output channel k0 + warp_k + 8 j + gid and input channel c0 + tig + 4
            // half.
            float* wt = &s.wt[0][0];
            for (int i = tid; i < Fixed::TAPS * Tile::N * Fixed::CC; i += CONV_THREADS) {
                const int tap = (int)((unsigned)i / (Tile::N * Fixed::CC));
                const int wk = (i >> 8) & (Tile::N / 32 - 1);
                const int k = HALO_WGMMA ? k0 + wk * 32 + ((i >> 6) & 3) * 8 + ((i >> 2) & 7)
                                         : k0 + wk * 32 + ((i >> 1) & 3) * 8 + ((i >> 5) & 7);
                const int c = HALO_WGMMA ? c0 + (i & 3) + 4 * ((i >> 5) & 1)
                                         : c0 + ((i >> 3) & 3) + 4 * (i & 1);
                wt[i] = k < K && c < C ? __ldg(w + ((long long)k * C + c) * khw + tap) * sign(k)
                                       : 0.0f;
                split_staged<PASSES, WPLANES, 1>(wt + i, HALO_WPLANE);
            }
#if HALO_WGMMA
            // wgmma reads the weights through the async proxy.
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
        } else {
            for (int i = tid; i < rpad * CONV_BN; i += CONV_THREADS) {
                const int kk = i / rpad, r = i - kk * rpad;  // r fastest: coalesced
                const int k = k0 + kk;
                const int c = r / khw, uv = r - c * khw;
                s.wt[r][kk] = (r < rn && k < K && c0 + c < C)
                    ? staged(__ldg(w + ((long long)k * C + c0 + c) * khw + uv), k) : 0.0f;
            }
            for (int r = tid; r < rpad; r += CONV_THREADS) {
                int off = -1;
                if (r < rn) {
                    const int c = r / khw, uv = r - c * khw;
                    const int u = uv / kw, v = uv - u * kw;
                    off = c * cstride + u * dh * hc + v * dw;
                }
                s.roff[r] = off;
            }
        }
        return rpad;
    };

    // f(c, hrow, col, index) for each run of V halo values (V = 4: by_four) of a chunk
    // starting at c0 that this thread copies: V = 1, a warp per halo row, lanes along it;
    // V = 4, the runs in order, a thread each. FIXED copies all 8 channels (zeros past C: the
    // last chunk's MMAs read them all).
    auto each_own_run = [&](auto v, int c0, auto f) {
        constexpr int V = decltype(v)::value;
        const int rows = (FIXED ? Fixed::CC : min(cc, C - c0)) * hr;
        if constexpr (V == 4) {
            // A compile-time trip count: unrolled, no loop control per tile.
            constexpr int RUNS = Fixed::HCS / 4;  // per halo row
            constexpr int TOTAL = Fixed::CC * Fixed::HR * RUNS;
#pragma unroll
            for (int turn = 0; turn < (TOTAL + CONV_THREADS - 1) / CONV_THREADS; ++turn) {
                const int i = tid + turn * CONV_THREADS;
                if (TOTAL % CONV_THREADS != 0 && i >= TOTAL) break;
                const int row = i / RUNS, col = 4 * (i - row * RUNS);
                const int c = row / Fixed::HR, hrow = row - c * Fixed::HR;
                f(c, hrow, col, c * cstride + hrow * rstride + col);
            }
        } else {
            for (int row = warp; row < rows; row += CONV_THREADS / 32) {
                const int c = row / hr, hrow = row - c * hr;
                for (int col = lane; col < hc; col += 32)
                    f(c, hrow, col, c * cstride + hrow * rstride + col);
            }
        }
    };

    // f(Flag<V>) with the run length this kernel copies and rounds the halo in.
    auto with_run_length = [&](auto f) {
        if (by_four)
            f(Flag<FIXED ? 4 : 1>{});
        else
            f(Flag<1>{});
    };

    // Start the copies of the halo of the chunk at c0 of the tile at pos into buf (coalesced
    // along W, zeros outside the input), V floats a copy.
    auto copy_halo_by = [&](auto v, const TilePos& pos, int c0, float* buf) {
        constexpr int V = decltype(v)::value;
        const int h0 = pos.tr * HALO_TH * sh - ph, w0 = pos.tc * Tile::W * sw - pw;
        const float* xs = x + (long long)pos.n * C * H * W;
        each_own_run(v, c0, [&](int c, int hrow, int col, int index) {
            const int h = h0 + hrow, ww = w0 + col;
            const bool valid = c0 + c < C && h >= 0 && h < H && ww >= 0 && ww + V <= W;
            copy_or_zero_async<V>(buf + index,
                                  valid ? xs + ((long long)(c0 + c) * H + h) * W + ww : xs,
                                  valid);
        });
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    auto copy_halo = [&](const TilePos& pos, int c0, float* buf) {
        with_run_length([&](auto v) { copy_halo_by(v, pos, c0, buf); });
    };

    TilePos pos;
    if (!schedule.first(pos)) return;
    int rpad = 0;
    if (one_chunk) rpad = stage_weights(0);  // published by the first stage's barrier
    copy_halo(pos, 0, s.halo);
    int buf = 0;
    for (bool more = true; more; more = schedule.next(pos)) {

        float acc[2][4][4], stage[2][4][4];
        clear_tiles(acc);
        float (&sum)[2][4][4] = PASSES == 3 ? stage : acc;

        for (int c0 = 0; c0 < C; c0 += cc) {
            float* halo = s.halo + buf * PLANES * s.hsize;
            asm volatile("cp.async.wait_all;" ::: "memory");
            if (PASSES == 1 || PLANES > 1) {
                // Round (TF32) or split (3xTF32) each of this thread's own copies once, not
                // once per fragment that reads it (up to kh * kw * 2 of them).
                with_run_length([&](auto v) {
                    each_own_run(v, c0, [&](int, int, int, int index) {
                        split_staged<PASSES, PLANES, decltype(v)::value>(halo + index, s.hsize);
                    });
                });
            }
            // This stage's halo is in; every warp is done with the previous stage's buffers.
            __syncthreads();
            if (!one_chunk) rpad = stage_weights(c0);
            if (c0 + cc < C) {
                copy_halo(pos, c0 + cc, s.halo + (buf ^ 1) * PLANES * s.hsize);
            } else {
                // The next tile's position, again after the epilogue (fewer live registers
                // through the MMAs than keeping it).
                TilePos next = pos;
                if (schedule.next(next))
                    copy_halo(next, 0, s.halo + (buf ^ 1) * PLANES * s.hsize);
            }
            if (!one_chunk) __syncthreads();
            if constexpr (FIXED) {
                // Kernel column v at a time: this lane's halo column (its pixel column + v)
                // over the HALO_TH + KSIZE - 1 halo rows, channels tig and tig + 4, each
                // staged plane, loaded once (load_column); kernel row u's A fragments are its
                // rows u .. u + HALO_TH - 1, so each halo value is loaded once per v, not once
                // per tap. Operand plane 2 q is staged plane q; plane 1 (3xTF32's finite high
                // parts) is formed from plane 0 here. The mma.sync build's v loop is not
                // unrolled: every tap unrolled hoists its loads past the register budget.
                constexpr int HPLANE = Fixed::CC * Fixed::CSTRIDE;  // == s.hsize
                const float* lane_base = halo + tig * Fixed::CSTRIDE + warp_col + gid;
                auto load_plane = [&](int v, int q, unsigned (&plane)[Fixed::HR][2]) {
#pragma unroll
                    for (int h = 0; h < Fixed::HR; ++h) {
                        const float* at = lane_base + v + q * HPLANE + h * Fixed::HCS;
                        plane[h][0] = __float_as_uint(at[0]);
                        plane[h][1] = __float_as_uint(at[4 * Fixed::CSTRIDE]);
                    }
                };
                auto load_column = [&](int v, unsigned (&column)[3][Fixed::HR][2]) {
#pragma unroll
                    for (int q = 0; q < PLANES; ++q) load_plane(v, q, column[2 * q]);
                    if (PASSES == 3) {
#pragma unroll
                        for (int h = 0; h < Fixed::HR; ++h) {
                            column[1][h][0] = finite_part(column[0][h][0]);
                            column[1][h][1] = finite_part(column[0][h][1]);
                        }
                    }
                };
                // Kernel row u's A fragment of MMA tile i (half: pixel row 2 i + half) from
                // one operand plane of a column.
                auto fragment = [&](const unsigned (&plane)[Fixed::HR][2], int u, int i,
                                    unsigned (&a)[4]) {
                    a[0] = plane[2 * i + u][0];
                    a[1] = plane[2 * i + 1 + u][0];
                    a[2] = plane[2 * i + u][1];
                    a[3] = plane[2 * i + 1 + u][1];
                };
#if HALO_WGMMA
                // The warpgroup's 64 x 32 steps, MMA tile i of each of its 4 warps: wgmma's
                // A fragment and accumulator layouts are mma_tf32's per warp. A's registers
                // and acc stay untouched from a group's fence until its wait.
                // warp_k / 32 (the warpgroup's channels), shuffled from lane 0 so that the
                // compiler sees it uniform over the warp: the descriptors built from it stay in
                // uniform registers (no move into them per wgmma).
                const int kgroup = __shfl_sync(0xffffffffu, warp_k >> 5, 0);
                // Each step's descriptor is this one plus its operand's offset in 16-byte
                // units, a constant: one add a step, not the address arithmetic. Every operand
                // lies in the shared window (under 228 KB), so the address field's sum stays
                // below 2^14 and carries into no other field.
                const unsigned long long desc0 = wgmma_desc(&s.wt[0][0] + kgroup * 256);
                // Kernel column v's steps, A from operand plane `plane`, B from the weights'
                // plane wq, into acc.
                auto column_steps = [&](const unsigned (&plane)[Fixed::HR][2], int v, int wq) {
#pragma unroll
                    for (int u = 0; u < KSIZE; ++u) {
                        const int tap_b = wq * HALO_WPLANE + (u * KSIZE + v) * Tile::N * 8;
#pragma unroll
                        for (int i = 0; i < 2; ++i) {
                            unsigned a[4];
                            fragment(plane, u, i, a);
                            wgmma_tf32(acc[i], a, desc0 + tap_b * 4 / 16);
                        }
                    }
                };
                // One commit group: steps() issues its wgmma, whose N A registers at r are
                // pinned with acc at the fence and at the wait; meanwhile() runs before the
                // wait.
                auto mma_group = [&](auto n, unsigned* r, auto steps, auto meanwhile) {
                    constexpr int N = decltype(n)::value;
                    pin_registers<32>(&acc[0][0][0]);
                    pin_registers<N>(r);
                    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
                    steps();
                    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
                    meanwhile();
                    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
                    pin_registers<32>(&acc[0][0][0]);
                    pin_registers<N>(r);
                };
                // A column's halo values load while the previous column's steps run, into the
                // other register set (TF32, and 3xTF32's residual products at one block a
                // multiprocessor: at two, a thread's 128 registers hold one set).
                constexpr bool EARLY = PASSES == 1 || BLOCKS == 1;
                unsigned columns[2][3][Fixed::HR][2];
                auto load_next = [&](int v, auto n, int q0) {
                    constexpr int N = decltype(n)::value;
                    if (EARLY && v + 1 < KSIZE) {
                        load_column(v + 1, columns[(v + 1) & 1]);
                        pin_registers<N>(&columns[(v + 1) & 1][q0][0][0]);
                    }
                };
                if (EARLY) load_column(0, columns[0]);
                if constexpr (PASSES == 3) {
                    // One chunk of input channels (fixed_ksize in conv_gemm.py sends the wgmma
                    // build's 3xTF32 problems of more to KSIZE = 0). Every column's residual
                    // products (lo * hi, hi * lo) go first, then the high ones, all into acc.
                    // The tensor cores truncate each step's sum to float32: while acc holds
                    // only residual products (~2^-11 of the result) that loses nothing, and
                    // the high products, summed last, are truncated once per tap. No step
                    // sums, and one column's residual fragments at a time: two blocks a
                    // multiprocessor (conv2d_halo_pool_stats' launch bounds), one's MMAs
                    // running while the other waits. The high parts load after the previous
                    // group's wait.
                    constexpr int RESIDUAL = 2 * Fixed::HR * 2;  // planes 1 and 2 of a column
#pragma unroll
                    for (int v = 0; v < KSIZE; ++v) {
                        unsigned (&column)[3][Fixed::HR][2] = columns[EARLY ? v & 1 : 0];
                        if (!EARLY) load_column(v, column);
                        mma_group(
                            Flag<RESIDUAL>{}, &column[1][0][0],
                            [&] {
                                column_steps(column[2], v, 1);
                                column_steps(column[1], v, 2);
                            },
                            [&] { load_next(v, Flag<RESIDUAL>{}, 1); });
                    }
#pragma unroll
                    for (int v = 0; v < KSIZE; ++v) {
                        unsigned high[Fixed::HR][2];
                        load_plane(v, 0, high);
                        mma_group(Flag<Fixed::HR * 2>{}, &high[0][0],
                                  [&] { column_steps(high, v, 0); }, [] {});
                    }
                } else {
#pragma unroll
                    for (int v = 0; v < KSIZE; ++v) {
                        unsigned (&column)[3][Fixed::HR][2] = columns[v & 1];
                        mma_group(Flag<Fixed::HR * 2>{}, &column[0][0][0],
                                  [&] { column_steps(column[0], v, 0); },
                                  [&] { load_next(v, Flag<Fixed::HR * 2>{}, 0); });
                    }
                }
#else
                auto fragments = [&](const unsigned (&column)[3][Fixed::HR][2], int u,
                                     unsigned (&a)[3][2][4]) {
#pragma unroll
                    for (int q = 0; q < 2 * PLANES - 1; ++q)
#pragma unroll
                        for (int i = 0; i < 2; ++i) fragment(column[q], u, i, a[q][i]);
                };
                const float4* b4 = reinterpret_cast<const float4*>(&s.wt[0][0])
                                   + ((warp_k >> 5) * 32 + lane) * 2;
#pragma unroll 1
                for (int v = 0; v < KSIZE; ++v) {
                    unsigned column[3][Fixed::HR][2];
                    load_column(v, column);
#pragma unroll
                    for (int u = 0; u < KSIZE; ++u) {
                        unsigned a[3][2][4], b[3][4][2];
                        fragments(column, u, a);
                        // Tap u * KSIZE + v's B fragments ([plane][tap][warp_k / 32][lane][j]
                        // [half]).
                        const float4* tap_b4 = b4 + (u * KSIZE + v) * 2 * 32 * 2;
#pragma unroll
                        for (int q = 0; q < WPLANES; ++q) {
                            const float4 b01 = tap_b4[q * HALO_WPLANE / 4];
                            const float4 b23 = tap_b4[q * HALO_WPLANE / 4 + 1];
                            b[q][0][0] = __float_as_uint(b01.x);
                            b[q][0][1] = __float_as_uint(b01.y);
                            b[q][1][0] = __float_as_uint(b01.z);
                            b[q][1][1] = __float_as_uint(b01.w);
                            b[q][2][0] = __float_as_uint(b23.x);
                            b[q][2][1] = __float_as_uint(b23.y);
                            b[q][3][0] = __float_as_uint(b23.z);
                            b[q][3][1] = __float_as_uint(b23.w);
                        }
                        mma_split_step<PASSES>(a, b, sum, (u & 1) == 0);
                        // 3xTF32: step sums flushed every two steps and at v's last.
                        if (PASSES == 3 && ((u & 1) || u + 1 == KSIZE))
                            flush_step_sums(acc, stage);
                    }
                }
#endif
            } else {
                for (int ks = 0; ks < rpad; ks += 8) {
                    const int o0 = s.roff[ks + tig], o1 = s.roff[ks + tig + 4];
                    float af[2][4], bf[4][2];
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        af[i][0] = o0 >= 0 ? halo[pofs[i][0] + o0] : 0.0f;
                        af[i][1] = o0 >= 0 ? halo[pofs[i][1] + o0] : 0.0f;
                        af[i][2] = o1 >= 0 ? halo[pofs[i][0] + o1] : 0.0f;
                        af[i][3] = o1 >= 0 ? halo[pofs[i][1] + o1] : 0.0f;
                    }
                    load_b_fragments(bf, s.wt, ks, tig, gid, warp_k);
                    mma_warp_step<PASSES, PASSES == 1>(af, bf, sum, (ks & 8) == 0);
                    if (PASSES == 3 && ((ks & 8) || ks + 8 >= rpad)) flush_step_sums(acc, stage);
                }
            }
            buf ^= 1;
        }
        epilogue(pos, acc);
    }
}

// conv2d_halo<PASSES, KSIZE, SPAN> stages a group of SPAN tiles (TileGroups; 2 where the
// shared memory holds them, else 1) in the scratch, 4 rows x 32 SPAN columns in
// halo_out_stride(SPAN) = 4 * 32 SPAN + 4 floats per channel (2 * 260 and 2 * 132 = 8 mod
// 32: the accumulators' four tig lanes write distinct banks), and stores the group's columns
// together: with two tiles each warp store covers 256 contiguous bytes of an output row, and
// the DRAM writes of 128-byte halves of such spans, each half at its own time, run at about
// 60 % of the rate of whole spans (design note).
__host__ __device__ constexpr int halo_out_stride(int span) {
    return HALO_TH * HALO_TW * span + 4;
}

// The staged group's kn channels x HALO_TH rows x WIDTH columns into yt (the group's first
// output; P, Q the output's rows and columns, rows and columns past p_left, q_left
// skipped), V floats a store (V = 2 needs every output row 8-byte aligned). WIDTH / V lanes
// write one row; the block's threads cover STEP consecutive rows of the (channel, row)
// order, a multiple of HALO_TH, so a thread keeps its row and column and steps over the
// channels: one shared load and one global store per step, the steps unrolled by UNROLL
// (all of them where the registers allow: the loads then all go out first).
template <int V, int WIDTH, int UNROLL>
__device__ __forceinline__ void store_staged_rows(const float* staged, float* yt, int kn,
                                                  int p_left, int q_left, int P, int Q) {
    using Vec = typename FloatVec<V>::type;
    constexpr int ROW_LANES = WIDTH / V;
    constexpr int STEP = CONV_THREADS / ROW_LANES;
    constexpr int KSTEP = STEP / HALO_TH;
    constexpr int STRIDE = halo_out_stride(WIDTH / HALO_TW);
    static_assert(STEP % HALO_TH == 0 && CONV_BN % KSTEP == 0, "a thread keeps its row");
    const int slot = threadIdx.x / ROW_LANES;
    const int row = slot % HALO_TH, kl0 = slot / HALO_TH;
    const int col = V * (threadIdx.x % ROW_LANES);
    if (row >= p_left || col >= q_left) return;
    const float* src = staged + kl0 * STRIDE + row * WIDTH + col;
    float* dst = yt + ((long long)kl0 * P + row) * Q + col;
    const long long plane = (long long)KSTEP * P * Q;
#pragma unroll UNROLL
    for (int t = 0; t < CONV_BN / KSTEP; ++t, dst += plane) {
        if (kl0 + t * KSTEP < kn)
            *reinterpret_cast<Vec*>(dst) = *reinterpret_cast<const Vec*>(src + t * KSTEP * STRIDE);
    }
}

template <int PASSES, int KSIZE, int SPAN>
__global__ void __launch_bounds__(CONV_THREADS, halo_blocks_per_sm<PASSES, KSIZE, false>())
conv2d_halo(const float* __restrict__ x, const float* __restrict__ w,
            const float* __restrict__ bias, float* __restrict__ y, int N, int C, int H, int W,
            int K, int kh, int kw, int P, int Q, int sh, int sw, int ph, int pw, int dh, int dw,
            int cc, int hr, int hc) {
    constexpr int BLOCKS = halo_blocks_per_sm<PASSES, KSIZE, false>();
    constexpr int WIDTH = SPAN * HALO_TW, STRIDE = halo_out_stride(SPAN);
    extern __shared__ float smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int warp_col = NarrowTile::warp_col(warp), warp_k = NarrowTile::warp_k(warp);
    const int k0 = blockIdx.y * CONV_BN;
    const int hsize = halo_floats<KSIZE>(cc, hr, hc);
    float* staged = halo_scratch<PASSES, KSIZE>(smem, hsize);  // [channel][row * WIDTH + column]
    const int kn = min(CONV_BN, K - k0);
    // Loaded once: 3xTF32's one block per multiprocessor does not hide a load per tile.
    const ChannelBias tile_bias = channel_bias(bias, k0 + warp_k, tig, K);
    const bool pairs = (Q & 1) == 0 && (reinterpret_cast<unsigned long long>(y) & 7) == 0;
    // The tiles go through shared memory: a warp's accumulators span 8 columns of 4
    // channels, so stored directly each instruction would touch 4 output rows; staged, a warp
    // writes whole rows of the group (float2 where every row starts 8-byte aligned: Q even).
    // A group's tiles but its last stage their part and return; its last stores them all
    // (TileGroups: one block takes them one after the other, with barriers between the
    // epilogues). At two blocks a multiprocessor (128 registers) the store steps unroll by 8.
    auto store = [&](const TilePos& pos, const float (&acc)[2][4][4]) {
        const int part = pos.tc % SPAN;
        // Fragment row r of the warp's 32 is pixel (row r / 8, column warp_col + r % 8).
        each_output(acc, gid, tig, k0 + warp_k, K, tile_bias, [&](int r, int k, float v) {
            staged[(k - k0) * STRIDE + (r >> 3) * WIDTH + part * HALO_TW + warp_col + (r & 7)]
                = v;
        });
        if (part + 1 < SPAN && (pos.tc + 1) * HALO_TW < Q) return;
        __syncthreads();
        const int p0 = pos.tr * HALO_TH, q0 = (pos.tc - part) * HALO_TW;
        float* yt = y + (((long long)pos.n * K + k0) * P + p0) * Q + q0;
        constexpr int UNROLL = BLOCKS == 1 ? CONV_BN : 8;
        if (pairs)
            store_staged_rows<2, WIDTH, UNROLL>(staged, yt, kn, P - p0, Q - q0, P, Q);
        else
            store_staged_rows<1, WIDTH, UNROLL>(staged, yt, kn, P - p0, Q - q0, P, Q);
    };
    halo_tiles<PASSES, KSIZE, BLOCKS>(
        x, w, C, H, W, K, kh, kw, P, Q, sh, sw, ph, pw, dh, dw, cc, hr, hc,
        halo_shared<PASSES, KSIZE>(smem, hsize), TileGroups<SPAN>{N, P, Q}, store,
        [](int) { return 1.0f; });
}

// Floats between two pixels of conv2d_halo_nhwc's staged tile: its 64 channels and 8 more,
// so that each pixel starts 16-byte aligned and the accumulators' float2 stores (channels
// 2 tig, 2 tig + 1 of pixels warp_col + gid) fall on distinct banks in each half warp
// (8 gid + 2 tig mod 32 for gid 0..3).
#define HALO_NHWC_STRIDE (CONV_BN + 8)

// The staged tile's kn channels of HALO_TH x HALO_TW pixels into the channels-last yt (the
// tile's first pixel and channel; Q, K the output's columns and channels; rows and columns
// past p_left, q_left skipped), V floats a store (V = 4 needs K a multiple of 4 and y 16-byte
// aligned): CONV_BN / V threads write one pixel's run of channels, the block's threads
// STEP pixels at a time.
template <int V>
__device__ __forceinline__ void store_staged_pixels(const float* staged, float* yt, int kn,
                                                    int p_left, int q_left, int Q, int K) {
    using Vec = typename FloatVec<V>::type;
    constexpr int LANES = CONV_BN / V;
    constexpr int STEP = CONV_THREADS / LANES;
    const int kl = V * (threadIdx.x % LANES);
    if (kl >= kn) return;
#pragma unroll 4
    for (int px = threadIdx.x / LANES; px < HALO_TH * HALO_TW; px += STEP) {
        const int row = px / HALO_TW, col = px % HALO_TW;
        if (row < p_left && col < q_left)
            *reinterpret_cast<Vec*>(yt + ((long long)row * Q + col) * K + kl)
                = *reinterpret_cast<const Vec*>(staged + px * HALO_NHWC_STRIDE + kl);
    }
}

// The tensor stores' staged tile (conv2d_halo_nhwc<..., NHWC_TENSOR>): two boxes of 32 channels x
// HALO_TH x HALO_TW pixels, each pixel's 32 channels a 128-byte row whose 16-byte chunks are
// XORed with the pixel's index mod 8 (the tensor map's 128-byte swizzle, from a 1024-byte
// aligned start). A box cannot take the padding that keeps the threads' staged pixels
// conflict-free: a half warp's float2 stores of the accumulators (4 pixels, gid 0-3 or 4-7)
// meet each bank at most twice.
// The scratch holds two such tiles (NHWC_TENSOR_SCRATCH floats with the alignment's slack;
// conv_gemm.py: _NHWC_TENSOR_SCRATCH), one staged while the other's stores read it.
#define NHWC_BOX_FLOATS (HALO_TH * HALO_TW * 32)
#define NHWC_TENSOR_SCRATCH (4 * NHWC_BOX_FLOATS + 255)

__device__ __forceinline__ int nhwc_box_offset(int px, int kl) {
    return (kl >> 5) * NHWC_BOX_FLOATS + px * 32 + ((((kl & 31) >> 2) ^ (px & 7)) << 2)
           + (kl & 3);
}

// One tensor store of the box at shared address src to the 4-D map at coordinates (c0, ...,
// c3), in the thread's bulk group; the map clips what lies past its dimensions.
__device__ __forceinline__ void tensor_store_4d(const TensorMap& map, unsigned src, int c0,
                                                int c1, int c2, int c3) {
#if HALO_WGMMA
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
        :: "l"(reinterpret_cast<unsigned long long>(&map)), "r"(src), "r"(c0), "r"(c1),
           "r"(c2), "r"(c3) : "memory");
#else
    __trap();
#endif
}

// This thread's bulk copies issued since its last commit, as one bulk group.
__device__ __forceinline__ void bulk_commit_group() {
#if HALO_WGMMA
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}

// This thread's bulk groups but its PENDING most recent ones have read their shared-memory
// sources.
template <int PENDING>
__device__ __forceinline__ void bulk_wait_read() {
#if HALO_WGMMA
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(PENDING) : "memory");
#endif
}

// A tile staged at `boxes` as two boxes of 32 channels (nhwc_box_offset), channels k0 ..
// k0 + kn of y's map from pixel (p0, q0) of sample n, written by thread 0's tensor stores
// in one bulk group once every thread's staging is published: the staged values, written
// through the generic proxy, before the tensor stores read them through the async one. The
// map clips rows, columns and channels past y.
__device__ __forceinline__ void tensor_store_tile(const TensorMap& map, const float* boxes,
                                                  int k0, int kn, int q0, int p0, int n) {
#if HALO_WGMMA
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned src = (unsigned)__cvta_generic_to_shared(boxes);
        for (int b = 0; b < 2 && 32 * b < kn; ++b)
            tensor_store_4d(map, src + 4 * b * NHWC_BOX_FLOATS, k0 + 32 * b, q0, p0, n);
        bulk_commit_group();
    }
}

// conv2d_halo_nhwc's ways of writing its staged tiles (STORE).
#define NHWC_THREADS 0  // the threads' float4 (or float) stores
#define NHWC_TENSOR 1   // tensor stores (the wgmma build)

// conv2d_halo (one tile at a time) into a channels-last y: y[((n * P + p) * Q + q) * K + k].
// A tile's 4 x 32 pixels x 64 channels are staged pixel-major and written as each pixel's
// run of channels; with K = 64 a tile row is one contiguous 8 KB run of y and the blocks
// running together (neighbouring tiles) write neighbouring runs, where an NCHW y takes
// 128-byte pieces of rows 64 KB apart. STORE:
//  * NHWC_TENSOR (the wgmma build; the launcher needs K % 4 == 0, y 16-byte aligned and
//    NHWC_TENSOR_SCRATCH floats of scratch): ymap is y's map (dims K, Q, P, N; box 32 x
//    HALO_TW x HALO_TH x 1; the 128-byte swizzle), which clips the tile's rows, columns and
//    channels past y's; one thread writes the tile by two tensor stores that the block does
//    not wait for: tiles take the scratch's two buffers in turn, and a tile's stores have
//    read theirs before the tile after next stages there. Compiled for the other targets
//    too, where it traps.
//  * NHWC_THREADS: store_staged_pixels.
template <int PASSES, int KSIZE, int STORE>
__global__ void __launch_bounds__(CONV_THREADS, halo_blocks_per_sm<PASSES, KSIZE, false>())
conv2d_halo_nhwc(const float* __restrict__ x, const float* __restrict__ w,
                 const float* __restrict__ bias, float* __restrict__ y, int N, int C, int H,
                 int W, int K, int kh, int kw, int P, int Q, int sh, int sw, int ph, int pw,
                 int dh, int dw, int cc, int hr, int hc, const __grid_constant__ TensorMap ymap) {
    constexpr bool TENSOR_STORE = STORE == NHWC_TENSOR;
    if constexpr (TENSOR_STORE && !HALO_WGMMA) {
        __trap();
        return;
    }
    constexpr int BLOCKS = halo_blocks_per_sm<PASSES, KSIZE, false>();
    extern __shared__ float smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int warp_col = NarrowTile::warp_col(warp), warp_k = NarrowTile::warp_k(warp);
    const int k0 = blockIdx.y * CONV_BN;
    const int hsize = halo_floats<KSIZE>(cc, hr, hc);
    float* staged = halo_scratch<PASSES, KSIZE>(smem, hsize);  // [pixel][channel - k0]
    if constexpr (TENSOR_STORE)  // the swizzled boxes (nhwc_box_offset) start 1024-byte aligned
        staged += (-(int)__cvta_generic_to_shared(staged) >> 2) & 255;
    const int kn = min(CONV_BN, K - k0);
    const ChannelBias tile_bias = channel_bias(bias, k0 + warp_k, tig, K);
    const bool by_four = (K & 3) == 0 && (reinterpret_cast<unsigned long long>(y) & 15) == 0;
    int buf = 0;
    auto store = [&](const TilePos& pos, const float (&acc)[2][4][4]) {
        const int p0 = pos.tr * HALO_TH, q0 = pos.tc * HALO_TW;
        float* box = staged + buf * 2 * NHWC_BOX_FLOATS;
        // Row gid + 8 half of MMA tile i is pixel (row 2 i + half, column warp_col + gid), its
        // values e of tile j channel warp_k + 8 j + 2 tig + e of the block's (each_output);
        // channels past K are staged too, and not stored.
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    float2 v = make_float2(acc[i][j][2 * half], acc[i][j][2 * half + 1]);
                    if (tile_bias.any) {
                        v.x += tile_bias.b[j][0];
                        v.y += tile_bias.b[j][1];
                    }
                    const int px = (2 * i + half) * HALO_TW + warp_col + gid;
                    const int kl = warp_k + 8 * j + 2 * tig;
                    *reinterpret_cast<float2*>(
                        TENSOR_STORE ? box + nhwc_box_offset(px, kl)
                                     : staged + px * HALO_NHWC_STRIDE + kl) = v;
                }
        if constexpr (TENSOR_STORE) {
            tensor_store_tile(ymap, box, k0, kn, q0, p0, pos.n);
            // The previous tile's stores have read the other buffer, which the next tile
            // stages into after a barrier of halo_tiles.
            if (threadIdx.x == 0) bulk_wait_read<1>();
            buf ^= 1;
            return;
        }
        __syncthreads();
        float* yt = y + (((long long)pos.n * P + p0) * Q + q0) * K + k0;
        if (by_four)
            store_staged_pixels<4>(staged, yt, kn, P - p0, Q - q0, Q, K);
        else
            store_staged_pixels<1>(staged, yt, kn, P - p0, Q - q0, Q, K);
    };
    halo_tiles<PASSES, KSIZE, BLOCKS>(
        x, w, C, H, W, K, kh, kw, P, Q, sh, sw, ph, pw, dh, dw, cc, hr, hc,
        halo_shared<PASSES, KSIZE>(smem, hsize), TileGroups<1>{N, P, Q}, store,
        [](int) { return 1.0f; });
    // The tensor stores have read the scratch before the block leaves it (their writes
    // complete with the grid).
    if (TENSOR_STORE && threadIdx.x == 0) bulk_wait_read<0>();
}

// A tile's accumulators (each_output's layout: row gid + 8 half of MMA tile i is pixel (row
// 2 i + half, column `col`), value e of tile j channel kl + 8 j + e) straight into the
// channels-last yt (the tile's first pixel and the block's first channel; K even, y 8-byte
// aligned), bias (the block's CONV_BN channels in shared memory, zeros where there is none)
// added; rows past p_left, columns past q_left and channels past kn skipped. A lane's two
// channels of a pixel go as one float2, so that each warp instruction writes 8 pixels' whole
// 32-byte sectors, which the L2 joins into the pixels' 128-byte lines (the four j of the
// warp's 32 channels).
__device__ __forceinline__ void store_pixels_direct(const float (&acc)[2][4][4], float* yt,
                                                    const float* bias, int col, int kl,
                                                    int p_left, int q_left, int Q, int K,
                                                    int kn) {
    if (col >= q_left) return;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (kl + 8 * j >= kn) continue;
        const float2 b = *reinterpret_cast<const float2*>(bias + kl + 8 * j);
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = 2 * i + half;
                if (row < p_left)
                    *reinterpret_cast<float2*>(yt + ((long long)row * Q + col) * K + kl + 8 * j)
                        = make_float2(acc[i][j][2 * half] + b.x, acc[i][j][2 * half + 1] + b.y);
            }
    }
}

// conv2d_halo (one tile at a time) into a channels-last y (K even, y 8-byte aligned) with
// each tile stored straight from the accumulators (store_pixels_direct). Without a staged
// tile, 3xTF32 on the wgmma build with the geometry compiled in fits two blocks a
// multiprocessor (halo_tiles' residuals-first sum), where conv2d_halo_nhwc, whose staged
// tile takes 33-66 KB, leaves room for one. Shared memory: halo_scratch's offset and CONV_BN
// floats, the block's bias.
template <int PASSES, int KSIZE>
__global__ void __launch_bounds__(CONV_THREADS, halo_blocks_per_sm<PASSES, KSIZE, true>())
conv2d_halo_nhwc_direct(const float* __restrict__ x, const float* __restrict__ w,
                        const float* __restrict__ bias, float* __restrict__ y, int N, int C,
                        int H, int W, int K, int kh, int kw, int P, int Q, int sh, int sw,
                        int ph, int pw, int dh, int dw, int cc, int hr, int hc) {
    extern __shared__ float smem[];
    const int k0 = blockIdx.y * CONV_BN;
    const int hsize = halo_floats<KSIZE>(cc, hr, hc);
    // The bias, read by the epilogues after the barrier that halo_tiles passes first.
    if (threadIdx.x < CONV_BN)
        halo_scratch<PASSES, KSIZE>(smem, hsize)[threadIdx.x]
            = bias != nullptr && k0 + (int)threadIdx.x < K ? __ldg(bias + k0 + threadIdx.x)
                                                           : 0.0f;
    auto store = [&](const TilePos& pos, const float (&acc)[2][4][4]) {
        // Everything from the arguments and the thread's index again, read by an instruction
        // that the compiler does not hoist: at two blocks a multiprocessor no register is
        // left to hold a lane's column over the main loop (held there, it spills).
        unsigned tid;
        asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
        const int warp = tid >> 5, lane = tid & 31;
        const int kb = blockIdx.y * CONV_BN, p0 = pos.tr * HALO_TH, q0 = pos.tc * HALO_TW;
        store_pixels_direct(acc, y + (((long long)pos.n * P + p0) * Q + q0) * K + kb,
                            halo_scratch<PASSES, KSIZE>(smem, hsize),
                            NarrowTile::warp_col(warp) + (lane >> 2),
                            NarrowTile::warp_k(warp) + 2 * (lane & 3), P - p0, Q - q0, Q, K,
                            min(CONV_BN, K - kb));
    };
    halo_tiles<PASSES, KSIZE, halo_blocks_per_sm<PASSES, KSIZE, true>()>(
        x, w, C, H, W, K, kh, kw, P, Q, sh, sw, ph, pw, dh, dw, cc, hr, hc,
        halo_shared<PASSES, KSIZE>(smem, hsize), TileGroups<1>{N, P, Q}, store,
        [](int) { return 1.0f; });
}

// The held-weights kernels (conv2d_nhwc_held_weights, conv2d_held_weights_pool_stats): 3xTF32
// for 3 x 3 kernels at stride and dilation 1 of up to 8 input channels (one FixedHalo chunk),
// on the wgmma build. The roles of the halo kernels' MMAs are swapped: the block's 64 output
// channels are M and their weights wgmma's A operand, held in registers for every tile the
// block takes (two planes a tap: the finite high part and the residual, 72 registers), and
// a tile's 4 x 32 pixels are N, read by the tensor cores from the staged halo. Per tile and
// tap each of the 4 output rows is one m64n32k8 step per product, so no fragment is loaded
// into registers between MMAs: a tile's 108 steps go out as one commit group, and while they
// run the warpgroup copies the next tile's halo and splits it. One warpgroup a block, three
// blocks a multiprocessor (168 registers).
//
// The halo (HALO_TH + 2 rows x HALO_TW + 2 columns x 8 channels, zeros outside x and past C)
// is copied by cp.async into a raw plane laid out [row][k half][column][4 channels]: the 8
// columns of a row from any column on are one K-major core matrix per k half (8 pixels x 16
// bytes, 128 contiguous bytes), the halves HELD_HC * 16 bytes apart (the descriptor's
// leading offset) and the next 8 columns 128 bytes on (its stride offset), so that tap (u,
// v) of output row r is the descriptor of row r + u, column v. The tensor cores read a
// float32 as its TF32 truncation, so the raw plane is the high part; the split writes the
// residual x - trunc(x) rounded to TF32 (zero for a non-finite x) and the finite high part
// (zero for a non-finite x) into planes of the same layout. Products: the finite high
// weight times the residual x, the residual weight times the finite x, then the high ones
// (finite high weight times raw x), all residual products first (the tensor cores'
// accumulation truncates: while the accumulator holds only residual products that loses
// nothing). A non-finite weight's high part takes part as zero: each kernel says how its
// channels get the definition's values.
#define HELD_THREADS 128
#define HELD_BLOCKS_PER_SM 3
#define HELD_HR (HALO_TH + 2)
#define HELD_HC (HALO_TW + 2)
#define HELD_PLANE (HELD_HR * 2 * HELD_HC * 4)
// Shared memory: halo planes for this tile and the next (raw, residual, finite), then
// conv2d_nhwc_held_weights' two output boxes 1024-byte aligned (conv_gemm.py: _HELD_SHARED).
#define HELD_SHARED_FLOATS (6 * HELD_PLANE + 2 * NHWC_BOX_FLOATS + 255)

#if HALO_WGMMA
// The descriptor of a held-weights halo plane at p: K-major core matrices without swizzle,
// the k halves HELD_HC * 16 bytes apart (leading offset), 8 columns 128 bytes apart (stride
// offset). Step (row, column) adds row * 2 * HELD_HC + column: the plane lies in the shared
// window (under 228 KB), so the 14-bit address field's sum carries into no other field.
__device__ __forceinline__ unsigned long long held_halo_desc(const float* p) {
    const unsigned long long a = (unsigned)__cvta_generic_to_shared(p);
    return ((a & 0x3FFFF) >> 4) | ((unsigned long long)HELD_HC << 16) | (8ull << 32);
}

// The held-weights main loop over the tiles of `schedule` (TileGroups<1>, SampleSegments)
// for output channels k0 = blockIdx.y * 64 .., the weights times sign(k). A thread's
// accumulator acc[r][j][e] is channel k0 + 16 warp + gid + 8 (e >> 1) at tile pixel (r, 8 j
// + 2 tig + (e & 1)). Where `nonfinite` is given, nonfinite[kl] says whether channel k0 + kl
// has a non-finite weight (published by the first tile's barrier). Per tile: wait() from
// every thread, a barrier (the next halo's planes published, this tile's MMAs done),
// epilogue(pos, acc).
template <class Schedule, class Sign, class Wait, class Epilogue>
__device__ __forceinline__ void held_tiles(const float* __restrict__ x,
                                           const float* __restrict__ w, int C, int H, int W,
                                           int K, int ph, int pw, float* smem,
                                           const Schedule& schedule, Sign sign, Wait wait,
                                           Epilogue epilogue, int* nonfinite) {
    float* raw = smem;
    float* residual = raw + 2 * HELD_PLANE;
    float* finite = residual + 2 * HELD_PLANE;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int k0 = blockIdx.y * CONV_BN;
    // wgmma's A fragments of every tap (mma_tf32's layout): rows output channels k0 + 16
    // warp + gid (+ 8), columns input channels tig (+ 4). [0] finite high part, [1] residual.
    unsigned a[2][9][4];
    bool bad[2] = {false, false};
#pragma unroll
    for (int tap = 0; tap < 9; ++tap)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int k = k0 + 16 * warp + gid + 8 * (e & 1), c = tig + 4 * (e >> 1);
            const float v = k < K && c < C ? __ldg(w + ((long long)k * C + c) * 9 + tap) : 0.0f;
            bad[e & 1] |= !(fabsf(v) < INFINITY);
            unsigned hi, hi_finite;
            split_operand<3>(k < K ? v * sign(k) : v, hi, hi_finite, a[1][tap][e]);
            a[0][tap][e] = hi_finite;
        }
    if (nonfinite != nullptr) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned any = __ballot_sync(0xffffffffu, bad[h]);
            if (tig == 0) nonfinite[16 * warp + gid + 8 * h] = (any >> lane) & 15u;
        }
    }
    constexpr int TURNS = (HELD_PLANE + HELD_THREADS - 1) / HELD_THREADS;
    // The copies of the tile's halo into raw plane buf, a float each (zeros outside), as one
    // cp.async group; index i of a plane is (row, k half, column, channel % 4), channel
    // fastest (a warp's loads: 4 channels x 8 columns, whole 32-byte sectors).
    auto copy_halo = [&](const TilePos& pos, int buf) {
        const int p0 = pos.tr * HALO_TH, q0 = pos.tc * HALO_TW;
        const float* xs = x + (long long)pos.n * C * H * W;
#pragma unroll
        for (int turn = 0; turn < TURNS; ++turn) {
            const int i = tid + turn * HELD_THREADS;
            if (HELD_PLANE % HELD_THREADS != 0 && i >= HELD_PLANE) break;
            const int col = (i >> 2) % HELD_HC, rest = (i >> 2) / HELD_HC;
            const int c = 4 * (rest & 1) + (i & 3), h = p0 + (rest >> 1) - ph, ww = q0 + col - pw;
            const bool valid = c < C && h >= 0 && h < H && ww >= 0 && ww < W;
            copy_or_zero_async<1>(raw + buf * HELD_PLANE + i,
                                  valid ? xs + ((long long)c * H + h) * W + ww : xs, valid);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    // Plane buf's residual and finite high parts from its raw copies (this thread's own,
    // after their wait), published to the tensor cores' (async) proxy.
    auto split_halo = [&](int buf) {
        asm volatile("cp.async.wait_all;" ::: "memory");
#pragma unroll
        for (int turn = 0; turn < TURNS; ++turn) {
            const int i = tid + turn * HELD_THREADS;
            if (HELD_PLANE % HELD_THREADS != 0 && i >= HELD_PLANE) break;
            const float v = raw[buf * HELD_PLANE + i];
            const bool is_finite = fabsf(v) < INFINITY;
            const float high = __uint_as_float(__float_as_uint(v) & 0xffffe000u);
            residual[buf * HELD_PLANE + i] =
                __uint_as_float(to_tf32(is_finite ? v - high : 0.0f));
            finite[buf * HELD_PLANE + i] = is_finite ? v : 0.0f;
            // A NaN whose payload lies in the low 13 bits only would read as an infinity.
            if (v != v) raw[buf * HELD_PLANE + i] = NAN;
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    };
    TilePos pos;
    if (!schedule.first(pos)) return;
    copy_halo(pos, 0);
    split_halo(0);
    __syncthreads();
    for (int buf = 0;; buf ^= 1) {
        bool more;
        {
            TilePos next = pos;
            more = schedule.next(next);
            if (more) copy_halo(next, buf ^ 1);
        }
        float acc[HALO_TH][4][4];
#pragma unroll
        for (int e = 0; e < HALO_TH * 16; ++e) (&acc[0][0][0])[e] = 0.0f;
        pin_registers<HALO_TH * 16>(&acc[0][0][0]);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        const unsigned long long high = held_halo_desc(raw + buf * HELD_PLANE),
                                 low = held_halo_desc(residual + buf * HELD_PLANE),
                                 high_finite = held_halo_desc(finite + buf * HELD_PLANE);
        // Step of output row r, tap (u, v): the halo from row r + u, column v. The rows go
        // innermost: each accumulator's next step is HALO_TH steps on.
        auto steps = [&](int tap, int q, unsigned long long plane) {
#pragma unroll
            for (int r = 0; r < HALO_TH; ++r)
                wgmma_tf32(acc[r], a[q][tap], plane + (r + tap / 3) * 2 * HELD_HC + tap % 3);
        };
#pragma unroll
        for (int tap = 0; tap < 9; ++tap) {
            steps(tap, 0, low);
            steps(tap, 1, high_finite);
        }
#pragma unroll
        for (int tap = 0; tap < 9; ++tap) steps(tap, 0, high);
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        if (more) split_halo(buf ^ 1);
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        pin_registers<HALO_TH * 16>(&acc[0][0][0]);
        wait();
        __syncthreads();
        epilogue(pos, acc);
        if (!more) return;
        schedule.next(pos);  // the tile copied above: no position held over the MMAs
    }
}
#endif

// conv2d_nhwc_held_weights: the held-weights convolution into a packed channels-last y
// (held_tiles over TileGroups<1>). The tile's outputs plus bias are staged as
// conv2d_halo_nhwc's two swizzled boxes (nhwc_box_offset) and written by thread 0's two
// tensor stores through ymap (dims K, Q, P, N; box 32 x HALO_TW x HALO_TH x 1), which clips
// what lies past y; the next tile's staging waits until they have read the boxes. A channel
// with a non-finite weight is left to the launcher, which rewrites it by the definition
// (conv_nonfinite_weight_rows). Grid (blocks, ceil(K / 64)), block 128, shared memory
// HELD_SHARED_FLOATS floats. Compiled for the other targets too, where it traps.
__global__ void __launch_bounds__(HELD_THREADS, HELD_BLOCKS_PER_SM)
conv2d_nhwc_held_weights(const float* __restrict__ x, const float* __restrict__ w,
                         const float* __restrict__ bias, int N, int C, int H, int W, int K,
                         int P, int Q, int ph, int pw, const __grid_constant__ TensorMap ymap) {
#if HALO_WGMMA
    extern __shared__ float smem[];
    float* boxes = smem + 6 * HELD_PLANE;  // 1024-byte aligned (the 128-byte swizzle)
    boxes += (-(int)__cvta_generic_to_shared(boxes) >> 2) & 255;
    // The bias of the lane's two channels; without one -0.0, which adds nothing (a -0.0
    // output stays -0.0).
    float b[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int k = blockIdx.y * CONV_BN + (threadIdx.x >> 5) * 16 + (threadIdx.x & 31) / 4
                      + 8 * h;
        b[h] = bias != nullptr && k < K ? __ldg(bias + k) : -0.0f;
    }
    // The previous tile's stores have read the boxes.
    auto wait = [] {
        if (threadIdx.x == 0) bulk_wait_read<0>();
    };
    auto store = [&](const TilePos& pos, const float (&acc)[HALO_TH][4][4]) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        const int gid = lane >> 2, tig = lane & 3;
        const int k0 = blockIdx.y * CONV_BN;
#pragma unroll
        for (int r = 0; r < HALO_TH; ++r)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    boxes[nhwc_box_offset(r * HALO_TW + 8 * j + 2 * tig + (e & 1),
                                          16 * warp + gid + 8 * (e >> 1))] =
                        acc[r][j][e] + b[e >> 1];
        tensor_store_tile(ymap, boxes, k0, K - k0, pos.tc * HALO_TW, pos.tr * HALO_TH,
                          pos.n);
    };
    held_tiles(x, w, C, H, W, K, ph, pw, smem, TileGroups<1>{N, P, Q},
               [](int) { return 1.0f; }, wait, store, nullptr);
    // The tensor stores have read the boxes before the block leaves (their writes complete
    // with the grid).
    if (threadIdx.x == 0) bulk_wait_read<0>();
#else
    __trap();
#endif
}

// conv2d_halo in TF32 for 3 x 3 kernels at stride and dilation 1 (FixedHalo) on the wgmma
// build, where the output rows are 65 to 128 columns: tiles of 4 x 64 pixels x 32 channels
// (BandTile), a block taking the two tiles of a band of 4 whole output rows one after the
// other (BandTiles). Each channel's rows of the band are one contiguous run of y, staged as
// such (channel c at c * cs floats, a row Q floats) and written by one bulk copy of the
// tensor memory accelerator (cp.async.bulk: no thread stores, the run's DRAM pages written
// at once), which the block does not wait for: the next band's staging waits until the
// copies have read the scratch. The launcher needs y 16-byte aligned and every band's run a
// multiple of 16 bytes (P * Q a multiple of 4, and with it the last band's (P % 4) * Q), and
// cs >= 4 Q with cs % 8 == 4 (the accumulators' four tig lanes write distinct banks).
// Compiled for the other targets too, where it traps.
__global__ void __launch_bounds__(CONV_THREADS, HALO_BLOCKS_PER_SM)
conv2d_halo_bands(const float* __restrict__ x, const float* __restrict__ w,
                  const float* __restrict__ bias, float* __restrict__ y, int N, int C, int H,
                  int W, int K, int P, int Q, int ph, int pw, int cs) {
#if HALO_WGMMA
    constexpr int KSIZE = 3;
    using Fixed = FixedHalo<KSIZE, BandTile::W>;
    extern __shared__ float smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int warp_col = BandTile::warp_col(warp);
    const int k0 = blockIdx.y * BandTile::N;
    const int hsize = halo_floats<KSIZE, BandTile::W>(0, 0, 0);
    float* staged = halo_scratch<1, KSIZE>(smem, hsize);  // [channel][row * Q + column]
    const int kn = min(BandTile::N, K - k0);
    const ChannelBias tile_bias = channel_bias(bias, k0, tig, K);
    const BandTiles bands{N, P, Q};
    auto store = [&](const TilePos& pos, const float (&acc)[2][4][4]) {
        if (pos.tc == bands.last()) {
            // The previous band's copies have read the scratch.
            if (threadIdx.x < BandTile::N) bulk_wait_read<0>();
            __syncthreads();
        }
        // Fragment row r of the warp's 32 is pixel (row r / 8, column warp_col + r % 8). No
        // output is skipped: a row past P lands within its channel's cs floats, past the run
        // that the copy takes, and a column past Q (in the band's last tile, staged first)
        // where the first tile's value of the same row, BandTile::W columns to the left,
        // overwrites it.
        const int col = pos.tc * BandTile::W + warp_col + gid;
        float* at = staged + (col < Q ? col : col - BandTile::W);
        each_output(acc, gid, tig, k0, K, tile_bias, [&](int r, int k, float v) {
            at[(k - k0) * cs + (r >> 3) * Q] = v;
        });
        if (pos.tc != 0) return;
        // The staged values, written through the generic proxy, before the copies read them
        // through the async one.
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        if (threadIdx.x < kn) {
            const int p0 = pos.tr * HALO_TH;
            const long long run = (((long long)pos.n * K + k0 + threadIdx.x) * P + p0) * Q;
            const unsigned src = (unsigned)__cvta_generic_to_shared(staged + threadIdx.x * cs);
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                         :: "l"(y + run), "r"(src), "r"(4 * min(HALO_TH, P - p0) * Q)
                         : "memory");
            bulk_commit_group();
        }
    };
    halo_tiles<1, KSIZE, HALO_BLOCKS_PER_SM, BandTile>(
        x, w, C, H, W, K, KSIZE, KSIZE, P, Q, 1, 1, ph, pw, 1, 1, Fixed::CC, Fixed::HR,
        Fixed::HC, halo_shared<1, KSIZE>(smem, hsize), bands, store, [](int) { return 1.0f; });
    // The copies have read the scratch before the block leaves it (their writes complete
    // with the grid).
    if (threadIdx.x < BandTile::N) bulk_wait_read<0>();
#else
    __trap();
#endif
}

// Pipeline A's convolution with the fused pass of pool_extremum_stats (pooling.cu) as its
// epilogue: the convolution output never goes to memory. For POOL x POOL windows (stride ==
// window, POOL dividing a warp's 4 x 8 pixels) and every output pixel of channel k:
//  * ext[n, k, ph, pw] (contiguous NCHW, Ho = P / POOL, Wo = Q / POOL): the window max of
//    y + bias[k], or the window min where sign_a[k] * sign_b[k] < 0 (either may be null:
//    positive), as pool_extremum_stats writes it (fmaxf drops NaN: a NaN in a statistics row
//    makes its mean NaN, and with it every output the extremum feeds);
//  * partial[(n * K + k) * splits + s] = (sum d, sum d * d, shift, count as int bits), d =
//    y + bias[k] - shift over the count pixels of run s of sample n's tiles (SampleSegments;
//    the tiles cover every pixel once, the rows and columns that the pool drops included),
//    shift the value at the run's first pixel (group_affine_rows in normalization.cu takes
//    them).
// The weights come staged times sign[k] (+1, or -1 where the window takes the min): acc is
// sign * y, every window takes its max, and sign * max(acc) + bias is the extremum of
// y + bias exactly (rounding is monotonic and symmetric); the sums run over sign * d =
// acc - offset (offset = sign * (shift - bias): the first pixel's acc), their sum of sign * d
// multiplied by sign once per run.
// A lane holds one column of a window (the warp layout above): the max of its rows in
// registers, the window's over POOL neighbouring lanes by shuffles, stored by the window's
// first lane. Each lane sums over a run's tiles in registers; after the run's last tile a
// warp reduces them over its lanes and the four column warps meet in the scratch. Scratch
// (after the halo buffers): per channel (bias, sign, offset, unused), the sums [warp
// column][channel] (float2): 4 * CONV_BN + 2 * 4 * CONV_BN floats, which the launcher adds
// to the shared memory it asks for.

// product_sign of sign_a[k] and sign_b[k] (either may be null: positive).
__device__ __forceinline__ float window_sign(const float* __restrict__ sign_a,
                                            const float* __restrict__ sign_b, int k) {
    const float a = sign_a != nullptr ? __ldg(sign_a + k) : 1.0f;
    const float b = sign_b != nullptr ? __ldg(sign_b + k) : 1.0f;
    return product_sign(a, b);
}

template <int PASSES, int KSIZE, int POOL>
__global__ void __launch_bounds__(CONV_THREADS, halo_blocks_per_sm<PASSES, KSIZE, true>())
conv2d_halo_pool_stats(const float* __restrict__ x, const float* __restrict__ w,
                       const float* __restrict__ bias, const float* __restrict__ sign_a,
                       const float* __restrict__ sign_b, float* __restrict__ ext,
                       float4* __restrict__ partial, int N, int C, int H, int W, int K, int kh,
                       int kw, int P, int Q, int sh, int sw, int ph, int pw, int dh, int dw,
                       int cc, int hr, int hc, int Ho, int Wo, int splits) {
    extern __shared__ float smem[];
    static_assert(HALO_TH % POOL == 0 && 8 % POOL == 0, "windows tile a warp's 4 x 8 pixels");
    constexpr int WR = HALO_TH / POOL;  // window rows of a tile
    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int warp_m = warp & 3, warp_k = (warp >> 2) * 32;
    const int k0 = blockIdx.y * CONV_BN;
    const int tiles_w = (Q + HALO_TW - 1) / HALO_TW;
    const int tiles = ((P + HALO_TH - 1) / HALO_TH) * tiles_w;
    const SampleSegments segments{tiles, tiles_w, splits, (long long)N * splits};
    const int hsize = halo_floats<KSIZE>(cc, hr, hc);
    // Per channel (bias, sign, offset: the acc of the run's first pixel, sign * d = acc -
    // offset); the run's sums per warp column and channel; this lane's running sums of its
    // 8 channels.
    float4* params = reinterpret_cast<float4*>(halo_scratch<PASSES, KSIZE>(smem, hsize));
    float2* sums = reinterpret_cast<float2*>(params + CONV_BN);
    float2 lane_sums[8];  // [j * 2 + e]
    if (tid < CONV_BN) {
        const int k = k0 + tid;
        const bool k_in = k < K;
        params[tid] = make_float4((k_in && bias != nullptr) ? __ldg(bias + k) : 0.0f,
                                  k_in ? window_sign(sign_a, sign_b, k) : 1.0f, 0.0f, 0.0f);
    }
    const long long plane = (long long)Ho * Wo;  // ext floats per channel
    bool fresh = true;  // the next tile opens a run

    // One tile; CHECK: some of its pixels lie past the output (only those inside count).
    auto tile_epilogue = [&](auto check, const TilePos& pos, const float (&acc)[2][4][4]) {
        constexpr bool CHECK = decltype(check)::value;
        const int p0 = pos.tr * HALO_TH, q = pos.tc * HALO_TW + warp_m * 8 + gid;  // lane's
        const int wo = q / POOL;
        // The window lane's extremum of channel k0 + warp_k + 2 tig; channel + 8 j + e is
        // (8 j + e) planes on.
        const bool stores = gid % POOL == 0 && (!CHECK || wo < Wo);
        float* ext_j = ext + ((long long)pos.n * K + k0 + warp_k + 2 * tig) * plane
                       + (long long)(p0 / POOL) * Wo + wo;
#pragma unroll
        for (int j = 0; j < 4; ++j, ext_j += 8 * plane)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int kl = warp_k + j * 8 + 2 * tig + e;
                const float4 bs = params[kl];
                float m[WR];
                float2 sum = lane_sums[j * 2 + e];
#pragma unroll
                for (int r = 0; r < HALO_TH; ++r) {  // acc row gid + 8 * (r & 1) of tile r / 2
                    const float v = acc[r >> 1][j][(r & 1) * 2 + e];
                    if (!CHECK || (p0 + r < P && q < Q)) {
                        const float d = v - bs.z;
                        sum.x += d;
                        sum.y = fmaf(d, d, sum.y);
                    }
                    m[r / POOL] = r % POOL == 0 ? v : fmaxf(m[r / POOL], v);
                }
                lane_sums[j * 2 + e] = sum;
#pragma unroll
                for (int wr = 0; wr < WR; ++wr) {
#pragma unroll
                    for (int step = 4; step < 4 * POOL; step <<= 1)
                        m[wr] = fmaxf(m[wr], __shfl_xor_sync(0xffffffffu, m[wr], step));
                    if (stores && k0 + kl < K && (!CHECK || p0 / POOL + wr < Ho))
                        ext_j[e * plane + wr * Wo] = fmaf(bs.y, m[wr], bs.x);
                }
            }
    };

    auto pool_stats = [&](const TilePos& pos, const float (&acc)[2][4][4]) {
        if (fresh) {
            // The run's offsets: the acc of its first pixel (row 0, column 0 of the first
            // column warps: fragment row 0 of MMA tile 0), published by the barrier below. The
            // previous run's epilogue read the offsets before this tile's barriers.
            if (warp_m == 0 && gid == 0) {
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        params[warp_k + j * 8 + 2 * tig + e].z = acc[0][j][e];
            }
#pragma unroll
            for (int je = 0; je < 8; ++je) lane_sums[je] = make_float2(0.0f, 0.0f);
            fresh = false;
            __syncthreads();
        }
        if ((pos.tr + 1) * HALO_TH <= P && (pos.tc + 1) * HALO_TW <= Q)
            tile_epilogue(Flag<false>{}, pos, acc);
        else
            tile_epilogue(Flag<true>{}, pos, acc);
        if (pos.t + 1 != pos.end) return;
        fresh = true;
        // The run's sums over the lanes of one tig (8 columns), then the 4 column warps.
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float2 sum = lane_sums[j * 2 + e];
#pragma unroll
                for (int step = 4; step < 32; step <<= 1) {
                    sum.x += __shfl_xor_sync(0xffffffffu, sum.x, step);
                    sum.y += __shfl_xor_sync(0xffffffffu, sum.y, step);
                }
                if (gid == 0) sums[warp_m * CONV_BN + warp_k + j * 8 + 2 * tig + e] = sum;
            }
        __syncthreads();
        if (tid < CONV_BN && k0 + tid < K) {
            float2 total = sums[tid];
#pragma unroll
            for (int c = 1; c < 4; ++c) {
                total.x += sums[c * CONV_BN + tid].x;
                total.y += sums[c * CONV_BN + tid].y;
            }
            // The run's pixels: whole tiles but those at the output's bottom and right edges.
            int count = 0;
            for (int t = segments.begin(pos.run); t < pos.end; ++t) {
                const int tr = t / tiles_w, tc = t - tr * tiles_w;
                count += min(HALO_TH, P - tr * HALO_TH) * min(HALO_TW, Q - tc * HALO_TW);
            }
            const float4 bs = params[tid];
            partial[((long long)pos.n * K + k0 + tid) * splits + pos.run] =
                make_float4(bs.y * total.x, total.y, fmaf(bs.y, bs.z, bs.x), __int_as_float(count));
        }
    };
    halo_tiles<PASSES, KSIZE, halo_blocks_per_sm<PASSES, KSIZE, true>()>(
        x, w, C, H, W, K, kh, kw, P, Q, sh, sw, ph, pw, dh, dw, cc, hr, hc,
        halo_shared<PASSES, KSIZE>(smem, hsize), segments, pool_stats,
        [&](int k) { return window_sign(sign_a, sign_b, k); });
}

// conv2d_held_weights_pool_stats: conv2d_halo_pool_stats<3, 3, 4>'s ext and partial (4 x 4
// windows) from the held-weights convolution (held_tiles over SampleSegments, the weights
// times sign[k]), in 3xTF32 on the wgmma build. A lane holds two channels (k0 + 16 warp +
// gid + 8 h) of each tile row's pixels 8 j + 2 tig + e: a window is the tile's 4 rows of
// lanes tig and tig ^ 1, whose maxima meet by one shuffle; a run's sums of a channel are its
// four tig lanes', which meet by two shuffles at the run's end (2 x 2 windows, two a lane,
// spill at the register bound: they stay on conv2d_halo_pool_stats).
// The run's offset of a channel is its acc at the run's first pixel (lane tig = 0's). A
// channel with a non-finite weight gets NaN sums: its group's statistics are then not
// finite, and pipeline A recomputes such planes from x and w by the definition
// (pool_affine_nonfinite_conv), as it does for the NaN and infinities that such a weight
// puts in the halo kernels' sums. Shared memory HELD_POOL_SHARED_FLOATS floats: the halo
// planes, then per channel of the block (bias, sign) and its non-finite weight flag. Grid
// (blocks, ceil(K / 64)), block 128. Compiled for the other targets too, where it traps.
#define HELD_POOL_SHARED_FLOATS (6 * HELD_PLANE + 3 * CONV_BN)

__global__ void __launch_bounds__(HELD_THREADS, HELD_BLOCKS_PER_SM)
conv2d_held_weights_pool_stats(const float* __restrict__ x, const float* __restrict__ w,
                               const float* __restrict__ bias,
                               const float* __restrict__ sign_a,
                               const float* __restrict__ sign_b, float* __restrict__ ext,
                               float4* __restrict__ partial, int N, int C, int H, int W, int K,
                               int P, int Q, int ph, int pw, int Ho, int Wo, int splits) {
#if HALO_WGMMA
    extern __shared__ float smem[];
    float2* params = reinterpret_cast<float2*>(smem + 6 * HELD_PLANE);  // (bias, sign)
    int* nonfinite = reinterpret_cast<int*>(params + CONV_BN);
    const int k0 = blockIdx.y * CONV_BN;
    if (threadIdx.x < CONV_BN) {  // published by held_tiles' first barrier
        const int k = k0 + threadIdx.x;
        params[threadIdx.x] = k < K ? make_float2(bias != nullptr ? __ldg(bias + k) : 0.0f,
                                                  window_sign(sign_a, sign_b, k))
                                    : make_float2(0.0f, 1.0f);
    }
    const int tiles_w = (Q + HALO_TW - 1) / HALO_TW;
    const int tiles = ((P + HALO_TH - 1) / HALO_TH) * tiles_w;
    const SampleSegments segments{tiles, tiles_w, splits, (long long)N * splits};
    // The lane's channels' run offsets and sums; whether the next tile opens a run.
    float offset[2];
    float2 sum[2];
    bool fresh = true;
    auto stats = [&](const TilePos& pos, const float (&acc)[HALO_TH][4][4]) {
        const int lane = threadIdx.x & 31, tig = lane & 3;
        const int kl0 = (threadIdx.x >> 5) * 16 + (lane >> 2);  // the lane's channel h = 0
        if (fresh) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                offset[h] = __shfl_sync(0xffffffffu, acc[0][0][2 * h], lane & ~3);
                sum[h] = make_float2(0.0f, 0.0f);
            }
            fresh = false;
        }
        const int p0 = pos.tr * HALO_TH, q0 = pos.tc * HALO_TW;
        const bool whole = p0 + HALO_TH <= P && q0 + HALO_TW <= Q;
        // The tile's 32 values a channel summed apart, then added to the run's sums: chains
        // of 32 + the run's tiles additions, not 32 times the tiles.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float2 tile_sum = make_float2(0.0f, 0.0f);
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int r = 0; r < HALO_TH; ++r)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (whole || (p0 + r < P && q0 + 8 * j + 2 * tig + e < Q)) {
                            const float d = acc[r][j][2 * h + e] - offset[h];
                            tile_sum.x += d;
                            tile_sum.y = fmaf(d, d, tile_sum.y);
                        }
            sum[h].x += tile_sum.x;
            sum[h].y += tile_sum.y;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int kl = kl0 + 8 * h;
            const float2 bs = params[kl];
            float* ext_k = ext + ((long long)pos.n * K + k0 + kl) * Ho * Wo;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int col = q0 + 8 * j + 2 * tig;
                float m = acc[0][j][2 * h];
#pragma unroll
                for (int r = 0; r < HALO_TH; ++r)
                    m = fmaxf(m, fmaxf(acc[r][j][2 * h], acc[r][j][2 * h + 1]));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                const int ho = p0 / 4, wo = col / 4;
                if ((tig & 1) == 0 && k0 + kl < K && ho < Ho && wo < Wo)
                    ext_k[(long long)ho * Wo + wo] = fmaf(bs.y, m, bs.x);
            }
        }
        if (pos.t + 1 != pos.end) return;
        fresh = true;
        // The run's pixels: whole tiles but those at the output's bottom and right edges.
        int count = 0;
        for (int t = segments.begin(pos.run); t < pos.end; ++t) {
            const int tr = t / tiles_w, tc = t - tr * tiles_w;
            count += min(HALO_TH, P - tr * HALO_TH) * min(HALO_TW, Q - tc * HALO_TW);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float2 total = sum[h];
#pragma unroll
            for (int step = 1; step < 4; step <<= 1) {
                total.x += __shfl_xor_sync(0xffffffffu, total.x, step);
                total.y += __shfl_xor_sync(0xffffffffu, total.y, step);
            }
            const int kl = kl0 + 8 * h;
            if (tig == 0 && k0 + kl < K) {
                const float2 bs = params[kl];
                const bool bad = nonfinite[kl] != 0;
                partial[((long long)pos.n * K + k0 + kl) * splits + pos.run] = make_float4(
                    bad ? NAN : bs.y * total.x, bad ? NAN : total.y, fmaf(bs.y, offset[h], bs.x),
                    __int_as_float(count));
            }
        }
    };
    held_tiles(x, w, C, H, W, K, ph, pw, smem, segments,
               [&](int k) { return window_sign(sign_a, sign_b, k); }, [] {}, stats, nonfinite);
#else
    __trap();
#endif
}

// ---------------------------------------------------------------------------------------
// Pipeline C's transposed 3-D convolution, stride 2, 3 x 3 x 3 kernel, padding 1, output
// padding 0 or 1, groups 1, at most CT3_CI input channels: sub-pixel implicit GEMMs whose
// epilogues take the clamped softmax's sums or write its result, so that the convolution
// output is never stored (the "recompute" design: one pass for the sums, a second that
// computes the convolution again and writes the result; docs/design.rst), or write the
// convolution itself (the public conv_transpose3d).
//
// Per axis, output o = 2 m + r takes tap 1 of input m (r = 0), or taps 2 of input m and 0 of
// input m + 1 (r = 1): the eight residue classes r = (rd, rh, rw) of a base position m have
// 1, 2, 4 or 8 taps (27 in all), each a GEMM of the base positions (rows) by the input
// channels (reduction) by the output channels (columns). A block takes tiles of CT3_TD x
// CT3_TH x CT3_TW base positions of one sample (256 rows, 16 (d, h) rows of 16 w positions)
// and CT3_BN output channels.
// The whole weight slice (27 taps x CT3_BN x CT3_CI) is staged once per block; the input
// halo ((T + 1)^3 positions x CT3_CI channels, zeros outside the input and past C) of a
// channels-last input takes turns in two buffers, the next tile's copied (one tensor copy on
// sm_90a where C % 4 == 0, else cp.async) while this tile's MMAs run.
// Both are channel-contiguous, so that ldmatrix loads four 8 x 4 TF32 fragments in one
// instruction; the 16-byte chunks of a row are swizzled by the row's low 3 bits, which puts
// the 8 rows of each fragment on distinct banks. An NCDHW input (X_NCDHW) goes by input d
// planes into a ring of slots instead (CT3_RING), its fragments by four shared loads
// (ld_fragment_planes).
// The warpgroup-MMA path ("tf32" on sm_90a) takes the tile in two halves of 128 rows, all
// eight classes' accumulators at once, its MMAs grouped by input offset (below); the
// mma.sync path gives each warp two (d, h) rows and runs the classes one after another (rw
// fastest: the two classes that share an output row's sectors are written back to back).
// Both add each output's taps in the same order.
//
// PASSES = 1 feeds the staged float32 halo to the TF32 MMA as it is (the tensor cores read
// a TF32 operand's top 19 bits: truncation) and stages the weights TF32-rounded; on sm_90a
// (HALO_WGMMA) its steps are warpgroup MMAs that read the weights from shared memory.
// PASSES = 3 splits both operands at each fragment (mma_warp_step), with a step sum per tap
// added to the accumulator in float32.
#define CT3_TD 4
#define CT3_TH 4
#define CT3_TW 16
#define CT3_CI 32
#define CT3_BN 32
#define CT3_HH (CT3_TH + 1)
#define CT3_HW (CT3_TW + 1)
#define CT3_HPOS ((CT3_TD + 1) * CT3_HH * CT3_HW)
#define CT3_WFLOATS (27 * CT3_BN * CT3_CI)
#define CT3_HFLOATS (CT3_HPOS * CT3_CI)
// Floats from one halo buffer to the next: each starts 1024-byte aligned (the 128-byte
// swizzle's period, for the tensor memory accelerator's copies).
#define CT3_HSTRIDE ((CT3_HFLOATS + 255) / 256 * 256)
// The weights, two halo buffers, the scratch and the halo buffers' two mbarriers.
#define CT3_SHARED_FLOATS (CT3_WFLOATS + 2 * CT3_HSTRIDE + 8 * CT3_BN + 4)
// An NCDHW x (X_NCDHW) goes by input d planes into a ring of CT3_RING slots: a slot holds
// CT3_CI channels of CT3_HH rows x CT3_XW columns (a tensor copy's box; its rows multiples of
// 16 bytes), channel c's values CT3_XCS floats on. A tile reads CT3_TD + 1 planes. The
// reduction's order takes each 8 channels as 0, 2, 4, 6, 1, 3, 5, 7 (ct3_k_channel): an A
// fragment's lanes (tig, gid) read position gid of channels 2 tig and 2 tig + 1, whose
// planes start 8 tig and 8 tig + 4 banks on (CT3_XCS = 4 mod 32), 32 different banks.
#define CT3_XW 20
#define CT3_XCS (CT3_HH * CT3_XW)
#define CT3_SLOT (CT3_CI * CT3_XCS)
#define CT3_RING 9
// The weights, the ring, the scratch and the slots' mbarriers.
#define CT3_SHARED_FLOATS_NCDHW (CT3_WFLOATS + CT3_RING * CT3_SLOT + 8 * CT3_BN + 2 * CT3_RING)
static_assert(CT3_XW >= CT3_HW && CT3_XW % 4 == 0 && CT3_XCS % 32 == 4,
              "a plane's rows hold the halo's, channels 2 apart 8 banks apart");

// X_NCDHW: the input channel at reduction index k (within each 8: 0, 2, 4, 6, 1, 3, 5, 7),
// and the reduction index of channel c.
__device__ __forceinline__ constexpr int ct3_k_channel(int k) {
    return (k & ~7) | ((k & 3) << 1) | ((k >> 2) & 1);
}
__device__ __forceinline__ constexpr int ct3_channel_k(int c) {
    return (c & ~7) | ((c & 1) << 2) | ((c >> 1) & 3);
}
__device__ __forceinline__ constexpr bool ct3_orders_invert() {
    for (int c = 0; c < CT3_CI; ++c)
        if (ct3_k_channel(ct3_channel_k(c)) != c) return false;
    return true;
}
static_assert(ct3_orders_invert(), "the weights staged in the order the fragments read");
static_assert(CT3_CI == 32, "a row is 8 chunks of 16 bytes, swizzled by its low 3 bits");

// A compile-time int for conv_transpose3d_s2k3's generic lambdas: a class's rw, the channels
// a halo copy moves.
template <int V> struct CT3Int {
    static constexpr int value = V;
};

// What the epilogue does with y = conv + bias (the launcher's codes, conv_gemm.py).
#define CT3_SOFTMAX_SUMS 1  // partial[n, k, run] = (ref, sum of exp(clamp(y) - ref) over run)
#define CT3_SOFTMAX 2       // y[n, k, o] = exp(clamp(y) - ref) * factor[n, k]
#define CT3_CONV 3          // y[n, k, o] = y

// Float offset of value c of row `row` in a swizzled channel-contiguous buffer.
__device__ __forceinline__ int ct3_swizzled(int row, int c) {
    return row * CT3_CI + (((c >> 2) ^ (row & 7)) << 2) + (c & 3);
}

// Four 8 x 4 TF32 matrices (as ldmatrix's 8 x 8 b16 ones): lanes 8 q .. 8 q + 7 give the
// 16-byte rows of matrix q (at shared address a); r[q] is this lane's value (row gid, column
// tig) of matrix q.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const float* p) {
    ldmatrix_x4(r, (unsigned)__cvta_generic_to_shared(p));
}

// An 8 x 8 TF32 A fragment (mma_tf32's order) from a plane of channels CT3_XCS floats apart
// in ct3_k_channel's order, a = the shared address of this lane's value a[0] (position gid,
// reduction index tig: channel 2 tig): a[1] is 8 positions on, a[2] and a[3] (reduction
// index tig + 4: channel 2 tig + 1) a channel on.
__device__ __forceinline__ void ld_fragment_planes(unsigned (&r)[4], unsigned a) {
    asm volatile(
        "ld.shared.b32 %0, [%4];\n\t"
        "ld.shared.b32 %1, [%4+32];\n\t"
        "ld.shared.b32 %2, [%4+%5];\n\t"
        "ld.shared.b32 %3, [%4+%6];"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
        : "r"(a), "n"(4 * CT3_XCS), "n"(4 * CT3_XCS + 32));
}

#if HALO_WGMMA
// The shared-memory descriptor of 8 reduction values (from p) of a tap's CT3_BN weight rows:
// K-major, rows of 128 bytes swizzled as ct3_swizzled does (wgmma's 128-byte swizzle, whose
// pattern repeats every 8 rows: the tap's weights start 1024-byte aligned), 8-row groups 1024
// bytes apart (stride offset; the leading offset is unused with this swizzle).
__device__ __forceinline__ unsigned long long ct3_weight_desc(const float* p) {
    const unsigned long long a = (unsigned)__cvta_generic_to_shared(p);
    return ((a & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

// One tensor copy of `bytes` from the 5-D map at coordinates (c0, ..., c4) to dst, which
// completes the mbarrier `bar` (shared addresses).
__device__ __forceinline__ void tensor_copy_5d(unsigned dst, const void* map, int c0, int c1,
                                               int c2, int c3, int c4, unsigned bar,
                                               unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(bar), "r"(bytes) : "memory");
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];"
        :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1),
           "r"(c2), "r"(c3), "r"(c4), "r"(bar) : "memory");
}

// Thread 0 initializes `count` mbarriers at bars (one arrival a phase), ordered before the
// tensor copies that complete them; the caller's barrier publishes them to the block.
__device__ __forceinline__ void init_mbarriers(unsigned long long* bars, int count) {
    if (threadIdx.x != 0) return;
    for (int b = 0; b < count; ++b)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;"
                     :: "r"((unsigned)__cvta_generic_to_shared(bars + b)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Wait until the phase of the mbarrier at bar with this parity completes.
__device__ __forceinline__ void mbarrier_wait_parity(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n .reg .pred done;\n wait%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra wait%=;\n}"
        :: "r"(bar), "r"(parity) : "memory");
}
#endif

// torch.clamp with NaN kept (max.NaN / min.NaN return NaN if either operand is NaN).
__device__ __forceinline__ float clamp_nan_mm(float v, float lo, float hi) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(v), "f"(lo));
    asm("min.NaN.f32 %0, %0, %1;" : "+f"(r) : "f"(hi));
    return r;
}

// The block's sums of channels c = 8 j + 2 tig + e (c < 8 J) of a 256-thread block whose
// warps hold an m16n8 accumulator layout's per-thread sums[j][e]: over the lanes of one tig
// (shuffles), then over the 8 warps through scratch ([warp][8 J] floats), thread c calling
// write(c, sum); sums are reset to 0. The caller orders any earlier read of scratch before
// this call's writes.
template <int J, typename Write>
__device__ __forceinline__ void block_channel_sums(float (&sums)[J][2], float* scratch,
                                                   Write write) {
    static_assert(CONV_THREADS == 256, "8 warps");
    const int tid = threadIdx.x, warp = tid >> 5, gid = (tid & 31) >> 2, tig = tid & 3;
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float v = sums[j][e];
#pragma unroll
            for (int step = 4; step < 32; step <<= 1)
                v += __shfl_xor_sync(0xffffffffu, v, step);
            if (gid == 0) scratch[warp * 8 * J + 8 * j + 2 * tig + e] = v;
            sums[j][e] = 0.0f;
        }
    __syncthreads();
    if (tid < 8 * J) {
        float v = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) v += scratch[i * 8 * J + tid];
        write(tid, v);
    }
}

// exp(v - ref) for v within 30 of ref (ref = clamp_middle(lo, hi), the launcher's clamp
// width) or NaN, from the flush-to-zero ex2 instruction. v - ref is exact from |ref| = 60 on
// (the two are within a factor of 2) and within 2^-24 * 30 below; v * log2(e) - ref * log2(e)
// would carry the rounding of ref * log2(e), |ref| * 2^-24: a whole row's exponents off by
// over 128 from |ref| ~ 2^31.
__device__ __forceinline__ float exp_near(float v, float ref) {
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"((v - ref) * 1.4426950408889634f));
    return e;
}

// Per axis, output 2 m + r takes kernel index 1 of input m (r = 0), or 2 of input m and 0 of
// input m + 1 (r = 1): the kernel index of input offset o (0 or 1) in residue r.
__device__ __forceinline__ constexpr int ct3_kernel_index(int r, int o) {
    return r ? 2 - 2 * o : 1;
}

// The tap (kernel index kd * 9 + kh * 3 + kw) of input offset (a, b, c) in class (rd, rh,
// rw); ct3_tap(r, o) takes both as 3-bit numbers (d highest), o <= r bitwise.
__device__ __forceinline__ constexpr int ct3_tap(int rd, int rh, int rw, int a, int b, int c) {
    return ct3_kernel_index(rd, a) * 9 + ct3_kernel_index(rh, b) * 3 + ct3_kernel_index(rw, c);
}

__device__ __forceinline__ constexpr int ct3_tap(int r, int o) {
    return ct3_tap(r >> 2, (r >> 1) & 1, r & 1, o >> 2, (o >> 1) & 1, o & 1);
}

// Input offset o = (a, b, c) in halo positions.
__device__ __forceinline__ constexpr int ct3_offset_shift(int o) {
    return ((o >> 2) * CT3_HH + ((o >> 1) & 1)) * CT3_HW + (o & 1);
}

// Grid (blocks, ceil(K / CT3_BN)), CONV_THREADS threads, CT3_SHARED_FLOATS floats of dynamic
// shared memory (CT3_SHARED_FLOATS_NCDHW where X_NCDHW); blocks take the runs of
// SampleSegments (each sample's tiles in `splits` runs; a tile a run, splits = the tiles,
// where OUT stores: block_tile). x (N, D, H, W, C) channels-last,
// by_four: C % 4 == 0 and x 16-byte aligned (the halo is copied 16 bytes at a time); or
// where X_NCDHW, x (N, C, D, H, W) contiguous, its input planes copied into the ring (by_four
// unused); w (C, K, 3, 3, 3) as ConvTranspose3d keeps it; y (N, K, Do, Ho, Wo) contiguous, a
// plane Do * Ho * Wo below 2**31; pairs: Wo even and y 8-byte aligned (outputs stored in
// float2 pairs). bias may be null. tma: tmap is x's map, and the sm_90a build copies each
// halo with one tensor copy (dims C, W, H, D, N; box CT3_CI x (T + 1)^3 x 1; the 128-byte
// swizzle), or where X_NCDHW each input plane (dims W, H, D, C, N, W % 4 == 0; box CT3_XW x
// CT3_HH x 1 x CT3_CI x 1; no swizzle); else (and in the portable build) with cp.async. The
// clamp is [lo, hi]; ref is the softmax exponents' reference (clamp_middle's, a parameter so
// that it takes no register).
template <int PASSES, int OUT, bool X_NCDHW>
__global__ void __launch_bounds__(CONV_THREADS, 1)
conv_transpose3d_s2k3(const float* __restrict__ x, const float* __restrict__ w,
                      const float* __restrict__ bias, float* __restrict__ y,
                      float2* __restrict__ partial, const float* __restrict__ factor, int N,
                      int C, int D, int H, int W, int K, int Do, int Ho, int Wo, float lo,
                      float hi, float ref, int splits, int by_four, int pairs, int tma,
                      const __grid_constant__ TensorMap tmap) {
    constexpr bool SUMS = OUT == CT3_SOFTMAX_SUMS;
    // The warpgroup MMA path (below): a tile's rows in two halves, the first reading input
    // planes 0 to 2 of the tile, the second planes 2 to 4.
    constexpr bool HALVES = HALO_WGMMA && PASSES == 1;
    // CT3_CONV in TF32 rewrites the outputs of a channel whose weight holds a non-finite value
    // itself (after each tile's stores, below). In 3xTF32 that code slows the mma.sync main
    // loop (its registers and schedule): conv_nonfinite_weight_rows does it after
    // the kernel there.
    constexpr bool REWRITES = OUT == CT3_CONV && PASSES == 1;
    // Two halo buffers, or the ring of planes.
    constexpr int HALO_FLOATS = X_NCDHW ? CT3_RING * CT3_SLOT : 2 * CT3_HSTRIDE;
    // The halo's tensor copies (sm_90a; tmap made).
    const bool tensor_copies = HALO_WGMMA && tma;
    extern __shared__ float smem[];
    float* wt = smem;                         // [tap][o][c], swizzled rows of o
    // [buffer][hd][hh][hw][c], swizzled rows; X_NCDHW: [slot][c][hh][CT3_XW columns]
    float* halo = smem + CT3_WFLOATS;
    float* scratch = halo + HALO_FLOATS;      // [warp][channel] run sums
#if HALO_WGMMA
    // Per halo buffer or ring slot: the mbarrier its tensor copies complete.
    constexpr int BARRIERS = X_NCDHW ? CT3_RING : 2;
    unsigned long long* filled = reinterpret_cast<unsigned long long*>(scratch + 8 * CT3_BN);
#endif
    // ct3_weight_desc's swizzle is that of ct3_swizzled only from a 1024-byte aligned start,
    // and the A fragments' addresses (a_address) need 128-byte aligned rows.
    if ((__cvta_generic_to_shared(smem) & 1023) != 0) __trap();
    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int k0 = blockIdx.y * CT3_BN;
    const int tiles_w = (W + CT3_TW - 1) / CT3_TW, tiles_h = (H + CT3_TH - 1) / CT3_TH;
    const int tiles = ((D + CT3_TD - 1) / CT3_TD) * tiles_h * tiles_w;
    const SampleSegments segments{tiles, tiles, splits, (long long)N * splits};
    // CT3_CONV with HALVES (a tile a run, the blocks in a grid stride): where the blocks' last
    // round holds at most half as many tiles as there are blocks, its tiles go in halves
    // (bit s of `halves`: half s) to twice as many blocks, so that the busiest blocks finish
    // half a tile sooner. The tiles before `tail` go whole.
    // The block's i-th tile (SUMS: the tile after p's where i > 0) and its halves; false where
    // the block has none.
    auto block_tile = [&](unsigned i, TilePos& p, unsigned& halves) -> bool {
        halves = 3;
        if (SUMS) return i == 0 ? segments.first(p) : segments.next(p);
        const long long units = segments.runs, leftover = units % gridDim.x;
        const long long tail =
            HALVES && OUT == CT3_CONV && 2 * leftover <= gridDim.x ? units - leftover : units;
        const long long u = blockIdx.x + (long long)i * gridDim.x;
        if (u < tail || tail == units) return segments.open(u, p);
        if (u >= tail + gridDim.x) return false;
        halves = 1u << (blockIdx.x & 1);
        return segments.open(tail + blockIdx.x / 2, p);
    };
    TilePos pos;
    unsigned halves;
    if (!block_tile(0, pos, halves)) return;

    // The tile at t: its first base position.
    auto tile_origin = [&](int t, int& d0, int& h0, int& w0) {
        const int th = t / tiles_w, tw = t - th * tiles_w;
        const int td = th / tiles_h;
        d0 = td * CT3_TD;
        h0 = (th - td * tiles_h) * CT3_TH;
        w0 = tw * CT3_TW;
    };
    // The halo of the tile at t of sample n into buf: (T + 1)^3 positions from the tile's
    // first, zeros outside the input and past C; V channels a copy (4 where by_four), so that
    // the index splits by constants.
    auto copy_halo_by = [&](int n, int t, float* buf, auto v_constant) {
        constexpr unsigned V = decltype(v_constant)::value, PER_POS = CT3_CI / V;
        int d0, h0, w0;
        tile_origin(t, d0, h0, w0);
        for (unsigned i = tid; i < CT3_HPOS * PER_POS; i += CONV_THREADS) {
            const unsigned p = i / PER_POS, c = (i % PER_POS) * V;
            const unsigned hd = p / (CT3_HH * CT3_HW), rest = p % (CT3_HH * CT3_HW);
            const int d = d0 + hd, h = h0 + rest / CT3_HW, ww = w0 + rest % CT3_HW;
            const bool valid = c < C && d < D && h < H && ww < W;
            const float* src =
                valid ? x + ((((long long)n * D + d) * H + h) * W + ww) * C + c : x;
            copy_or_zero_async<V>(buf + ct3_swizzled(p, c), src, valid);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
#if HALO_WGMMA
    // One tensor copy of the halo (x's map, zeros outside the input and past C; its 128-byte
    // swizzle is ct3_swizzled from the buffer's 1024-byte aligned start), issued by thread 0,
    // completing the buffer's mbarrier with its bytes.
    auto copy_halo_tensor = [&](int n, int t, int b) {
        if (tid != 0) return;
        int d0, h0, w0;
        tile_origin(t, d0, h0, w0);
        tensor_copy_5d((unsigned)__cvta_generic_to_shared(halo + b * CT3_HSTRIDE), &tmap, 0,
                       w0, h0, d0, n, (unsigned)__cvta_generic_to_shared(filled + b),
                       CT3_HFLOATS * 4);
    };
    if (tensor_copies) {
        init_mbarriers(filled, BARRIERS);
        __syncthreads();  // initialized before any thread waits on them
    }
#endif
    // The halo of the tile at t of sample n into buffer b.
    auto copy_halo = [&](int n, int t, int b) {
#if HALO_WGMMA
        if (tensor_copies) {
            copy_halo_tensor(n, t, b);
            return;
        }
#endif
        if (by_four)
            copy_halo_by(n, t, halo + b * CT3_HSTRIDE, CT3Int<4>{});
        else
            copy_halo_by(n, t, halo + b * CT3_HSTRIDE, CT3Int<1>{});
    };
    // X_NCDHW: input plane p (0 to CT3_TD) of the block's i-th tile is the ring's plane
    // number (CT3_TD + 1) i + p: its slot that number modulo CT3_RING, the slot's use that
    // number over CT3_RING (the parity of its mbarrier's phase).
    auto ring_number = [](unsigned i, int p) { return i * (CT3_TD + 1) + p; };
    // Planes first to last of the tile at t of sample n, the block's i-th: CT3_CI channels
    // of CT3_HH rows x CT3_XW columns from (d0 + p, h0, w0) each, zeros outside the input and
    // past C. One tensor copy a plane (thread 0); else the rows' CT3_HW values by cp.async,
    // one commit group (none for first > last).
    auto copy_planes = [&](int n, int t, unsigned i, int first, int last) {
        int d0, h0, w0;
        tile_origin(t, d0, h0, w0);
#if HALO_WGMMA
        if (tensor_copies) {
            if (tid == 0)
                for (int p = first; p <= last; ++p) {
                    const unsigned slot = ring_number(i, p) % CT3_RING;
                    tensor_copy_5d((unsigned)__cvta_generic_to_shared(halo + slot * CT3_SLOT),
                                   &tmap, w0, h0, d0 + p, 0, n,
                                   (unsigned)__cvta_generic_to_shared(filled + slot),
                                   CT3_SLOT * 4);
                }
            return;
        }
#endif
        for (int p = first; p <= last; ++p) {
            float* const plane = halo + ring_number(i, p) % CT3_RING * CT3_SLOT;
            const int d = d0 + p;
            for (int e = tid; e < CT3_CI * CT3_HH * CT3_HW; e += CONV_THREADS) {
                const int c = e / (CT3_HH * CT3_HW), rest = e % (CT3_HH * CT3_HW);
                const int hh = rest / CT3_HW, hw = rest % CT3_HW;
                const int h = h0 + hh, ww = w0 + hw;
                const bool valid = c < C && d < D && h < H && ww < W;
                const float* src =
                    valid ? x + ((((long long)n * C + c) * D + d) * H + h) * W + ww : x;
                copy_or_zero_async<1>(plane + c * CT3_XCS + hh * CT3_XW + hw, src, valid);
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    // Wait for planes first to last of the block's i-th tile: their tensor copies (each
    // plane's mbarrier phase); cp.async copies are waited for before the barriers (below).
    auto await_planes = [&](unsigned i, int first, int last) {
#if HALO_WGMMA
        if (!tensor_copies) return;
        for (int p = first; p <= last; ++p) {
            const unsigned number = ring_number(i, p);
            mbarrier_wait_parity(
                (unsigned)__cvta_generic_to_shared(filled + number % CT3_RING),
                (number / CT3_RING) & 1);
        }
#endif
    };
    // Wait for buffer b's halo: its tensor copy's current phase (the parity bits of `phases`,
    // one a buffer, flip with each), or this thread's cp.async copies.
#if HALO_WGMMA
    unsigned phases = 0;
#endif
    auto await_halo = [&](int b) {
#if HALO_WGMMA
        if (tensor_copies) {
            mbarrier_wait_parity((unsigned)__cvta_generic_to_shared(filled + b),
                                 (phases >> b) & 1);
            phases ^= 1u << b;
            return;
        }
#endif
        asm volatile("cp.async.wait_all;" ::: "memory");
    };

    // The first tile's halo (X_NCDHW: its planes 0 to 3) is on its way while the weights are
    // staged.
    if (X_NCDHW)
        copy_planes(pos.n, pos.t, 0, 0, CT3_TD - 1);
    else
        copy_halo(pos.n, pos.t, 0);
    // CT3_STAGE loads in flight a thread, so that their memory latencies overlap.
    constexpr int CT3_STAGE = 12;
    static_assert(CT3_WFLOATS % (CT3_STAGE * CONV_THREADS) == 0, "whole rounds of loads");
    // CT3_CONV in TF32: the block's output channels k0 + o (bits o) whose weight holds a
    // non-finite value among this thread's (REWRITES, below).
    unsigned nonfinite = 0;
    for (int i0 = tid; i0 < CT3_WFLOATS; i0 += CT3_STAGE * CONV_THREADS) {
        float v[CT3_STAGE];
#pragma unroll
        for (int u = 0; u < CT3_STAGE; ++u) {
            const int i = i0 + u * CONV_THREADS;
            const int tap = i % 27, co = i / 27, o = co % CT3_BN, c = co / CT3_BN;
            v[u] = c < C && k0 + o < K ? __ldg(w + ((long long)c * K + k0 + o) * 27 + tap)
                                       : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < CT3_STAGE; ++u) {
            const int i = i0 + u * CONV_THREADS;
            const int tap = i % 27, co = i / 27, o = co % CT3_BN, c = co / CT3_BN;
            wt[tap * CT3_BN * CT3_CI + ct3_swizzled(o, X_NCDHW ? ct3_channel_k(c) : c)] =
                PASSES == 1 ? __uint_as_float(to_tf32(v[u])) : v[u];
            if (REWRITES) nonfinite |= (unsigned)!isfinite(v[u]) << o;
        }
    }
    // REWRITES: the block's output channels whose weight holds a non-finite value, from the
    // warps' in the scratch (unused by this epilogue otherwise).
    unsigned nonfinite_channels = 0;
    if (REWRITES) {
        unsigned* const warp_channels = reinterpret_cast<unsigned*>(scratch);
        nonfinite = __reduce_or_sync(0xffffffffu, nonfinite);
        if (lane == 0) warp_channels[warp] = nonfinite;
        __syncthreads();
#pragma unroll
        for (int v = 0; v < CONV_THREADS / 32; ++v) nonfinite_channels |= warp_channels[v];
    }
#if HALO_WGMMA
    // The weights, stored by the generic proxy, are read by wgmma through the async proxy.
    if (PASSES == 1) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif

    // This lane's channels k0 + 8 j + 2 tig + e: their bias, the accumulators' start.
    const ChannelBias bias_je = channel_bias(bias, k0, tig, K);
    // ldmatrix rows of this lane: matrix q = lane / 8, row lane % 8. A: position
    // row_position(row) + 8 (q & 1), chunk 2 ks + q / 2. B: output channel 8 (2 jp + q / 2)
    // + row, chunk 2 ks + (q & 1).
    const int q = lane >> 3, rr = lane & 7;
    // The halo position of this lane's A row in tile row `row` (a (d, h) row of CT3_TW base
    // positions), at input offset 0; X_NCDHW: the float offset of this lane's value a[0]
    // (position gid, channel 2 tig) in the row's input plane.
    auto row_position = [&](int row) {
        if (X_NCDHW) return 2 * tig * CT3_XCS + row % CT3_TH * CT3_XW + gid;
        return ((row / CT3_TH) * CT3_HH + row % CT3_TH) * CT3_HW + rr + 8 * (q & 1);
    };
    const long long plane = (long long)Do * Ho * Wo;
    float run_sums[4][2] = {};

    // X_NCDHW: the ring's schedule. The barrier that starts the block's i-th tile frees the
    // five slots of tile i - 1's planes: tile i's plane 4 and the next tile's planes 0 to 3
    // go there (CT3_RING = 9 slots). With HALVES the first half reads planes 0 to 2, so plane
    // 4 has that half's time to arrive.
    int buf = 0;
    unsigned tile = 0;  // X_NCDHW: the block's tiles so far
    for (bool more = true; more; ++tile) {
        TilePos next = pos;
        unsigned next_halves;
        if (X_NCDHW) {
            __syncthreads();  // the previous tile's planes read (and the weights in)
            more = block_tile(tile + 1, next, next_halves);
            copy_planes(pos.n, pos.t, tile, CT3_TD, CT3_TD);
            // (cp.async: an empty group where no tile follows, so that the wait below leaves
            // exactly the next tile's group in flight.)
            copy_planes(next.n, next.t, tile + 1, 0, more ? CT3_TD - 1 : -1);
            if (tensor_copies) {
                await_planes(tile, 0, HALVES ? 2 : CT3_TD);
            } else {
                // This thread's copies of the tile's planes in (all groups but the newest),
                // then all threads'.
                asm volatile("cp.async.wait_group 1;" ::: "memory");
                __syncthreads();
            }
        } else {
            await_halo(buf);
            __syncthreads();  // this tile's halo (and the weights) in; the other buffer free
            more = block_tile(tile + 1, next, next_halves);
            if (more) copy_halo(next.n, next.t, buf ^ 1);
        }
        const unsigned hb = (unsigned)__cvta_generic_to_shared(halo + buf * CT3_HSTRIDE);
        // The shared address of this lane's A fragments at step 0, for the row whose
        // row_position is `position`, at an input offset of `shift` halo positions: the lane's
        // halo row p, its 16-byte chunk (q / 2) ^ (p & 7). At step ks the chunk is (2 ks + q /
        // 2) ^ (p & 7), the step-0 chunk XOR 2 ks: in a row of 128 bytes from an aligned
        // start, the address XOR 32 ks.
        auto a_address = [&](int position, int shift) -> unsigned {
            const int p = position + shift;
            return hb + p * (CT3_CI * 4) + (((q >> 1) ^ (p & 7)) << 4);
        };
        // X_NCDHW: the shared address of input plane p (0 to CT3_TD) of this tile, and that
        // of this lane's a[0] for the row whose row_position is `position` at input offset o =
        // (a, b, c), `plane` the address of the row's input plane a on.
        auto plane_address = [&](int p) -> unsigned {
            return (unsigned)__cvta_generic_to_shared(halo) +
                   ring_number(tile, p) % CT3_RING * (CT3_SLOT * 4);
        };
        auto plane_a_address = [&](unsigned plane, int position, int o) -> unsigned {
            return plane + 4 * (position + ((o >> 1) & 1) * CT3_XW + (o & 1));
        };
        // The A fragment of reduction step ks (channels 8 ks to 8 ks + 7) from a_address's or
        // plane_a_address's a.
        auto a_fragment = [&](unsigned (&f)[4], unsigned a, int ks) {
            if (X_NCDHW)
                ld_fragment_planes(f, a + ks * (8 * CT3_XCS * 4));
            else
                ldmatrix_x4(f, a ^ (ks << 5));
        };
        int d0, h0, w0;
        tile_origin(pos.t, d0, h0, w0);
        // The factors of this lane's channels in this tile's sample.
        const ChannelBias f_je = channel_bias(
            OUT == CT3_SOFTMAX ? factor + (long long)pos.n * K : nullptr, k0, tig, K);
        // Output channel k0 + 2 tig of the sample; channel k0 + 8 j + 2 tig + e is 8 j + e
        // planes on.
        float* const y_lane = y + ((long long)pos.n * K + k0 + 2 * tig) * plane;

        // A warp's accumulators of one tile row (16 base positions x CT3_BN channels) start
        // at the bias.
        auto start = [&](float (&acc)[4][4]) {
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[j][e] = bias_je.b[j][e & 1];
        };
        // The epilogue of tile row `row`'s accumulators in class (rd, rh, rw), rw compiled in.
        // Where `pairs`, the class with rw = 0 leaves its results in `keep` and the class with
        // rw = 1 that follows stores both as one float2 a lane (outputs 2 m and 2 m + 1 of its
        // row): a warp's store then fills whole sectors.
        auto finish = [&](int rd, int rh, auto rw_constant, const float (&acc)[4][4], int row,
                          float (&keep)[4][4]) {
            constexpr int rw = decltype(rw_constant)::value;
            const int od = 2 * (d0 + row / CT3_TH) + rd, oh = 2 * (h0 + row % CT3_TH) + rh;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int ow = 2 * (w0 + gid + 8 * half) + rw;
                const bool inside = od < Do && oh < Ho && ow < Wo;
                // A pointer stepped along the channels, not 8 offsets held over the loops.
                float* yj = y_lane + (od * Ho + oh) * Wo + ow;
#pragma unroll
                for (int j = 0; j < 4; ++j, yj += 8 * plane)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int u = half * 2 + e;
                        float v = acc[j][u];
                        if (OUT != CT3_CONV) {
                            const float ex = exp_near(clamp_nan_mm(v, lo, hi), ref);
                            if (SUMS) {  // channels past K summed too, never stored
                                if (inside) run_sums[j][e] += ex;
                                continue;
                            }
                            v = ex * f_je.b[j][e];
                        }
                        float* const yk = e ? yj + plane : yj;
                        const bool valid = inside && k0 + j * 8 + 2 * tig + e < K;
                        if (rw == 0 && pairs) {
                            keep[j][u] = v;
                        } else if (rw == 1 && pairs) {
                            if (valid)  // ow - 1 is inside too
                                *reinterpret_cast<float2*>(yk - 1) =
                                    make_float2(keep[j][u], v);
                        } else if (valid) {
                            *yk = v;
                        }
                    }
            }
        };
#if HALO_WGMMA
        if (PASSES == 1) {
            // The warpgroup MMA (m64n32k8, A from the fragments in registers (a_fragment), B read
            // by the tensor cores from the staged weights). The tile goes in two halves of 128
            // rows, a warpgroup's 64 x 32 MMA tile each (d rows 2 s + warpgroup, a warp's h row),
            // with the accumulators of all eight classes (128 a thread). Per input offset (a, b, c)
            // in order, one commit group: the offset's A fragments, loaded once, times the weights
            // of every class r that reads it (r >= (a, b, c) bitwise, the tap of kernel index
            // 2 - 2 a per axis where r has 1, else 1), so that each class's taps go in the mma.sync
            // path's order (offsets ascending). A class's last offset is its own index: the class
            // is done with its group, and its epilogue runs while the next groups do (pass 2: a
            // pair of rw = 0 and 1 after the second's group). The A fragments of a tile row are
            // loaded once per offset, 8 rounds for its 27 taps: the shared-memory reads of the MMA
            // steps (fragments and weights) bound the tensor cores.
            static_assert(CT3_TD == 4 && CT3_TH == 4, "two halves of two warpgroups' h rows");
            const unsigned long long desc0 = ct3_weight_desc(wt);
            // The epilogue of class r, done; pass 2 stores a pair of rw = 0 and 1 after the
            // second is done.
            auto finish_class = [&](const float (&acc)[8][4][4], int r, int row,
                                    float (&keep)[4][4]) {
                const int rd = r >> 2, rh = (r >> 1) & 1;
                if (SUMS) {
                    if (r & 1)
                        finish(rd, rh, CT3Int<1>{}, acc[r], row, keep);
                    else
                        finish(rd, rh, CT3Int<0>{}, acc[r], row, keep);
                } else if (r & 1) {
                    finish(rd, rh, CT3Int<0>{}, acc[r - 1], row, keep);
                    finish(rd, rh, CT3Int<1>{}, acc[r], row, keep);
                }
            };
            auto by_offsets = [&](int row) {
                const int position = row_position(row);
                // X_NCDHW: the row's input planes at offsets a = 0 and 1.
                const unsigned planes[2] = {X_NCDHW ? plane_address(row / CT3_TH) : 0u,
                                            X_NCDHW ? plane_address(row / CT3_TH + 1) : 0u};
                float acc[8][4][4];
                unsigned sets[2][CT3_CI / 8][4];
#pragma unroll
                for (int r = 0; r < 8; ++r) start(acc[r]);
                auto load_offset = [&](int o, unsigned (&af)[CT3_CI / 8][4]) {
                    const unsigned a = X_NCDHW
                                           ? plane_a_address(planes[o >> 2], position, o)
                                           : a_address(position, ct3_offset_shift(o));
#pragma unroll
                    for (int ks = 0; ks < CT3_CI / 8; ++ks) a_fragment(af[ks], a, ks);
                };
                load_offset(0, sets[0]);
                float keep[4][4];
#pragma unroll
                for (int o = 0; o < 8; ++o) {
                    unsigned (&af)[CT3_CI / 8][4] = sets[o & 1];
                    pin_registers<8 * 16>(&acc[0][0][0]);
                    pin_registers<4 * CT3_CI / 8>(&af[0][0]);
                    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
                    for (int r = 0; r < 8; ++r) {
                        if ((r & o) != o) continue;
                        const unsigned long long desc =
                            desc0 + ct3_tap(r, o) * (CT3_BN * CT3_CI * 4 / 16);
#pragma unroll
                        for (int ks = 0; ks < CT3_CI / 8; ++ks)
                            wgmma_tf32(acc[r], af[ks], desc + 2 * ks);
                    }
                    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
                    if (o < 7) {
                        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
                        pin_registers<4 * CT3_CI / 8>(&sets[(o + 1) & 1][0][0]);
                        load_offset(o + 1, sets[(o + 1) & 1]);
                    } else {
                        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
                    }
                    // Group o - 1 is done, and group 7 after the last wait.
                    pin_registers<8 * 16>(&acc[0][0][0]);
                    if (o >= 1) finish_class(acc, o - 1, row, keep);
                    if (o == 7) finish_class(acc, 7, row, keep);
                }
            };
#pragma unroll 1
            for (int s = 0; s < CT3_TD / 2; ++s) {
                if (X_NCDHW && s == 1) await_planes(tile, 3, CT3_TD);  // the second half's
                if ((halves >> s) & 1) by_offsets((2 * s + (warp >> 2)) * CT3_TH + (warp & 3));
            }
        } else
#endif
        {
            // mma.sync: a warp's two tile rows 2 warp + i (MMA tiles i), class r = (rd, rh,
            // rw) after class: its taps' MMAs, then its epilogue; the classes in pairs of rw
            // = 0 and 1 (the two that share an output row's sectors), rw compiled in.
            // Run-time loops over the pairs and taps: unrolled, the compiler hoists fragment
            // loads across them past the registers.
            int a_pos[2];
            unsigned a_planes[2][2];  // X_NCDHW: row i's input planes at offsets a = 0, 1
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                a_pos[i] = row_position(2 * warp + i);
#pragma unroll
                for (int a = 0; a < 2; ++a)
                    a_planes[i][a] = X_NCDHW ? plane_address((2 * warp + i) / CT3_TH + a) : 0u;
            }
            float kept[2][4][4];
            auto run_class = [&](int rd, int rh, auto rw_constant) {
                constexpr int rw = decltype(rw_constant)::value;
                float acc[2][4][4], stage[2][4][4];
#pragma unroll
                for (int i = 0; i < 2; ++i) start(acc[i]);
                float (&sum)[2][4][4] = PASSES == 3 ? stage : acc;
                const int taps = (1 + rd) * (1 + rh) * (1 + rw);
#pragma unroll 1
                for (int t = 0; t < taps; ++t) {
                    // Tap t = (a, b, c) of the class, c fastest over the axes where r = 1.
                    const int c = rw ? t & 1 : 0, b = rh ? (t >> rw) & 1 : 0;
                    const int a = rd ? t >> (rw + rh) : 0;
                    const float* wtap = wt + ct3_tap(rd, rh, rw, a, b, c) * CT3_BN * CT3_CI;
                    const int shift = ct3_offset_shift(a * 4 + b * 2 + c);
#pragma unroll(PASSES == 1 ? CT3_CI / 8 : 1)
                    for (int ks = 0; ks < CT3_CI / 8; ++ks) {
                        float af[2][4], bf[4][2];
#pragma unroll
                        for (int i = 0; i < 2; ++i) {
                            unsigned f[4];
                            a_fragment(f,
                                       X_NCDHW ? plane_a_address(a ? a_planes[i][1]
                                                                   : a_planes[i][0],
                                                                 a_pos[i], a * 4 + b * 2 + c)
                                               : a_address(a_pos[i], shift),
                                       ks);
#pragma unroll
                            for (int e = 0; e < 4; ++e) af[i][e] = __uint_as_float(f[e]);
                        }
#pragma unroll
                        for (int jp = 0; jp < 2; ++jp) {
                            const int o = 8 * (2 * jp + (q >> 1)) + rr;
                            unsigned f[4];
                            ldmatrix_x4(f, wtap + o * CT3_CI + (((2 * ks + (q & 1)) ^ rr) << 2));
#pragma unroll
                            for (int e = 0; e < 4; ++e)
                                bf[2 * jp + e / 2][e & 1] = __uint_as_float(f[e]);
                        }
                        mma_warp_step<PASSES, PASSES == 1>(af, bf, sum, ks == 0);
                    }
                    if (PASSES == 3) flush_step_sums(acc, stage);
                }
#pragma unroll
                for (int i = 0; i < 2; ++i)
                    finish(rd, rh, rw_constant, acc[i], 2 * warp + i, kept[i]);
            };
#pragma unroll 1
            for (int step = 0; step < 4; ++step) {
                // Pass 2's warpgroups start two pairs apart, so that one's MMAs run while the
                // other's stores stall it (in the same order, both wait on the memory system
                // at once).
                const int rp = SUMS ? step : (step + 2 * (warp >> 2)) & 3;
                run_class(rp >> 1, rp & 1, CT3Int<0>{});
                run_class(rp >> 1, rp & 1, CT3Int<1>{});
            }
        }

        if (REWRITES && nonfinite_channels) {
            // The implicit GEMM multiplies the zeros past the input's far edge too (output
            // 2 D - 1 of output padding 1 reads input D), which a non-finite weight turns into
            // NaNs that the definition does not have: the tile's outputs of such channels are
            // rewritten by the definition (bias plus the products of real inputs), once all
            // are stored (the block's halves of it).
            __syncthreads();
            const long long xw = X_NCDHW ? 1 : C, xh = W * xw, xd = H * xh;
            const TransposedConvDefinition conv{
                x, w, C, K, D, H, W, Do, Ho, Wo, 3, 3, 3, 2, 2, 2, 1, 1, 1, 1, 1, 1,
                (long long)C * D * H * W, X_NCDHW ? D * xd : 1, xd, xh, xw};
            constexpr int OH = 2 * CT3_TH, OW = 2 * CT3_TW, OUTPUTS = 2 * CT3_TD * OH * OW;
            for (int e = tid; e < CT3_BN * OUTPUTS; e += CONV_THREADS) {
                const int j = e / OUTPUTS, r = e % OUTPUTS;
                const int od_tile = r / (OH * OW);  // half od_tile / CT3_TD's
                const int od = 2 * d0 + od_tile, oh = 2 * h0 + r / OW % OH, ow = 2 * w0 + r % OW;
                const bool mine = (nonfinite_channels >> j) & (halves >> (od_tile / CT3_TD)) & 1;
                if (!mine || k0 + j >= K || od >= Do || oh >= Ho || ow >= Wo) continue;
                const long long o = ((long long)od * Ho + oh) * Wo + ow;
                y[((long long)pos.n * K + k0 + j) * plane + o] =
                    conv.at(pos.n, k0 + j, o, bias ? bias[k0 + j] : 0.0f);
            }
        }
        if (SUMS && pos.t + 1 == pos.end) {
            // The run's sums; the next write of the scratch follows the next tile's barrier.
            block_channel_sums(run_sums, scratch, [&](int c, float s) {
                if (k0 + c < K)
                    partial[((long long)pos.n * K + k0 + c) * splits + pos.run] =
                        make_float2(ref, s);
            });
        }
        pos = next;
        halves = next_halves;
        buf ^= 1;
    }
}

// conv_transpose3d_s2k3_groups: conv_transpose3d_s2k3's problem (stride 2, 3 x 3 x 3 kernel,
// padding 1, at most 32 input channels) in 3xTF32 on the wgmma build, from a packed
// channels-last x (N, D, H, W, C) into a packed channels-last y (N, Do, Ho, Wo, K). Two
// weight planes (finite high part and residual) of all 27 taps take 432 KB for 64 output
// channels, twice the shared memory; a block instead computes the classes (rd, rh, rw) of one
// of four groups of at most 8 taps (ctg_group_classes: the class with 8 taps, two with 4,
// one with 4 and two with 2, the rest), whose weights it stages once (128 KB) for every tile
// it takes; the launcher shares the blocks among the groups by their cost. Output channels
// k0 = 64 blockIdx.y .. are wgmma's N (B from the staged weights, ct3_weight_desc's layout);
// a tile of 1 x 4 x 32 base positions is M, a warpgroup's 64 of
// them (rows 2 g and 2 g + 1) per MMA, each warp's 16 from the halo (2 x 5 x 33 positions x
// 32 channels by one tensor copy, ct3_swizzled rows, two buffers) by ldmatrix, split in
// registers by split_truncated (the weights and two halo buffers fill the shared memory: no
// room for the halo's split planes). Per tap a step sum: for each half
// of its 4 steps the residual products (the finite high weight times the residual x, the
// residual weight times the finite high x), then the high ones, into zeroed registers added
// to the accumulator in float32 once done, so that the tensor cores' truncating accumulation
// spans 12 products of one tap; the fragments load while the other half's MMAs run, and a
// finished class's stores go out in shares after the next class's first taps. The bias is the
// accumulators' start. A channel whose weight holds a non-finite value (its high part staged
// as zero) is left to the launcher, which rewrites it by the definition
// (conv_nonfinite_weight_rows).
#define CTG_THREADS 256
#define CTG_TH 4
#define CTG_TW 32
#define CTG_BN 64
static_assert(CTG_THREADS == 256, "8 warps (block_channel_sums)");
#define CTG_HH (CTG_TH + 1)
#define CTG_HW (CTG_TW + 1)
#define CTG_HFLOATS (2 * CTG_HH * CTG_HW * CT3_CI)
#define CTG_HSTRIDE ((CTG_HFLOATS + 255) / 256 * 256)
#define CTG_SLOTS 8
#define CTG_TAP_FLOATS (CTG_BN * CT3_CI)
#define CTG_PLANE_FLOATS (CTG_SLOTS * CTG_TAP_FLOATS)
// The two weight planes, two halo buffers, their mbarriers and the softmax sums' scratch (8
// warps x 64 channels; conv_gemm.py: _CTG_SHARED).
#define CTG_SHARED_FLOATS (2 * CTG_PLANE_FLOATS + 2 * CTG_HSTRIDE + 4 + 8 * CTG_BN)

// The classes (bit r = 4 rd + 2 rh + rw) of group g, and the taps of class r.
__device__ __forceinline__ constexpr unsigned ctg_group_classes(int g) {
    return g == 0 ? 0x80u : g == 1 ? 0x28u : g == 2 ? 0x46u : 0x11u;
}
__device__ __forceinline__ constexpr int ctg_class_taps(int r) {
    return (1 + ((r >> 2) & 1)) * (1 + ((r >> 1) & 1)) * (1 + (r & 1));
}
// The first weight slot of class r in its group (the group's classes in ascending order).
__device__ __forceinline__ constexpr int ctg_first_slot(unsigned classes, int r) {
    int s = 0;
    for (int c = 0; c < r; ++c)
        if ((classes >> c) & 1) s += ctg_class_taps(c);
    return s;
}
__device__ __forceinline__ constexpr bool ctg_groups_fit() {
    for (int g = 0; g < 4; ++g)
        if (ctg_first_slot(ctg_group_classes(g), 8) > CTG_SLOTS) return false;
    return (ctg_group_classes(0) | ctg_group_classes(1) | ctg_group_classes(2) |
            ctg_group_classes(3)) == 0xFFu;
}
static_assert(ctg_groups_fit(), "every class in one group, at most CTG_SLOTS taps a group");

#if HALO_WGMMA
#define WGMMA_D32(d)                                                                          \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]),           \
        "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),           \
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),           \
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]),           \
        "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])

// wgmma_tf32's step for 64 columns (8-column tiles j = 0 .. 7).
__device__ __forceinline__ void wgmma_tf32_n64(float (&d)[8][4], const unsigned (&a)[4],
                                               unsigned long long b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, 1, 1, 1;"
        : WGMMA_D32(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// The softmax sums of conv_transpose3d_s2k3_groups_softmax_sums: sums[(n * K + k) *
// gridDim.x + blockIdx.x] = (ref, the sum of exp(clamp(y) - ref) over the block's outputs of
// sample n, channel k), ref = clamp_middle(lo, hi); (-inf, 0) where the block has none.
struct CtgSums {
    float2* sums;
    float lo, hi;
};

// One group's classes over the block's tiles (conv_transpose3d_s2k3_groups; SUMS: also the
// softmax sums, CtgSums).
template <int G, bool SUMS>
__device__ __forceinline__ void ctg_tiles(const float* __restrict__ x,
                                          const float* __restrict__ w,
                                          const float* __restrict__ bias, float* __restrict__ y,
                                          int N, int C, int D, int H, int W, int K, int Do,
                                          int Ho, int Wo, int first, int count,
                                          const TensorMap& tmap, float* smem,
                                          const CtgSums& softmax) {
    constexpr unsigned CLASSES = ctg_group_classes(G);
    float* const wt = smem;  // [plane][slot][o][c]: plane 0 finite high parts, 1 residuals
    float* const halo = smem + 2 * CTG_PLANE_FLOATS;
    unsigned long long* const filled =
        reinterpret_cast<unsigned long long*>(halo + 2 * CTG_HSTRIDE);
    float* const scratch = halo + 2 * CTG_HSTRIDE + 4;  // [warp][channel]: SUMS
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gid = lane >> 2, tig = lane & 3, q = lane >> 3, rr = lane & 7;
    const int k0 = blockIdx.y * CTG_BN;
    const int tiles_w = (W + CTG_TW - 1) / CTG_TW, tiles_h = (H + CTG_TH - 1) / CTG_TH;
    const long long tiles = (long long)N * D * tiles_h * tiles_w;
    long long t = first;
    // SUMS: the block's pairs (-inf, 0) of samples from .. to - 1, of which it has no outputs.
    auto mark_empty = [&](int from, int to) {
        if (!SUMS || tid >= CTG_BN || k0 + tid >= K) return;
        for (int m = from; m < to; ++m)
            softmax.sums[((long long)m * K + k0 + tid) * gridDim.x + blockIdx.x] =
                make_float2(-INFINITY, 0.0f);
    };
    if (t >= tiles) {
        mark_empty(0, N);
        return;
    }
    // Tile t: sample n, input plane d, rows h0 .., columns w0 ...
    auto tile_origin = [&](long long t, int& n, int& d, int& h0, int& w0) {
        const long long rows = t / tiles_w;
        w0 = (int)(t - rows * tiles_w) * CTG_TW;
        const long long planes = rows / tiles_h;
        h0 = (int)(rows - planes * tiles_h) * CTG_TH;
        n = (int)(planes / D);
        d = (int)(planes - (long long)n * D);
    };
    auto copy_halo = [&](long long t, int b) {
        if (tid != 0) return;
        int n, d, h0, w0;
        tile_origin(t, n, d, h0, w0);
        tensor_copy_5d((unsigned)__cvta_generic_to_shared(halo + b * CTG_HSTRIDE), &tmap, 0,
                       w0, h0, d, n, (unsigned)__cvta_generic_to_shared(filled + b),
                       CTG_HFLOATS * 4);
    };
    init_mbarriers(filled, 2);
    __syncthreads();  // initialized before any thread waits on them
    copy_halo(t, 0);
    // The group's weights while the first halo arrives: slot s of class r holds the tap of
    // its input offset o (o within r bitwise, ascending), rows o = output channels.
    constexpr int SLOTS = ctg_first_slot(CLASSES, 8);
    for (int i = tid; i < SLOTS * CTG_TAP_FLOATS; i += CTG_THREADS) {
        const int slot = i / CTG_TAP_FLOATS, rest = i % CTG_TAP_FLOATS;
        const int o = rest / CT3_CI, c = rest % CT3_CI;
        int tap = 0;
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            if (!((CLASSES >> r) & 1)) continue;
            int s = ctg_first_slot(CLASSES, r);
#pragma unroll
            for (int off = 0; off < 8; ++off)
                if ((off & r) == off) {
                    if (s == slot) tap = ct3_tap(r, off);
                    ++s;
                }
        }
        const float v = c < C && k0 + o < K ? __ldg(w + ((long long)c * K + k0 + o) * 27 + tap)
                                            : 0.0f;
        unsigned hi, hi_finite, lo;
        split_operand<3>(v, hi, hi_finite, lo);
        const int at = slot * CTG_TAP_FLOATS + ct3_swizzled(o, c);
        wt[at] = __uint_as_float(hi_finite);
        wt[CTG_PLANE_FLOATS + at] = __uint_as_float(lo);
    }
    // The weights, stored by the generic proxy, are read by wgmma through the async proxy.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");

    const unsigned long long desc_high = ct3_weight_desc(wt),
                             desc_low = ct3_weight_desc(wt + CTG_PLANE_FLOATS);
    // This warp's 16 positions: tile row `row`, columns col0 ..; this lane's ldmatrix row
    // is position col0 + rr + 8 (q & 1), chunk q / 2 (step 0).
    const int row = 2 * (warp >> 2) + ((warp >> 1) & 1), col0 = 16 * (warp & 1);
    // A finished class's outputs wait in `pending` while the next class's taps run, a share
    // stored after each of its first taps' MMAs go out, so that the stores drain beside the
    // MMAs (stored at once, every warp waits on the memory system between its MMAs). Item i =
    // 8 h + j: position row gid + 8 h of the warp's 16, channels k0 + 8 j + 2 tig + (0, 1);
    // at[h] is the position's address in y at channel k0 + 2 tig; bit i of `inside`: item i
    // lies in y.
    float pending[16][2];
    float* at[2] = {y, y};
    unsigned inside = 0;
    // The share of tap `tap` of a class of TAPS taps: at least 4 items a tap, so that at most
    // four taps compare their index.
    auto store_share = [&](int tap, auto taps_constant) {
        constexpr int TAPS = decltype(taps_constant)::value;
        constexpr int SHARE = TAPS > 4 ? 4 : 16 / TAPS;
#pragma unroll
        for (int part = 0; part < 16 / SHARE; ++part) {
            if (tap != part) continue;
#pragma unroll
            for (int i = part * SHARE; i < (part + 1) * SHARE; ++i)
                if ((inside >> i) & 1)
                    *reinterpret_cast<float2*>(at[i >> 3] + 8 * (i & 7)) =
                        make_float2(pending[i][0], pending[i][1]);
        }
    };
    // The accumulators' start: the bias of this thread's channels (k0 + 8 j + 2 tig + e).
    float start[8][2];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int k = k0 + 8 * j + 2 * tig + e;
            start[j][e] = bias != nullptr && k < K ? __ldg(bias + k) : 0.0f;
        }
    // Bit j + 8 h: channel pair j of this thread inside y (K is even).
    unsigned channels = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j)
        if (k0 + 8 * j + 2 * tig < K) channels |= 0x101u << j;
    // SUMS: this thread's sums of sample sum_n's channels k0 + 8 j + 2 tig + e, summed over
    // the lanes of one tig, then the 8 warps, into the block's pair of each row when the
    // block's tiles move on to another sample and after its last tile: a block's tiles of
    // one sample follow each other, so each pair is written once, in a fixed order of sums.
    const float ref = clamp_middle(softmax.lo, softmax.hi);
    float sample_sums[8][2] = {};
    int sum_n = -1;
    auto flush_sums = [&]() {
        __syncthreads();  // the scratch read by the previous flush, whatever came between
        block_channel_sums(sample_sums, scratch, [&](int c, float v) {
            if (k0 + c < K)
                softmax.sums[((long long)sum_n * K + k0 + c) * gridDim.x + blockIdx.x] =
                    make_float2(ref, v);
        });
    };
    unsigned phases = 0;
    for (int buf = 0;; buf ^= 1) {
        mbarrier_wait_parity((unsigned)__cvta_generic_to_shared(filled + buf),
                             (phases >> buf) & 1);
        phases ^= 1u << buf;
        __syncthreads();  // the halo in, the weights staged; the other buffer read
        const long long next = t + count;
        const bool more = next < tiles;
        if (more) copy_halo(next, buf ^ 1);
        int n, d, h0, w0;
        tile_origin(t, n, d, h0, w0);
        if (SUMS && n != sum_n) {
            if (sum_n >= 0) flush_sums();
            mark_empty(sum_n + 1, n);
            sum_n = n;
        }
        const unsigned hb = (unsigned)__cvta_generic_to_shared(halo + buf * CTG_HSTRIDE);
        // The fragments of input offset o = (a, b, c) at reduction steps 2 half and 2 half +
        // 1, split (split_truncated): [s][0] high part, [1] finite high part, [2] residual.
        auto load_half = [&](int o, int half, unsigned (&f)[2][3][4]) {
            const int p = (((o >> 2) * CTG_HH + row + ((o >> 1) & 1)) * CTG_HW) + col0 + rr +
                          8 * (q & 1) + (o & 1);
            const unsigned a = hb + p * (CT3_CI * 4) + (((q >> 1) ^ (p & 7)) << 4);
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                unsigned raw[4];
                ldmatrix_x4(raw, a ^ ((2 * half + s) << 5));
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    split_truncated(raw[e], f[s][0][e], f[s][1][e], f[s][2][e]);
            }
        };
        // Steps 2 half and 2 half + 1 of the tap in `slot` into the step sum: the residual
        // products, then the high ones; one commit group.
        auto mma_half = [&](float (&step)[8][4], const unsigned (&f)[2][3][4], int slot,
                            int half) {
            const unsigned long long high = desc_high + slot * (CTG_TAP_FLOATS * 4 / 16),
                                     low = desc_low + slot * (CTG_TAP_FLOATS * 4 / 16);
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                wgmma_tf32_n64(step, f[s][2], high + 2 * (2 * half + s));
                wgmma_tf32_n64(step, f[s][1], low + 2 * (2 * half + s));
            }
#pragma unroll
            for (int s = 0; s < 2; ++s) wgmma_tf32_n64(step, f[s][0], high + 2 * (2 * half + s));
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        };
        // Class r of the group (compiled in: its taps and the stores per tap).
        auto run_class = [&](auto r_constant) {
            constexpr int r = decltype(r_constant)::value;
            if (!((CLASSES >> r) & 1)) return;
            constexpr int TAPS = ctg_class_taps(r);
            float acc[8][4], step[8][4];
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[j][e] = start[j][e & 1];
            // [half]: the fragments of steps 0 and 1, 2 and 3; each half's next load while the
            // other half's MMAs run.
            unsigned frags[2][2][3][4];
            load_half(0, 0, frags[0]);
            const int first_slot = ctg_first_slot(CLASSES, r);
            // A loop at run time: unrolled, the compiler hoists the offsets' addresses and
            // loads past the registers. The offsets are r's subsets in ascending order, the
            // next one (off - r) & r.
#pragma unroll 1
            for (int tap = 0, off = 0; tap < TAPS; ++tap, off = (off - r) & r) {
#pragma unroll
                for (int e = 0; e < 32; ++e) (&step[0][0])[e] = 0.0f;
                pin_registers<32>(&step[0][0]);
                pin_registers<24>(&frags[0][0][0][0]);
                mma_half(step, frags[0], first_slot + tap, 0);
                load_half(off, 1, frags[1]);
                pin_registers<24>(&frags[1][0][0][0]);
                mma_half(step, frags[1], first_slot + tap, 1);
                // The previous class's items, a share after each of this class's first taps.
                store_share(tap, CT3Int<TAPS>{});
                asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
                if (tap + 1 < TAPS) {
                    pin_registers<24>(&frags[0][0][0][0]);
                    load_half((off - r) & r, 0, frags[0]);
                }
                asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
                pin_registers<32>(&step[0][0]);
                pin_registers<24>(&frags[1][0][0][0]);
#pragma unroll
                for (int e = 0; e < 32; ++e) (&acc[0][0])[e] += (&step[0][0])[e];
            }
            // Class r's outputs become the pending items.
            const int rd = r >> 2, rh = (r >> 1) & 1, rw = r & 1;
            const int od = 2 * d + rd, oh = 2 * (h0 + row) + rh;
            inside = 0;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int ow = 2 * (w0 + col0 + gid + 8 * h) + rw;
                const bool in = od < Do && oh < Ho && ow < Wo;
                at[h] = y + (in ? ((((long long)n * Do + od) * Ho + oh) * Wo + ow) * K + k0 +
                                      2 * tig
                                : 0);
                if (in) inside |= channels & (0xFFu << (8 * h));
            }
#pragma unroll
            for (int i = 0; i < 16; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    pending[i][e] = acc[i & 7][2 * (i >> 3) + e];
                    if (SUMS && ((inside >> i) & 1))
                        sample_sums[i & 7][e] += exp_near(
                            clamp_nan_mm(pending[i][e], softmax.lo, softmax.hi), ref);
                }
        };
        run_class(CT3Int<0>{});
        run_class(CT3Int<1>{});
        run_class(CT3Int<2>{});
        run_class(CT3Int<3>{});
        run_class(CT3Int<4>{});
        run_class(CT3Int<5>{});
        run_class(CT3Int<6>{});
        run_class(CT3Int<7>{});
        if (!more) break;
        t = next;
    }
    // The last class's items.
    store_share(0, CT3Int<1>{});
    if (SUMS) {
        flush_sums();
        mark_empty(sum_n + 1, N);
    }
}

// The block's group of conv_transpose3d_s2k3_groups(_softmax_sums): blocks [0, b1) group 0,
// [b1, b2) group 1, [b2, b3) group 2, the rest group 3.
template <bool SUMS>
__device__ __forceinline__ void ctg_group_tiles(const float* __restrict__ x,
                                                const float* __restrict__ w,
                                                const float* __restrict__ bias,
                                                float* __restrict__ y, int N, int C, int D,
                                                int H, int W, int K, int Do, int Ho, int Wo,
                                                int b1, int b2, int b3, const TensorMap& tmap,
                                                const CtgSums& softmax) {
    extern __shared__ float smem[];
    if ((__cvta_generic_to_shared(smem) & 1023) != 0) __trap();
    const int b = blockIdx.x;
    if (b < b1)
        ctg_tiles<0, SUMS>(x, w, bias, y, N, C, D, H, W, K, Do, Ho, Wo, b, b1, tmap, smem,
                           softmax);
    else if (b < b2)
        ctg_tiles<1, SUMS>(x, w, bias, y, N, C, D, H, W, K, Do, Ho, Wo, b - b1, b2 - b1, tmap,
                           smem, softmax);
    else if (b < b3)
        ctg_tiles<2, SUMS>(x, w, bias, y, N, C, D, H, W, K, Do, Ho, Wo, b - b2, b3 - b2, tmap,
                           smem, softmax);
    else
        ctg_tiles<3, SUMS>(x, w, bias, y, N, C, D, H, W, K, Do, Ho, Wo, b - b3, gridDim.x - b3,
                           tmap, smem, softmax);
}
#endif

// Grid (blocks, ceil(K / 64)), CTG_THREADS threads, CTG_SHARED_FLOATS floats of dynamic
// shared memory; blocks [0, b1) compute group 0, [b1, b2) group 1, [b2, b3) group 2, [b3,
// gridDim.x) group 3, each group's blocks taking the tiles (sample, input plane, 4-row band,
// 32-column band; tiles_w fastest) in a grid stride. tmap: x's map (dims C, W, H, D, N; box
// 32 x 33 x 5 x 2 x 1; the 128-byte swizzle). K even and y 8-byte aligned (float2 stores).
// Compiled for the other targets too, where it traps.
__global__ void __launch_bounds__(CTG_THREADS, 1)
conv_transpose3d_s2k3_groups(const float* __restrict__ x, const float* __restrict__ w,
                             const float* __restrict__ bias, float* __restrict__ y, int N,
                             int C, int D, int H, int W, int K, int Do, int Ho, int Wo, int b1,
                             int b2, int b3, const __grid_constant__ TensorMap tmap) {
#if HALO_WGMMA
    ctg_group_tiles<false>(x, w, bias, y, N, C, D, H, W, K, Do, Ho, Wo, b1, b2, b3, tmap,
                           CtgSums{nullptr, 0.0f, 0.0f});
#else
    __trap();
#endif
}

// conv_transpose3d_s2k3_groups, and pipeline C's softmax sums of y (CtgSums), torch.clamp's
// NaN kept (clamp_nan_mm).
__global__ void __launch_bounds__(CTG_THREADS, 1)
conv_transpose3d_s2k3_groups_softmax_sums(const float* __restrict__ x,
                                          const float* __restrict__ w,
                                          const float* __restrict__ bias,
                                          float* __restrict__ y, int N, int C, int D, int H,
                                          int W, int K, int Do, int Ho, int Wo, int b1, int b2,
                                          int b3, float2* __restrict__ sums, float lo,
                                          float hi, const __grid_constant__ TensorMap tmap) {
#if HALO_WGMMA
    ctg_group_tiles<true>(x, w, bias, y, N, C, D, H, W, K, Do, Ho, Wo, b1, b2, b3, tmap,
                          CtgSums{sums, lo, hi});
#else
    __trap();
#endif
}

// The outputs of an output channel whose weight holds a non-finite value, by the definition
// (ForwardConvDefinition or TransposedConvDefinition, PyTorch's): a forward convolution's
// taps multiply the input or a padding zero (0 * inf and 0 * NaN are NaN), which an algorithm
// that skips the padding does not, and an FFT or Winograd algorithm spreads the value past
// its products; a transposed convolution's meet only real inputs, where an implicit GEMM (the
// sub-pixel kind's zeros past the input's far edge, cufused's conv_transpose3d_s2k3 in
// 3xTF32) or a forward convolution of the stride's spread input meets zeros too. Block (c,
// j) checks output channel c's weight and returns where it is finite; else it rewrites y[n,
// c, :] for the samples n = j, j + gridDim.y, ... as bias[c] plus the sum of the products,
// from x (N, C_in, Di, Hi, Wi) in element strides xn .. xw into y in element strides yn ..
// yw.
template <class Definition>
__global__ void conv_nonfinite_weight_rows(
    const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
    float* __restrict__ y, index_t N, int c_in_group, int c_out_group, int Di, int Hi, int Wi,
    int Do, int Ho, int Wo, int KD, int KH, int KW, int sd, int sh, int sw, int pd, int ph,
    int pw, int dd, int dh, int dw, index_t xn, index_t xc, index_t xd, index_t xh, index_t xw,
    index_t yn, index_t yc, index_t yd, index_t yh, index_t yw) {
    const Definition conv{x,  w,  c_in_group, c_out_group, Di, Hi, Wi, Do, Ho,
                          Wo, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd, dh, dw,
                          xn, xc, xd, xh, xw};
    const int c = blockIdx.x;
    if (conv.block_finite_weight(c)) return;
    const float b = bias ? bias[c] : 0.0f;
    const index_t plane = conv.plane();
    for (index_t n = blockIdx.y; n < N; n += gridDim.y) {
        PlaneWalk walk(threadIdx.x, blockDim.x, Ho, Wo);
        for (index_t o = threadIdx.x; o < plane; o += blockDim.x, walk.advance()) {
            const int3 p = walk.at;
            y[n * yn + c * yc + p.x * yd + p.y * yh + p.z * yw] = conv.at(n, c, p.x, p.y, p.z, b);
        }
    }
}

// flags[n] = 1 for each sample n of x (N, C, Di, Hi, Wi in element strides xn .. xw) that
// holds a non-finite value (flags zeroed before the launch). A thread a position, the channels
// in turn (a warp's loads of one channel coalesce along W).
__global__ void conv_nonfinite_input_scan(const float* __restrict__ x,
                                          unsigned* __restrict__ flags, index_t N, int C,
                                          int Di, int Hi, int Wi, index_t xn, index_t xc,
                                          index_t xd, index_t xh, index_t xw) {
    const index_t spatial = (index_t)Di * Hi * Wi, hw = (index_t)Hi * Wi;
    for (index_t i = (index_t)blockIdx.x * blockDim.x + threadIdx.x; i < N * spatial;
         i += (index_t)gridDim.x * blockDim.x) {
        const index_t n = i / spatial, p = i - n * spatial;
        const index_t d = p / hw, r = p - d * hw, h = r / Wi;
        const float* src = x + n * xn + d * xd + h * xh + (r - h * Wi) * xw;
        bool bad = false;
#pragma unroll 8
        for (int c = 0; c < C; ++c) bad |= !isfinite(src[c * xc]);
        if (bad) flags[n] = 1u;
    }
}

// After a convolution algorithm that spreads a non-finite input over its sample's outputs
// (cuDNN's FFT and Winograd plans: an infinity meets the other values of its tile or plane in
// the transform and comes back as NaN), every output of each sample that
// conv_nonfinite_input_scan flagged, by the definition (ForwardConvDefinition or
// TransposedConvDefinition) plus bias[c], into y (element strides yn .. yw). Block (i, j)
// takes the samples 256 i ... 256 i + 255 (then 256 gridDim.x further on): its threads read
// their flags at once (a call without a non-finite input costs a flag a sample), and for each
// flagged sample the block computes the channels j, j + gridDim.y, ....
template <class Definition>
__global__ void conv_nonfinite_input_samples(
    const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
    float* __restrict__ y, const unsigned* __restrict__ flags, index_t N, int C,
    int c_in_group, int c_out_group, int Di, int Hi, int Wi, int Do, int Ho, int Wo, int KD,
    int KH, int KW, int sd, int sh, int sw, int pd, int ph, int pw, int dd, int dh, int dw,
    index_t xn, index_t xc, index_t xd, index_t xh, index_t xw, index_t yn, index_t yc,
    index_t yd, index_t yh, index_t yw) {
    const Definition conv{x,  w,  c_in_group, c_out_group, Di, Hi, Wi, Do, Ho,
                          Wo, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd, dh, dw,
                          xn, xc, xd, xh, xw};
    __shared__ int flagged[256];
    __shared__ int count;
    const index_t plane = conv.plane();
    for (index_t first = (index_t)blockIdx.x * 256; first < N;
         first += (index_t)gridDim.x * 256) {
        if (threadIdx.x == 0) count = 0;
        __syncthreads();
        if (first + threadIdx.x < N && flags[first + threadIdx.x])
            flagged[atomicAdd(&count, 1)] = threadIdx.x;
        __syncthreads();
        for (int f = 0; f < count; ++f) {
            const index_t n = first + flagged[f];
            for (int c = blockIdx.y; c < C; c += gridDim.y) {
                const float b = bias ? bias[c] : 0.0f;
                PlaneWalk walk(threadIdx.x, blockDim.x, Ho, Wo);
                for (index_t o = threadIdx.x; o < plane; o += blockDim.x, walk.advance()) {
                    const int3 p = walk.at;
                    y[n * yn + c * yc + p.x * yd + p.y * yh + p.z * yw] =
                        conv.at(n, c, p.x, p.y, p.z, b);
                }
            }
        }
        __syncthreads();
    }
}
