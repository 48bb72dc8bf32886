// A stride-1 transposed 2-D convolution through discrete Fourier transforms (pipeline B's):
// y = crop(x (*) w), the full linear convolution of each input plane with each weight plane,
// cropped by the padding. Per sample n and frequency bin b the output's transform is the
// product of a (1 x C_in) row of the input's transforms with a (C_in x C_out) matrix of the
// weight's: a batched complex GEMM (cuBLAS) between the kernels here, which transform planes
// by their DFT matrices, a rows pass and a columns pass, each a small complex matrix product
// in shared memory (block_complex_matmul).
//
// The transforms are circular of size L1 x L2 = (H + KH - 1 - ph) x (W + KW - 1 - pw): the
// smallest size at which no wrapped-around value reaches the cropped output. The real input
// keeps the bins kx <= L2 / 2 (the others are their conjugates).
//
// Range: a DFT sums a whole plane, so its partial sums reach about H * W times the largest
// input where a direct sum stays near its output. The input and the weight are scaled by
// powers of two (exact) so that their largest finite magnitudes fall below 1; the output is
// scaled back. Non-finite values enter the transforms as 0, and the outputs that the
// definition gives another value are computed by it: those whose window holds a non-finite
// input, and every output of a channel whose weight holds one.
#include "common.cuh"

// Planes of one sample per block: the bins of P consecutive channels lie next to each other
// in the GEMM's layout, so a block's loads and stores of one bin are P * 8 contiguous bytes.
#define FFT_PLANES 8
// Each thread's tile of a block_complex_matmul: FFT_TILE_M rows by FFT_TILE_N columns.
#define FFT_TILE_M 4
#define FFT_TILE_N 2

// C_b = A_b B_b for the batches b of a block (complex; A_b M x K, B_b K x N; a batch is a
// plane, or a plane's group of rows): each thread takes tiles of FFT_TILE_M x FFT_TILE_N
// outputs, rows tm * FFT_TILE_M ..., columns tn, tn + tiles_n, ... (neighbouring tn read
// neighbouring columns of B). BATCH_FASTEST puts the batch in the lowest bits of the tile
// index (the lanes of a warp then take neighbouring batches of the same tile; else
// neighbouring tn of one batch). load_a(b, m, k) and load_b(b, k, n) give float2 values
// (REAL_A: A's imaginary parts are 0 and not read); store(b, m, n, re, im) takes each output
// within M x N (REAL_C: only the real part is formed, im is 0).
template <bool BATCH_FASTEST, bool REAL_A, bool REAL_C, class LoadA, class LoadB, class Store>
__device__ void block_complex_matmul(int batches, int M, int N, int K, LoadA load_a,
                                     LoadB load_b, Store store) {
    constexpr int TM = FFT_TILE_M, TN = FFT_TILE_N;
    const int tiles_m = (M + TM - 1) / TM, tiles_n = (N + TN - 1) / TN;
    const int tiles = tiles_m * tiles_n;
    for (int t = threadIdx.x; t < batches * tiles; t += blockDim.x) {
        const int p = BATCH_FASTEST ? t % batches : t / tiles;
        const int rest = BATCH_FASTEST ? t / batches : t - p * tiles;
        const int tm = rest / tiles_n, tn = rest - tm * tiles_n;
        int rows[TM], cols[TN];
#pragma unroll
        for (int i = 0; i < TM; ++i) rows[i] = min(tm * TM + i, M - 1);
#pragma unroll
        for (int j = 0; j < TN; ++j) cols[j] = min(tn + j * tiles_n, N - 1);
        float re[TM][TN] = {}, im[TM][TN] = {};
        for (int k = 0; k < K; ++k) {
            float2 a[TM], b[TN];
#pragma unroll
            for (int i = 0; i < TM; ++i) a[i] = load_a(p, rows[i], k);
#pragma unroll
            for (int j = 0; j < TN; ++j) b[j] = load_b(p, k, cols[j]);
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) {
                    re[i][j] = fmaf(a[i].x, b[j].x, re[i][j]);
                    if (!REAL_A) re[i][j] = fmaf(-a[i].y, b[j].y, re[i][j]);
                    if (!REAL_C) {
                        im[i][j] = fmaf(a[i].x, b[j].y, im[i][j]);
                        if (!REAL_A) im[i][j] = fmaf(a[i].y, b[j].x, im[i][j]);
                    }
                }
        }
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j)
                if (tm * TM + i < M && tn + j * tiles_n < N)
                    store(p, tm * TM + i, tn + j * tiles_n, re[i][j], im[i][j]);
    }
}

// v's TF32 operand parts: hi its first 10 mantissa bits, lo the residual v - hi (exact)
// with half a TF32 unit added to its bits, so that the MMA, which ignores the bits past
// TF32's, takes lo rounded (half away from zero) where it would take it truncated. Two
// instructions and an add, where rounding both by cvt.rna.tf32 costs seven (sm_90 runs it
// as integer instructions); a truncated lo would bias every product toward zero.
__device__ __forceinline__ void split_tf32(float v, unsigned& hi, unsigned& lo) {
    hi = __float_as_uint(v) & 0xffffe000u;
    lo = __float_as_uint(v - __uint_as_float(hi)) + 0x1000u;
}

// C = A B (real, M x N, reduction K) on tensor cores for a block: each warp takes items of
// one 16-row tile and WN 8-column tiles of C, mma.sync m16n8k8 steps with float32
// accumulation, each product as 3xTF32 (lo*hi + hi*lo + hi*hi, float32-grade). load_a(m, k)
// and load_b(k, n) are read at every k below K rounded up to 8 (they must give products of 0
// at k >= K), every m below M rounded up to 16 and every n below N rounded up to WN 8-column
// tiles (rows and columns past M and N reach only the outputs not stored: any value). Each
// element of C goes to store(row_at(m), n, v), row_at taken once per row and item.
template <int WN, class LoadA, class LoadB, class RowAt, class Store>
__device__ void block_mma(int M, int N, int K, LoadA load_a, LoadB load_b, RowAt row_at,
                          Store store) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int m_tiles = (M + 15) / 16, n_groups = (N + 8 * WN - 1) / (8 * WN);
    for (int item = threadIdx.x >> 5; item < m_tiles * n_groups; item += blockDim.x >> 5) {
        const int m0 = item / n_groups * 16 + g, n0 = (item % n_groups) * WN * 8;
        float acc[WN][4] = {};
        for (int k0 = 0; k0 < K; k0 += 8) {
            const int k = k0 + t;
            const float a[4] = {load_a(m0, k), load_a(m0 + 8, k), load_a(m0, k + 4),
                                load_a(m0 + 8, k + 4)};
            unsigned ah[4], al[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) split_tf32(a[e], ah[e], al[e]);
#pragma unroll
            for (int j = 0; j < WN; ++j) {
                unsigned bh[2], bl[2];
                split_tf32(load_b(k, n0 + 8 * j + g), bh[0], bl[0]);
                split_tf32(load_b(k + 4, n0 + 8 * j + g), bh[1], bl[1]);
                mma_tf32(acc[j], al, bh);
                mma_tf32(acc[j], ah, bl);
                mma_tf32(acc[j], ah, bh);
            }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int m = m0 + 8 * h;
            if (m >= M) continue;
            const auto row = row_at(m);
#pragma unroll
            for (int j = 0; j < WN; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int c = n0 + 8 * j + 2 * t + e;
                    if (c < N) store(row, c, acc[j][2 * h + e]);
                }
        }
    }
}

// roots[m] = e^(2 pi i m / L) for m < L, rounded once from double; the DFT matrices take
// their entries from it by the exact product of the indices mod L.
__device__ void fill_roots(float2* roots, int L) {
    for (int m = threadIdx.x; m < L; m += blockDim.x) {
        double s, c;
        sincospi(2.0 * m / L, &s, &c);
        roots[m] = make_float2((float)c, (float)s);
    }
}

// e^(sign 2 pi i m / L) from fill_roots' table.
__device__ __forceinline__ float2 unit_root(const float2* roots, int m, int L, float sign) {
    const float2 t = roots[m % L];
    return make_float2(t.x, sign * t.y);
}

// A plane buffer's stride in float2: at least `count`, 2 more than a multiple of 16, so that
// the P planes' same element falls in distinct banks for a half-warp (two neighbouring
// columns of each plane).
__device__ __forceinline__ int plane_stride(int count) { return (count + 15) / 16 * 16 + 2; }

// A columns pass of a block's P planes: for each column kx < F2,
// out(p, k, kx) = sum_{n < n_in} in(p, n, kx) e^(sign 2 pi i n k / L) (the rows n >= n_in
// are zero; rows past L wrap around, on the direct path only: column_factors), either as one
// product with the DFT matrix of the outputs k_first ... k_first + k_count - 1 (f1 = 1), or
// by the prime-factor algorithm over L = f1 * f2, f1 and f2 coprime (every output k < L): a
// DFT of length f2 over n2 for each n1, input row n = (f2 n1 + f1 n2) mod L, then one of
// length f1 over n1, output row k = (crt1 k1 + crt2 k2) mod L (crt1 = f2 (f2^-1 mod f1),
// crt2 = f1 (f1^-1 mod f2)), the stages' values in scratch: L (f1 + f2) products per column
// instead of n_in per output.
struct ColumnPass {
    int L, F2, n_in, k_first, k_count, f1, f2, crt1, crt2;
    float sign;

    // Shared float2 values of its tables: the DFT matrix (k_count x n_in) or those of f1 and f2.
    __device__ int table_size() const { return f1 > 1 ? f1 * f1 + f2 * f2 : k_count * n_in; }

    // The tables from fill_roots' table of L (after a barrier).
    __device__ void fill_tables(const float2* roots, float2* tables) const {
        if (f1 > 1) {
            for (int i = threadIdx.x; i < f1 * f1; i += blockDim.x)
                tables[i] = unit_root(roots, f2 * (i / f1) * (i % f1), L, sign);
            for (int i = threadIdx.x; i < f2 * f2; i += blockDim.x)
                tables[f1 * f1 + i] = unit_root(roots, f1 * (i / f2) * (i % f2), L, sign);
        } else {
            for (int i = threadIdx.x; i < k_count * n_in; i += blockDim.x)
                tables[i] = unit_root(roots, (i / n_in + k_first) * (i % n_in), L, sign);
        }
    }

    // The pass (after a barrier that follows fill_tables and the inputs' stores); scratch:
    // P planes of plane_stride(L * F2) float2 (the prime-factor stages only). load_in(p, n,
    // kx) for n < n_in; store_out(p, k, kx, re, im).
    template <class LoadIn, class StoreOut>
    __device__ void run(const float2* tables, float2* scratch, LoadIn load_in,
                        StoreOut store_out) const {
        constexpr int P = FFT_PLANES;
        if (f1 == 1) {
            block_complex_matmul<true, false, false>(
                P, k_count, F2, n_in, [&](int, int m, int n) { return tables[m * n_in + n]; },
                load_in, [&](int p, int m, int kx, float re, float im) {
                    store_out(p, m + k_first, kx, re, im);
                });
            return;
        }
        const float2* dft1 = tables;
        const float2* dft2 = tables + f1 * f1;
        const int ss = plane_stride(L * F2);
        // Stage 1, batch b = n1 * P + p: Y[k2][n1][kx] = sum_n2 in(n(n1, n2)) w2^(n2 k2).
        block_complex_matmul<false, false, false>(
            P * f1, f2, F2, f2, [&](int, int k2, int n2) { return dft2[k2 * f2 + n2]; },
            [&](int b, int n2, int kx) {
                int n = f2 * (b / P) + f1 * n2;
                if (n >= L) n -= L;
                return n < n_in ? load_in(b % P, n, kx) : make_float2(0.0f, 0.0f);
            },
            [&](int b, int k2, int kx, float re, float im) {
                scratch[(b % P) * ss + (k2 * f1 + b / P) * F2 + kx] = make_float2(re, im);
            });
        __syncthreads();
        // Stage 2, batch b = k2 * P + p: out(k(k1, k2)) = sum_n1 Y[k2][n1] w1^(n1 k1).
        block_complex_matmul<true, false, false>(
            P * f2, f1, F2, f1, [&](int, int k1, int n1) { return dft1[k1 * f1 + n1]; },
            [&](int b, int n1, int kx) {
                return scratch[(b % P) * ss + ((b / P) * f1 + n1) * F2 + kx];
            },
            [&](int b, int k1, int kx, float re, float im) {
                store_out(b % P, (crt1 * k1 + crt2 * (b / P)) % L, kx, re, im);
            });
    }
};

// v * 2^e: one multiply where 2^e is a normal float32, else ldexpf (the same value).
__device__ __forceinline__ float times_pow2(float v, int e) {
    return (e >= -126 && e <= 127) ? v * __int_as_float((e + 127) << 23) : ldexpf(v, e);
}

// Global loads in flight per thread while a block stages its operands in shared memory.
#define FFT_LOADS 16

// The exponent e for which the largest finite magnitude (its bits, from fft_conv_scan)
// times 2^-e is below 1 (0 for 0).
__device__ __forceinline__ int scale_exponent(unsigned bits) {
    int e;
    frexpf(__uint_as_float(bits), &e);
    return e;
}

// stats[0]: the bits of the largest finite |x|; stats[1]: of the largest finite |w|;
// stats[2 + c]: 1 where output channel c's weight holds a non-finite value; stats[2 + C_out +
// n]: 1 where sample n of x holds one (all zeroed before the launch). mask[n * H * W + q]: 1
// where x[n, :, q] holds a non-finite value in some channel. Blocks below x_blocks take a
// position (n, q) of x per thread; the others w (C_in, C_out, taps) in a grid-stride loop.
__global__ void fft_conv_scan(const float* __restrict__ x, const float* __restrict__ w,
                              unsigned char* __restrict__ mask, unsigned* __restrict__ stats,
                              index_t positions, int C, index_t hw, index_t w_count,
                              int c_out, int taps, int x_blocks) {
    float m = 0.0f;
    if ((int)blockIdx.x < x_blocks) {
        const index_t i = (index_t)blockIdx.x * blockDim.x + threadIdx.x;
        int bad = 0;
        if (i < positions) {
            const index_t n = i / hw;
            const float* src = x + n * C * hw + (i - n * hw);
            for (int c = 0; c < C; ++c) {
                const float v = src[c * hw];
                if (isfinite(v)) m = fmaxf(m, fabsf(v));
                else bad = 1;
            }
            mask[i] = (unsigned char)bad;
            if (bad) stats[2 + c_out + n] = 1u;
        }
    } else {
        const index_t step = (index_t)(gridDim.x - x_blocks) * blockDim.x;
        for (index_t i = (index_t)(blockIdx.x - x_blocks) * blockDim.x + threadIdx.x;
             i < w_count; i += step) {
            const float v = w[i];
            if (isfinite(v)) m = fmaxf(m, fabsf(v));
            else stats[2 + (i / taps) % c_out] = 1u;
        }
    }
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0 && m > 0.0f)
        atomicMax(&stats[(int)blockIdx.x < x_blocks ? 0 : 1], __float_as_uint(m));
}

// bins[b * bin_stride + s * s_stride + part * part_stride + c] = factor * the DFT of
// src[s, c] (planes of H x W, C a row, zero-padded to L1 x L2, non-finite values as 0, times
// 2^-e, e from stats[slot]) at bin b = ky * F2 + kx, F2 = L2 / 2 + 1: the input's (s a
// sample, c a channel) and the weight's (s an input channel, c an output channel)
// transforms. With parts = 3 each value is stored as its TF32 rounding hi at the parts other
// than lo_part and its residual v - hi at lo_part: the operands of one TF32 GEMM whose
// reduction concatenates x's (hi, lo, hi) with w's (hi, hi, lo), 3xTF32's three products.
// Block i takes s = i / groups and the planes
// c = (i % groups) * P ... + P - 1, groups = ceil(C / P). Shared memory: the roots, the rows'
// DFT matrix (W x F2) and the columns pass's tables (ColumnPass), the rows' transforms, and
// the planes (P x H x W), whose space the factored columns pass then takes as its scratch.
__global__ void fft_conv_plane_bins(const float* __restrict__ src,
                                    const unsigned* __restrict__ stats, int slot, float factor,
                                    float2* __restrict__ bins, int C, int H, int W,
                                    int L1, int L2, int parts, int lo_part, index_t bin_stride,
                                    index_t s_stride, index_t part_stride, int f1, int f2,
                                    int crt1, int crt2) {
    extern __shared__ float2 shared[];
    constexpr int P = FFT_PLANES;
    const int F2 = L2 / 2 + 1, hw = H * W, rs = plane_stride(H * F2);
    const ColumnPass columns{L1, F2, H, 0, L1, f1, f2, crt1, crt2, -1.0f};
    float2* roots1 = shared;                            // L1
    float2* roots2 = roots1 + L1;                       // L2
    float2* row_dft = roots2 + L2;                      // [j][kx]
    float2* col_tables = row_dft + W * F2;              // ColumnPass's
    float2* rows = col_tables + columns.table_size();   // [p][r][kx], planes rs apart
    // [p][r][j]; then the prime-factor stages' scratch
    float* planes = (float*)(rows + P * rs);
    const int groups = (C + P - 1) / P;
    const int s = blockIdx.x / groups, c0 = (blockIdx.x - s * groups) * P;
    const int e = scale_exponent(stats[slot]);
    fill_roots(roots1, L1);
    fill_roots(roots2, L2);
    __syncthreads();
    for (int i = threadIdx.x; i < W * F2; i += blockDim.x)
        row_dft[i] = unit_root(roots2, (i / F2) * (i % F2), L2, -1.0f);
    columns.fill_tables(roots1, col_tables);
    // The block's planes are contiguous in src: FFT_LOADS loads per thread in flight.
    const float* first = src + ((index_t)s * C + c0) * hw;
    const int count = min(P, C - c0) * hw;
    for (int i0 = threadIdx.x; i0 < P * hw; i0 += FFT_LOADS * blockDim.x) {
        float v[FFT_LOADS];
#pragma unroll
        for (int u = 0; u < FFT_LOADS; ++u) {
            const int i = i0 + u * blockDim.x;
            v[u] = i < count ? first[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < FFT_LOADS; ++u) {
            const int i = i0 + u * blockDim.x;
            if (i < P * hw) planes[i] = isfinite(v[u]) ? times_pow2(v[u], -e) : 0.0f;
        }
    }
    __syncthreads();
    // Rows: A[r][kx] = sum_j x[r][j] e^(-2 pi i j kx / L2).
    block_complex_matmul<false, true, false>(
        P, H, F2, W,
        [&](int p, int r, int j) { return make_float2(planes[(p * H + r) * W + j], 0.0f); },
        [&](int, int j, int kx) { return row_dft[j * F2 + kx]; },
        [&](int p, int r, int kx, float re, float im) {
            rows[p * rs + r * F2 + kx] = make_float2(re, im);
        });
    __syncthreads();
    // Columns: X[ky][kx] = sum_r e^(-2 pi i r ky / L1) A[r][kx].
    columns.run(
        col_tables, (float2*)planes,
        [&](int p, int r, int kx) { return rows[p * rs + r * F2 + kx]; },
        [&](int p, int ky, int kx, float re, float im) {
            if (c0 + p >= C) return;
            const float2 v = make_float2(re * factor, im * factor);
            float2* dst = bins + (ky * F2 + kx) * bin_stride + s * s_stride + c0 + p;
            if (parts == 1) {
                *dst = v;
                return;
            }
            const float2 hi =
                make_float2(__uint_as_float(to_tf32(v.x)), __uint_as_float(to_tf32(v.y)));
            for (int part = 0; part < parts; ++part)
                dst[part * part_stride] =
                    part == lo_part ? make_float2(v.x - hi.x, v.y - hi.y) : hi;
        });
}

// Whether output (oh, ow)'s window (the inputs that reach it) holds a position that mask (a
// sample's H x W marks) marks.
__device__ bool window_marked(const unsigned char* mask, const TransposedConvDefinition& conv,
                              int oh, int ow) {
    const int i1 = min(oh + conv.ph, conv.Hi - 1), j1 = min(ow + conv.pw, conv.Wi - 1);
    for (int i = max(oh + conv.ph - conv.KH + 1, 0); i <= i1; ++i)
        for (int j = max(ow + conv.pw - conv.KW + 1, 0); j <= j1; ++j)
            if (mask[i * conv.Wi + j]) return true;
    return false;
}

// The bins (L1 F2, N, C) of sample n's planes c0 ... c0 + FFT_PLANES - 1 (0 past C), each
// handed to take(p, b, ky, kx, v) for bin b = ky F2 + kx of plane c0 + p: thread t takes
// plane t % P and the bins t / P, t / P + blockDim.x / P, ..., FFT_LOADS loads in flight,
// (ky, kx) kept by steps of blockDim.x / P bins.
template <class Take>
__device__ void load_sample_bins(const float2* __restrict__ bins, int N, int C, int n, int c0,
                                 int L1, int F2, Take take) {
    constexpr int P = FFT_PLANES;
    const int p = threadIdx.x % P, step = blockDim.x / P, count = L1 * F2;
    const int step_ky = step / F2, step_kx = step - step_ky * F2;
    const bool in_range = c0 + p < C;
    const float2* src = bins + (index_t)n * C + c0 + p;
    const index_t bin_stride = (index_t)N * C;
    int ky = threadIdx.x / P / F2, kx = threadIdx.x / P - ky * F2;
    for (int b0 = threadIdx.x / P; b0 < count; b0 += FFT_LOADS * step) {
        float2 v[FFT_LOADS];
#pragma unroll
        for (int u = 0; u < FFT_LOADS; ++u) {
            const int b = b0 + u * step;
            v[u] = b < count && in_range ? src[b * bin_stride] : make_float2(0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < FFT_LOADS; ++u) {
            if (b0 + u * step < count) take(p, b0 + u * step, ky, kx, v[u]);
            ky += step_ky;
            kx += step_kx;
            if (kx >= F2) {
                kx -= F2;
                ++ky;
            }
        }
    }
}

// The outputs of a block's planes y[n, c0 ...] (c0 + FFT_PLANES - 1, below C) that meet a
// non-finite value, by the definition: those whose window holds an input that mask marks
// and every output of a channel whose weight holds a non-finite value (fft_conv_scan's stats
// and mask). Over the block's own stores of the transforms' values: its barrier orders them
// before these.
__device__ void definition_where_nonfinite(const TransposedConvDefinition& conv,
                                           const unsigned* stats, const unsigned char* mask,
                                           float* y, int n, int C, int c0) {
    constexpr int P = FFT_PLANES;
    const bool nonfinite_x = stats[2 + C + n] != 0;  // in this block's sample
    unsigned bad_weights = 0;  // bit p: plane c0 + p's weight holds a non-finite value
    for (int p = 0; p < P && c0 + p < C; ++p) bad_weights |= (stats[2 + c0 + p] != 0) << p;
    if (!bad_weights && !nonfinite_x) return;
    __syncthreads();
    const int hw = conv.Ho * conv.Wo;
    const unsigned char* marks = mask + (index_t)n * conv.Hi * conv.Wi;
    for (int i = threadIdx.x; i < P * hw; i += blockDim.x) {
        const int p = i / hw, o = i - p * hw, r = o / conv.Wo, j = o - r * conv.Wo;
        if (c0 + p < C &&
            (((bad_weights >> p) & 1) || (nonfinite_x && window_marked(marks, conv, r, j))))
            y[((index_t)n * C + c0 + p) * hw + o] = conv.at(n, c0 + p, o, 0.0f);
    }
}

// The shared memory of fft_conv_output_planes_mma (floats; planes of FFT_PLANES channels):
// T, the columns pass's DFT matrix as a real one, 2 Ho x K1 (K1 = 2 L1 rounded up to 8,
// zero past 2 L1); S, the bins as its B operand, K1 x F2 P (column kx P + p); O, the
// columns' results, P Ho x 2 F2 (the rows pass's A operand); R, the rows pass's matrix,
// K2 x Wo (K2 = 2 F2 rounded up to 8, zero past 2 F2). T and R, copied from
// fft_conv_output_tables', start with them. Row strides: A operands' 4 mod 8 floats and B
// operands' 8 mod 16, so that a warp's fragment loads meet 32 banks; B operands' rows hold
// block_mma's columns past N, and the buffer ends past the rows that it reads beyond M. Every
// offset is a multiple of 4 floats (16-byte copies).
#define FFT_MMA_WN_COLUMNS 6
#define FFT_MMA_WN_ROWS 5
struct OutputMmaLayout {
    int K1, K2, sT, sS, sO, sR, S, O, R, end;

    __device__ static int a_stride(int count) { return (count + 3) / 8 * 8 + 4; }
    __device__ static int b_stride(int count) { return (count + 7) / 16 * 16 + 8; }
    __device__ static int round_up(int v, int m) { return (v + m - 1) / m * m; }

    __device__ static OutputMmaLayout of(int L1, int L2, int Ho, int Wo) {
        OutputMmaLayout s;
        constexpr int P = FFT_PLANES;
        const int F2 = L2 / 2 + 1;
        s.K1 = round_up(2 * L1, 8);
        s.K2 = round_up(2 * F2, 8);
        s.sT = a_stride(s.K1);
        s.sS = b_stride(round_up(P * F2, 8 * FFT_MMA_WN_COLUMNS));
        s.sO = a_stride(2 * F2);
        s.sR = b_stride(round_up(Wo, 8 * FFT_MMA_WN_ROWS));
        s.S = 2 * Ho * s.sT;
        s.O = s.S + s.K1 * s.sS;
        // The rows pass reads the last row of O up to column K2 - 1: zeros past it.
        s.R = s.O + P * Ho * s.sO + max(s.K2 - s.sO, 0);
        s.end = max(max(s.R + s.K2 * s.sR, round_up(2 * Ho, 16) * s.sT),
                    s.O + (round_up(P * Ho, 16) - 1) * s.sO + s.K2);
        return s;
    }
};

// tables = fft_conv_output_planes_mma's T (2 Ho x sT) then R (K2 x sR), padding zeroed:
// T's 2 x 2 blocks (cos, -sin; sin, cos) of 2 pi ky (r + ph) / L1 at row 2 r, column 2 ky;
// R's rows 2 kx and 2 kx + 1 c_kx cos and -c_kx sin of 2 pi kx (j + pw) / L2 at column j,
// c_kx = 2 where the bin also stands for its conjugate, else 1. A grid-stride loop.
__global__ void fft_conv_output_tables(float* __restrict__ tables, int L1, int L2, int Ho,
                                       int Wo, int ph, int pw) {
    const OutputMmaLayout lay = OutputMmaLayout::of(L1, L2, Ho, Wo);
    const int F2 = L2 / 2 + 1;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < lay.S + lay.K2 * lay.sR;
         i += gridDim.x * blockDim.x) {
        float v = 0.0f;
        double sn, cs;
        if (i < lay.S) {
            const int row = i / lay.sT, col = i - row * lay.sT, r = row >> 1, ky = col >> 1;
            if (col < 2 * L1) {
                sincospi(2.0 * ((ky * (r + ph)) % L1) / L1, &sn, &cs);
                v = (float)((row & 1) == (col & 1) ? cs : (row & 1) ? sn : -sn);
            }
        } else {
            const int row = (i - lay.S) / lay.sR, j = i - lay.S - row * lay.sR, kx = row >> 1;
            if (kx < F2 && j < Wo) {
                sincospi(2.0 * ((kx * (j + pw)) % L2) / L2, &sn, &cs);
                const double twice = (kx == 0 || 2 * kx == L2) ? 1.0 : 2.0;
                v = (float)(twice * ((row & 1) ? -sn : cs));
            }
        }
        tables[i] = v;
    }
}

// y[n, c] (Ho x Wo, contiguous NCHW) = 2^(e_x + e_w) * the inverse DFT of bins[.][n][c] at
// the rows ph ... and columns pw ... of the L1 x L2 circular result; by the definition (conv,
// with x and w) the outputs whose window holds a non-finite input and those of a channel
// whose weight holds a non-finite value (fft_conv_scan's stats and mask). Blocks as
// fft_conv_plane_bins'. Shared memory: the roots, the rows' inverse DFT matrix at the output
// columns (F2 x Wo, each bin and its conjugate), the columns pass's tables (ColumnPass), the
// sample's bins of P planes, and their columns' inverse transforms at the output rows (or,
// factored, that pass's scratch, its results then in the bins' space).
__global__ void fft_conv_output_planes(
    const float* __restrict__ x, const float* __restrict__ w, const float2* __restrict__ bins,
    const unsigned* __restrict__ stats, const unsigned char* __restrict__ mask,
    float* __restrict__ y, int N, int C, int L1, int L2, int c_in_group, int c_out_group,
    int Di, int Hi, int Wi, int Do, int Ho, int Wo, int KD, int KH, int KW, int sd, int sh,
    int sw, int pd, int ph, int pw, int dd, int dh, int dw, index_t xn, index_t xc, index_t xd,
    index_t xh, index_t xw, int f1, int f2, int crt1, int crt2) {
    extern __shared__ float2 shared[];
    constexpr int P = FFT_PLANES;
    const TransposedConvDefinition conv{x,  w,  c_in_group, c_out_group, Di, Hi, Wi, Do, Ho,
                                        Wo, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd, dh, dw,
                                        xn, xc, xd, xh, xw};
    const int F2 = L2 / 2 + 1, ss = plane_stride(L1 * F2);
    // The columns' inverse at the output rows: k = r + ph.
    const ColumnPass columns{L1, F2, L1, ph, Ho, f1, f2, crt1, crt2, 1.0f};
    const bool factored = f1 > 1;
    const int cs = plane_stride((factored ? L1 : Ho) * F2);
    float2* roots1 = shared;                                 // L1
    float2* roots2 = roots1 + L1;                            // L2
    float2* row_idft = roots2 + L2;                          // [kx][j]
    float2* col_tables = row_idft + F2 * Wo;                 // ColumnPass's
    float2* spectrum = col_tables + columns.table_size();    // [p][ky][kx], planes ss apart
    float2* cols = spectrum + P * ss;                        // planes cs apart
    // The columns' results, [p][r][kx]: in cols, or after the prime-factor stages (cols
    // their scratch) in spectrum.
    float2* col_out = factored ? spectrum : cols;
    const int os = factored ? ss : cs;
    const int groups = (C + P - 1) / P;
    const int n = blockIdx.x / groups, c0 = (blockIdx.x - n * groups) * P;
    const int e = scale_exponent(stats[0]) + scale_exponent(stats[1]);
    fill_roots(roots1, L1);
    fill_roots(roots2, L2);
    __syncthreads();
    columns.fill_tables(roots1, col_tables);
    for (int i = threadIdx.x; i < F2 * Wo; i += blockDim.x) {
        const int kx = i / Wo;
        const float2 t = unit_root(roots2, kx * (i % Wo + pw), L2, 1.0f);
        // Each bin but 0 and (L2 even) L2 / 2 also stands for its conjugate.
        const float twice = (kx == 0 || 2 * kx == L2) ? 1.0f : 2.0f;
        row_idft[i] = make_float2(twice * t.x, twice * t.y);
    }
    load_sample_bins(bins, N, C, n, c0, L1, F2, [&](int p, int b, int, int, float2 v) {
        spectrum[p * ss + b] = v;
    });
    __syncthreads();
    // Columns at the output rows r: B[r][kx] = sum_ky e^(2 pi i ky (r + ph) / L1) X[ky][kx].
    columns.run(
        col_tables, cols, [&](int p, int ky, int kx) { return spectrum[p * ss + ky * F2 + kx]; },
        [&](int p, int k, int kx, float re, float im) {
            const int r = k - ph;
            if (r >= 0 && r < Ho) col_out[p * os + r * F2 + kx] = make_float2(re, im);
        });
    __syncthreads();
    // Rows, a real result: y[r][j] = Re sum_kx B[r][kx] c_kx e^(2 pi i kx (j + pw) / L2).
    block_complex_matmul<false, false, true>(
        P, Ho, Wo, F2, [&](int p, int r, int kx) { return col_out[p * os + r * F2 + kx]; },
        [&](int, int kx, int j) { return row_idft[kx * Wo + j]; },
        [&](int p, int r, int j, float re, float) {
            if (c0 + p < C) y[((index_t)n * C + c0 + p) * Ho * Wo + r * Wo + j] = times_pow2(re, e);
        });
    definition_where_nonfinite(conv, stats, mask, y, n, C, c0);
}

// fft_conv_output_planes on tensor cores (3xTF32, block_mma): each pass a real
// matrix product, the complex values as (re, im) pairs. Columns, for the block's P planes
// side by side: [B_re; B_im](2 Ho x F2 P) = T (2 Ho x 2 L1) [X_re; X_im]; rows: y (P Ho x Wo)
// = O R, O's rows (B_re, B_im) interleaved along kx. tables: fft_conv_output_tables'. Shared
// memory: OutputMmaLayout.
__global__ void fft_conv_output_planes_mma(
    const float* __restrict__ x, const float* __restrict__ w, const float2* __restrict__ bins,
    const float* __restrict__ tables, const unsigned* __restrict__ stats,
    const unsigned char* __restrict__ mask, float* __restrict__ y, int N, int C, int L1,
    int L2, int c_in_group, int c_out_group, int Di, int Hi, int Wi, int Do, int Ho, int Wo,
    int KD, int KH, int KW, int sd, int sh, int sw, int pd, int ph, int pw, int dd, int dh,
    int dw, index_t xn, index_t xc, index_t xd, index_t xh, index_t xw) {
    extern __shared__ float4 shared4[];
    constexpr int P = FFT_PLANES;
    const TransposedConvDefinition conv{x,  w,  c_in_group, c_out_group, Di, Hi, Wi, Do, Ho,
                                        Wo, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd, dh, dw,
                                        xn, xc, xd, xh, xw};
    const int F2 = L2 / 2 + 1;
    const OutputMmaLayout lay = OutputMmaLayout::of(L1, L2, Ho, Wo);
    float* T = (float*)shared4;
    float* S = T + lay.S;
    float* O = T + lay.O;
    float* R = T + lay.R;
    const int groups = (C + P - 1) / P;
    const int n = blockIdx.x / groups, c0 = (blockIdx.x - n * groups) * P;
    const int e = scale_exponent(stats[0]) + scale_exponent(stats[1]);
    {  // The tables, 16 bytes a copy.
        const float4* src = (const float4*)tables;
        for (int i = threadIdx.x; i < lay.S / 4; i += blockDim.x) shared4[i] = src[i];
        for (int i = threadIdx.x; i < lay.K2 * lay.sR / 4; i += blockDim.x)
            shared4[lay.R / 4 + i] = src[lay.S / 4 + i];
    }
    // The zeros: S's rows past 2 L1, O's columns past 2 F2 and its tail.
    const int o_pad = lay.sO - 2 * F2;
    for (int i = threadIdx.x; i < (lay.K1 - 2 * L1) * lay.sS; i += blockDim.x)
        S[2 * L1 * lay.sS + i] = 0.0f;
    for (int i = threadIdx.x; i < P * Ho * o_pad; i += blockDim.x)
        O[(i / o_pad) * lay.sO + 2 * F2 + i % o_pad] = 0.0f;
    for (int i = P * Ho * lay.sO + threadIdx.x; i < lay.R - lay.O; i += blockDim.x) O[i] = 0.0f;
    load_sample_bins(bins, N, C, n, c0, L1, F2, [&](int p, int, int ky, int kx, float2 v) {
        S[2 * ky * lay.sS + kx * P + p] = v.x;
        S[(2 * ky + 1) * lay.sS + kx * P + p] = v.y;
    });
    __syncthreads();
    // Columns at the output rows r: (B_re, B_im)[r][kx, p] into O[p Ho + r][2 kx + (0, 1)].
    const int o_plane = Ho * lay.sO;
    block_mma<FFT_MMA_WN_COLUMNS>(
        2 * Ho, P * F2, 2 * L1, [&](int m, int k) { return T[m * lay.sT + k]; },
        [&](int k, int c) { return S[k * lay.sS + c]; },
        [&](int m) { return (m >> 1) * lay.sO + (m & 1); },
        [&](int row, int c, float v) { O[row + (c % P) * o_plane + 2 * (c / P)] = v; });
    __syncthreads();
    // Rows, a real result: y[p, r][j], row m = p Ho + r.
    block_mma<FFT_MMA_WN_ROWS>(
        P * Ho, Wo, 2 * F2, [&](int m, int k) { return O[m * lay.sO + k]; },
        [&](int k, int j) { return R[k * lay.sR + j]; },
        [&](int m) {
            const int p = m / Ho;
            return c0 + p < C ? (((index_t)n * C + c0 + p) * Ho + m - p * Ho) * Wo
                              : (index_t)-1;
        },
        [&](index_t row, int j, float v) {
            if (row >= 0) y[row + j] = times_pow2(v, e);
        });
    definition_where_nonfinite(conv, stats, mask, y, n, C, c0);
}
