// Pooling kernels: plain N-d max/avg pooling, and the pipelines' fused
// "window extremum + normalization statistics" pass over a convolution output.
#include "common.cuh"

// visit(u, py, px) for the U pool positions first + u * STEP: their window row and column,
// each position clamped to the last one before p_end so that the loads of a position past
// the end stay in bounds (its values are not used). The fused passes issue every window load
// of the U positions here before using any.
template <int U, int STEP, class Visit>
__device__ __forceinline__ void window_positions(int first, int p_end, int Wo, float inv_wo,
                                                 Visit visit) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        int py, px;
        row_col(min(first + u * STEP, p_end - 1), Wo, inv_wo, py, px);
        visit(u, py, px);
    }
}

// Depth, row and column of position r of a plane of rows of ow values, oh rows a depth.
template <class I>
__device__ __forceinline__ void plane_position(I r, int oh, int ow, int& d, int& h, int& w) {
    w = (int)(r % ow);
    r /= ow;
    h = (int)(r % oh);
    d = (int)(r / oh);
}

// The input positions [lo, hi) of output o's window (stride s, padding p, size k) along an
// axis of n positions, in 64-bit arithmetic: o * s + k may pass 2**31.
__device__ __forceinline__ void window_inside(int o, int s, int p, int k, int n, int& lo,
                                              int& hi) {
    const long long first = (long long)o * s - p;
    lo = (int)min(max(first, 0LL), (long long)n);
    hi = (int)max(min(first + k, (long long)n), 0LL);
}

// Max or average pooling of a contiguous (N, C, D, H, W) tensor (2-D pooling runs with
// D = kd = sd = 1, pd = 0), one thread per output element in NCDHW order, written through
// output strides. Average pooling divides by the full window size (count_include_pad, floor
// mode). KD, KHW > 0 fix a window with stride == kernel and no padding at compile time, so its
// loads are unrolled and all in flight (pipeline C's 2x2x2 average pool); 0 means run time.
template <bool IS_MAX, int KD, int KHW>
__global__ void pool_nd(const float* __restrict__ x, float* __restrict__ y, index_t total, int C,
                        int id, int ih, int iw, int od, int oh, int ow,
                        int kd, int kh, int kw, int sd, int sh, int sw, int pd, int ph, int pw,
                        index_t ysn, index_t ysc, index_t ysd, index_t ysh, index_t ysw) {
    const index_t out_plane = (index_t)od * oh * ow;
    const bool narrow = out_plane < (1LL << 31);  // 32-bit divisions where the plane allows
    const float inv_count = 1.0f / ((float)kd * kh * kw);  // a window may pass 2**31 values
    for (index_t i = blockIdx.x * (index_t)blockDim.x + threadIdx.x; i < total;
         i += (index_t)gridDim.x * blockDim.x) {
        const index_t plane = i / out_plane;
        int d_o, h_o, w_o;
        if (narrow)
            plane_position<int>((int)(i - plane * out_plane), oh, ow, d_o, h_o, w_o);
        else
            plane_position<index_t>(i - plane * out_plane, oh, ow, d_o, h_o, w_o);
        const float* xp = x + plane * ((index_t)id * ih * iw);
        float acc = IS_MAX ? -INFINITY : 0.0f;
        if (KD > 0 && KHW > 0) {
            float v[KD > 0 && KHW > 0 ? KD * KHW * KHW : 1];
#pragma unroll
            for (int a = 0; a < (KD > 0 ? KD : 1); ++a)
#pragma unroll
                for (int b = 0; b < (KHW > 0 ? KHW : 1); ++b)
#pragma unroll
                    for (int c = 0; c < (KHW > 0 ? KHW : 1); ++c)
                        v[(a * KHW + b) * KHW + c] =
                            __ldg(xp + ((index_t)(d_o * KD + a) * ih + h_o * KHW + b) * iw
                                  + w_o * KHW + c);
#pragma unroll
            for (int j = 0; j < (KD > 0 && KHW > 0 ? KD * KHW * KHW : 1); ++j)
                acc = IS_MAX ? nan_max(acc, v[j]) : acc + v[j];
        } else {
            // Only the window's positions inside the input: padding adds -inf (max) or 0
            // (avg), and a window may be far larger than the input.
            int d0, d1, h0, h1, w0, w1;
            window_inside(d_o, sd, pd, kd, id, d0, d1);
            window_inside(h_o, sh, ph, kh, ih, h0, h1);
            window_inside(w_o, sw, pw, kw, iw, w0, w1);
            for (int d = d0; d < d1; ++d)
                for (int h = h0; h < h1; ++h) {
                    const float* row = xp + ((index_t)d * ih + h) * iw;
                    for (int w = w0; w < w1; ++w) {
                        const float v = __ldg(row + w);
                        acc = IS_MAX ? nan_max(acc, v) : acc + v;
                    }
                }
        }
        const index_t n = plane / C;
        const int ch = (int)(plane - n * C);
        y[n * ysn + ch * ysc + d_o * ysd + h_o * ysh + w_o * ysw] = IS_MAX ? acc : acc * inv_count;
    }
}

// Max or average pooling with a window of KD x 2 x 2 (KD = 1: 2-D pooling, D = 1), stride ==
// window, no padding, from contiguous NC(D)HW x into contiguous channels-last y
// (N, Do, Ho, Wo, C): pipeline C's pool writes its convolution's input in the layout of the
// cuDNN plan, with no separate transpose. A block pools 32 channels x 32 consecutive output
// positions through shared memory: lanes read 8-byte pairs along W (a warp reads 256
// contiguous bytes per window row) and write 32 channels (128 bytes) per position. Each thread
// has its 4 channels' KD * 2 loads in flight. Needs even W, x 8-byte aligned, C * Do * Ho * Wo
// < 2**31. Grid (ceil(S / 32), ceil(C / 32), min(N, 65535)), block (32, 8), S = Do * Ho * Wo.
template <bool IS_MAX, int KD>
__global__ void pool2_to_channels_last(const float* __restrict__ x, float* __restrict__ y,
                                       index_t N, int C, int D, int H, int W, int od, int oh,
                                       int ow) {
    __shared__ float tile[32][33];  // [channel][position]
    const int S = od * oh * ow;
    const int s0 = blockIdx.x * 32, c0 = blockIdx.y * 32;
    const int s = s0 + threadIdx.x;
    const int w_o = s % ow, h_o = (s / ow) % oh, d_o = s / (ow * oh);
    const index_t plane = (index_t)D * H * W;
    // 64-bit: the input plane D * H * W may pass 2**31 where C * S does not.
    const index_t offset = ((index_t)(d_o * KD) * H + 2 * h_o) * W + 2 * w_o;
    for (index_t n = blockIdx.z; n < N; n += gridDim.z) {
        float2 v[4][KD][2];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int c = c0 + threadIdx.y + 8 * k;
            const float* p = x + (n * C + min(c, C - 1)) * plane + offset;
#pragma unroll
            for (int a = 0; a < KD; ++a)
#pragma unroll
                for (int b = 0; b < 2; ++b)
                    v[k][a][b] = s < S ? __ldg(reinterpret_cast<const float2*>(
                                             p + (a * H + b) * (index_t)W))
                                       : make_float2(0.0f, 0.0f);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float acc = IS_MAX ? -INFINITY : 0.0f;
#pragma unroll
            for (int a = 0; a < KD; ++a)
#pragma unroll
                for (int b = 0; b < 2; ++b)
                    acc = IS_MAX ? nan_max(nan_max(acc, v[k][a][b].x), v[k][a][b].y)
                                 : acc + v[k][a][b].x + v[k][a][b].y;
            tile[threadIdx.y + 8 * k][threadIdx.x] = IS_MAX ? acc : acc * (1.0f / (4 * KD));
        }
        __syncthreads();
        const int c = c0 + threadIdx.x;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int j = threadIdx.y + 8 * k;
            if (c < C && s0 + j < S) y[(n * S + s0 + j) * C + c] = tile[threadIdx.x][j];
        }
        __syncthreads();
    }
}

// Per-thread statistics state of the fused passes for Q consecutive channels c0 .. c0 + Q - 1
// of sample n (Q = 4: the 16-byte channels-last kernels): each channel's bias, extremum sign
// (sign_a * sign_b < 0 takes the min as -max(-v); fmaxf drops NaN, which cannot matter: a NaN
// or inf in a statistics row makes that row's mean NaN, and with it every output the
// extremum feeds) and sums of d = y + bias - shift. `writer` threads store the shift of each
// statistics row that starts at one of their channels (see pool_extremum_stats).
// The sum of d is a double: the shift is one value of the row, so where the mean is small
// next to the spread (|mean| << |shift - mean|) a float32 sum drifts by |shift - mean| per
// value and its rounding would be large next to the mean (BatchNorm's running mean shows
// it). Values first meet in pairs in a float32 sum (`pending`), which rounds at their own
// scale (two equal values, such as the zeros of a strided transposed convolution, exactly),
// and flush() adds it to the double one: one conversion per two values. The sum of d*d is at
// least the variance's share of each value and keeps float32.
template <int Q>
struct ChannelStats {
    float b[Q], bs[Q], sgn[Q], s2[Q], pending[Q];
    double s1[Q];

    __device__ __forceinline__ ChannelStats(const float* __restrict__ y,
                                            const float* __restrict__ bias,
                                            const float* __restrict__ sign_a,
                                            const float* __restrict__ sign_b,
                                            float* __restrict__ shift_out, int c0, index_t n,
                                            index_t sn, index_t sc, int C, int shift_group,
                                            int shift_per_sample, bool writer) {
#pragma unroll
        for (int q = 0; q < Q; ++q) {
            const int c = c0 + q;
            b[q] = bias ? bias[c] : 0.0f;
            const int c_first = (c / shift_group) * shift_group;
            const float shift = finite_shift(y[(shift_per_sample ? n : 0) * sn + c_first * sc]
                                             + (bias ? bias[c_first] : 0.0f));
            if (writer && c == c_first && (shift_per_sample || n == 0))
                shift_out[shift_per_sample ? n * (C / shift_group) + c / shift_group
                                           : c / shift_group] = shift;
            sgn[q] = product_sign(sign_a ? sign_a[c] : 1.0f, sign_b ? sign_b[c] : 1.0f);
            bs[q] = b[q] - shift;
            s1[q] = 0.0;
            s2[q] = 0.0f;
            pending[q] = 0.0f;
        }
    }

    // A value of channel q into its sums (its d into the pending sum).
    __device__ __forceinline__ void take(float v, int q = 0) {
        const float d = v + bs[q];
        pending[q] += d;
        s2[q] = fmaf(d, d, s2[q]);
    }

    // The pending sums into the double ones.
    __device__ __forceinline__ void flush() {
#pragma unroll
        for (int q = 0; q < Q; ++q) {
            s1[q] += pending[q];
            pending[q] = 0.0f;
        }
    }

    // Values load(0) .. load(count - 1) outside the windows (a float for Q = 1, a float4 for
    // Q = 4) into the sums, flushed in pairs: the rows and columns the pool drops. A few values
    // per thread and sample (a small share of the plane): the loop stays rolled, which keeps
    // the kernels' code (and registers) small.
    template <class Load>
    __device__ __forceinline__ void take_run(int count, Load load) {
#pragma unroll 1
        for (int i = 0; i < count; ++i) {
            take(load(i));
            if (i & 1) flush();
        }
        if (count & 1) flush();
    }

    // Channel q's (sum d, sum d*d), pending values included.
    __device__ __forceinline__ double2 sums(int q = 0) const {
        return make_double2(s1[q] + pending[q], s2[q]);
    }

    // Four values of channel 0 into the sums, flushed.
    __device__ __forceinline__ void take_values(float4 v) {
        take(v.x);
        take(v.y);
        flush();
        take(v.z);
        take(v.w);
        flush();
    }

    // One value of each of 4 channels (Q = 4) into the sums.
    __device__ __forceinline__ void take(float4 v) {
        take(v.x, 0);
        take(v.y, 1);
        take(v.z, 2);
        take(v.w, 3);
    }

    // A window value: into the sums and the signed extremum e.
    __device__ __forceinline__ void take_window(float v, float& e, int q = 0) {
        take(v, q);
        e = fmaxf(e, sgn[q] * v);
    }

    __device__ __forceinline__ void take_window(float4 v, float (&e)[4]) {
        take_window(v.x, e[0], 0);
        take_window(v.y, e[1], 1);
        take_window(v.z, e[2], 2);
        take_window(v.w, e[3], 3);
    }

    // Channel q's window max (or min) of y + bias from its signed extremum.
    __device__ __forceinline__ float pooled(float e, int q = 0) const {
        return fmaf(sgn[q], e, b[q]);
    }
};

// The sum of column `col` of the 8 rows of (sum d, sum d*d) pairs that a block's 8 warps
// leave in shared memory.
template <int PITCH>
__device__ __forceinline__ double2 column_sum(const double2 (&red)[8][PITCH], int col) {
    double2 t = make_double2(0.0, 0.0);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        t.x += red[j][col].x;
        t.y += red[j][col].y;
    }
    return t;
}

// Write a (32, 8) block's staged window extrema, stage[q][ch] for positions base + q
// (q < SPAN) and channels c0 + ch (ch < channels), to the NCHW ext, position-contiguous per
// channel (coalesced); the barriers order the staging before and the next staging after it.
// (The window-row kernel keeps its own loop: this one's channel bound costs it a spill on
// sm_80.)
template <int SPAN, int ROWS, int PITCH>
__device__ __forceinline__ void write_staged_extrema(const float (&stage)[ROWS][PITCH],
                                                     float* __restrict__ ext, index_t n, int C,
                                                     int P, int c0, int channels, int base,
                                                     int p_end) {
    __syncthreads();
    for (int i = threadIdx.y * 32 + threadIdx.x; i < channels * SPAN; i += 256) {  // (32, 8)
        const int ch = i / SPAN, q = i - ch * SPAN;
        const int c = c0 + ch, p = base + q;
        if (c < C && p < p_end) ext[(n * C + c) * (index_t)P + p] = stage[q][ch];
    }
    __syncthreads();
}

// One read of a convolution output y (logical N, C, H, W; any strides) yields, for
// non-overlapping k x k pooling windows (stride == k, no padding):
//  * ext[n, c, ph, pw] (contiguous NCHW): the window max of y + bias[c], or the window min where
//    sign_a[c] * sign_b[c] < 0 (in-plane offsets, H * W * C per sample, are 32-bit). The
//    monotone per-channel affine that follows (GroupNorm * scale in pipeline A, BatchNorm +
//    tanh in pipeline B) maps it to the pooled result exactly;
//  * partial[(n * C + c) * splits + split] = (sum d, sum d*d) in double, d = y + bias - shift,
//    over every element of the plane, including the rows and columns that the pool drops.
// shift is the first element of the statistics row: y + bias at (shift_per_sample ? n : 0, first
// channel of c's group of shift_group channels, 0, 0), 0 where infinite (finite_shift), stored
// in shift_out[row]. It keeps the float32 sum of d*d accurate when |mean| >> std (see
// ChannelStats for the sum of d), and all partials of a row share it.
// ext_block is for the variants that may store ext channels-last (see below): the channels
// per block of that layout (blocked_channels_last); the others ignore it.
// Block (32, 8). NCHW: x lanes walk pooled columns (coalesced rows), y lanes channels.
// Channels-last: x lanes walk channels (coalesced), y lanes pooled positions.
// K > 0 fixes the window at compile time so that its K*K loads are unrolled and all in flight
// (K = 0: run-time k). VEC2 (NCHW, even K, 8-byte aligned rows) loads pairs of columns.
// All variants visit the samples last-first (sample_block_last_first); nhwc4 (pipeline B
// "tf32") reads y with evict-first loads (__ldcs: each value is read once), so that the L2
// keeps more of the 76 MB of extrema it writes for the GroupNorm pass (pipeline A's extrema,
// 32 MB, fit in the L2 anyway); nchw_bands reads plainly (see there).
template <bool CHANNELS_LAST, int K, bool VEC2>
__global__ void pool_extremum_stats(const float* __restrict__ y, const float* __restrict__ bias,
                                    const float* __restrict__ sign_a,
                                    const float* __restrict__ sign_b, float* __restrict__ ext,
                                    double2* __restrict__ partial, float* __restrict__ shift_out,
                                    int C, int H, int W, int k_runtime, int Ho, int Wo, int splits,
                                    int c_tiles, index_t sn, index_t sc, int sh, int sw,
                                    int shift_group, int shift_per_sample, int ext_block) {
    // U positions per iteration, all their window loads issued before any is used: enough
    // independent loads in flight to cover memory latency (a 2x2 window is only 4 values).
    constexpr int KK = K > 0 ? K * K : 1;
    constexpr int U = K == 2 ? 4 : (K == 4 && CHANNELS_LAST ? 2 : 1);
    constexpr int STEP = CHANNELS_LAST ? 8 : 32;
    constexpr int SPAN = U * STEP;
    __shared__ double2 red[8][33];
    __shared__ float stage[CHANNELS_LAST ? SPAN : 1][33];
    const int k = K > 0 ? K : k_runtime;
    const SampleBlock block = sample_block_last_first(splits, c_tiles);
    const int split = block.split, tile = block.tile;
    const index_t n = block.n;
    const int c = CHANNELS_LAST ? tile * 32 + threadIdx.x : tile * 8 + threadIdx.y;
    const bool active = c < C;
    const int cc = active ? c : C - 1;  // idle lanes of a partial tile read a valid channel
    const int lane = CHANNELS_LAST ? threadIdx.y : threadIdx.x;
    const int P = Ho * Wo;
    int p_begin, p_end;
    split_range(P, splits, split, p_begin, p_end);
    const float inv_wo = 1.0f / Wo;

    ChannelStats<1> stats(y, bias, sign_a, sign_b, shift_out, cc, n, sn, sc, C, shift_group,
                          shift_per_sample, active && split == 0 && lane == 0);
    const float* plane = y + n * sn + cc * sc;  // in-plane offsets are 32-bit
    for (int base = p_begin; base < p_end; base += SPAN) {  // same trip count for the block
        float v[U][KK];
        window_positions<U, STEP>(base + lane, p_end, Wo, inv_wo, [&](int u, int py, int px) {
            if (K > 0) {
#pragma unroll
                for (int a = 0; a < (K > 0 ? K : 1); ++a) {
                    const float* row = plane + (py * k + a) * sh + px * k * sw;
#pragma unroll
                    for (int j = 0; j < (K > 0 ? K : 1); j += (VEC2 ? 2 : 1)) {
                        if (VEC2) {
                            const float2 t = *reinterpret_cast<const float2*>(row + j);
                            v[u][a * K + j] = t.x;
                            v[u][a * K + j + 1] = t.y;
                        } else {
                            v[u][a * K + j] = row[j * sw];
                        }
                    }
                }
            }
        });
        float e_out[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int p = base + lane + u * STEP;
            float e = -INFINITY;
            if (active && p < p_end) {
                int py, px;
                row_col(p, Wo, inv_wo, py, px);
                const int h0 = py * k, w0 = px * k;
                if (K > 0) {
#pragma unroll
                    for (int j = 0; j < KK; ++j) {
                        stats.take_window(v[u][j], e);
                        if (j & 1) stats.flush();
                    }
                    if (KK & 1) stats.flush();
                } else {
                    for (int h = h0; h < h0 + k; ++h) {
                        for (int w = w0; w < w0 + k; ++w) {
                            stats.take_window(plane[h * sh + w * sw], e);
                            if ((w - w0) & 1) stats.flush();
                        }
                        stats.flush();
                    }
                }
                // The last window row / column also owns the rows / columns the pool drops.
                const int w1 = (px == Wo - 1) ? W : w0 + k;
                if (py == Ho - 1)
                    for (int h = h0 + k; h < H; ++h)
                        stats.take_run(w1 - w0,
                                       [&](int i) { return plane[h * sh + (w0 + i) * sw]; });
                if (px == Wo - 1)
                    for (int h = h0; h < h0 + k; ++h)
                        stats.take_run(W - w0 - k,
                                       [&](int i) { return plane[h * sh + (w0 + k + i) * sw]; });
                if (!CHANNELS_LAST) ext[(n * C + c) * (index_t)P + p] = stats.pooled(e);
            }
            e_out[u] = stats.pooled(e);
        }
        if (CHANNELS_LAST) {
            // Lanes hold 32 channels of one position: stage the block's SPAN x 32 extrema in
            // shared memory and write them position-contiguous (scattered 4-byte writes would
            // bottleneck the L2).
#pragma unroll
            for (int u = 0; u < U; ++u) stage[threadIdx.y + u * STEP][threadIdx.x] = e_out[u];
            write_staged_extrema<SPAN>(stage, ext, n, C, P, tile * 32, 32, base, p_end);
        }
    }
    if (CHANNELS_LAST) {  // reduce over the 8 position lanes of each channel column
        red[threadIdx.y][threadIdx.x] = stats.sums();
        __syncthreads();
        if (threadIdx.y == 0 && active)
            partial[(n * C + c) * splits + split] = column_sum(red, threadIdx.x);
    } else {  // a warp is one channel's 32 position lanes
        const double2 sums = warp_sum(stats.sums());
        if (threadIdx.x == 0 && active) partial[(n * C + c) * splits + split] = sums;
    }
}

// pool_extremum_stats for an NCHW y whose planes are contiguous (sh = W, sw = 1, sc = H * W),
// with K * W and H * W multiples of 4 and y 16-byte aligned. A warp owns one (n, c) plane
// (block (32, 8): 8 channels, grid N * ceil(C / 8) * splits, splits over window-row bands)
// and reads it in chunks of whole K-row bands: up to 32 * V float4 contiguous loads, all in
// flight (B's 34 x 34 plane is one chunk), every value into the statistics straight from the
// registers, the chunk staged in shared memory for the window extrema. The scalar kernel's
// position lanes issue one window (4 values for K = 2) per load round. The rows below the
// last band (H % K) only enter the statistics, in the last split. Same arguments and outputs
// as pool_extremum_stats (k_runtime, sc, sh, sw unused).
// 3 blocks per SM (80 registers) are set as a bound. Plain loads: with evict-first ones
// (__ldcs) the kernel spills at that bound as CuPy builds it (-ftz=true), and B and A "ieee"
// took the same time either way.
template <int K>
__global__ void __launch_bounds__(256, 3) pool_extremum_stats_nchw_bands(
        const float* __restrict__ y, const float* __restrict__ bias,
        const float* __restrict__ sign_a, const float* __restrict__ sign_b,
        float* __restrict__ ext, double2* __restrict__ partial, float* __restrict__ shift_out,
        int C, int H, int W, int k_runtime, int Ho, int Wo, int splits, int c_tiles, index_t sn,
        index_t sc, int sh, int sw, int shift_group, int shift_per_sample, int ext_block) {
    constexpr int V = 10;  // float4 per lane and chunk: 40 registers, 5 KB of shared memory
    __shared__ float4 chunk_buf[8][32 * V];
    const SampleBlock block = sample_block_last_first(splits, c_tiles);
    const int split = block.split, tile = block.tile;
    const index_t n = block.n;
    const int lane = threadIdx.x, warp = threadIdx.y;
    const int c = tile * 8 + warp;
    if (c >= C) return;  // no block-wide barriers below
    const int plane_size = H * W;
    const float* plane = y + n * sn + (index_t)c * plane_size;
    const int band = K * W;
    const int bands_per_chunk = 32 * V * 4 / band;
    int b_begin, b_end;
    split_range(Ho, splits, split, b_begin, b_end);
    // A chunk's loads go out one chunk ahead: the first before the channel's parameters and
    // shift are loaded, the next before the current chunk's windows are taken, so that
    // neither waits a memory latency of its own.
    float4 v[V];
    const auto load_chunk = [&](int b0) {
        const int n_vec = min(bands_per_chunk, b_end - b0) * band / 4;
        const float4* src = reinterpret_cast<const float4*>(plane + b0 * band);
#pragma unroll
        for (int i = 0; i < V; ++i)
            if (lane + 32 * i < n_vec) v[i] = src[lane + 32 * i];
    };
    if (b_begin < b_end) load_chunk(b_begin);
    ChannelStats<1> stats(y, bias, sign_a, sign_b, shift_out, c, n, sn, plane_size, C,
                          shift_group, shift_per_sample, split == 0 && lane == 0);
    float* ext_plane = ext + (n * C + c) * (index_t)(Ho * Wo);
    const float* buf = reinterpret_cast<const float*>(chunk_buf[warp]);
    const float inv_wo = 1.0f / Wo;
    // For K = 2, a lane's windows j = lane, lane + 32, ... of a chunk: band bb, column px,
    // stepped by (32 / Wo, 32 % Wo) with a carry instead of a division per window, and read
    // as two 8-byte rows (fewer instructions per window for B; for K = 4 the same loop makes
    // pipeline A slower, so K = 4 keeps the division).
    const int first_b = quotient(lane, Wo, inv_wo), first_p = lane - first_b * Wo;
    const int step_b = quotient(32, Wo, inv_wo), step_p = 32 - step_b * Wo;
    for (int b0 = b_begin; b0 < b_end; b0 += bands_per_chunk) {
        const int nb = min(bands_per_chunk, b_end - b0);
        const int n_vec = nb * band / 4;
#pragma unroll
        for (int i = 0; i < V; ++i) {
            if (lane + 32 * i < n_vec) {
                stats.take_values(v[i]);
                chunk_buf[warp][lane + 32 * i] = v[i];
            }
        }
        __syncwarp();
        if (b0 + bands_per_chunk < b_end) load_chunk(b0 + bands_per_chunk);
        const float sgn = stats.sgn[0];
        if (K == 2) {
            int bb = first_b, px = first_p;
            for (int j = lane; j < nb * Wo; j += 32) {
                const float* win = buf + bb * 2 * W + px * 2;  // W is even (K * W % 4 == 0)
                const float2 r0 = *reinterpret_cast<const float2*>(win);
                const float2 r1 = *reinterpret_cast<const float2*>(win + W);
                const float e = fmaxf(fmaxf(sgn * r0.x, sgn * r0.y),
                                      fmaxf(sgn * r1.x, sgn * r1.y));
                ext_plane[(b0 + bb) * Wo + px] = stats.pooled(e);
                bb += step_b;
                px += step_p;
                if (px >= Wo) {
                    px -= Wo;
                    ++bb;
                }
            }
        } else {
            for (int j = lane; j < nb * Wo; j += 32) {
                const int bb = quotient(j, Wo, inv_wo), px = j - bb * Wo;
                float e = -INFINITY;
#pragma unroll
                for (int a = 0; a < K; ++a)
#pragma unroll
                    for (int i = 0; i < K; ++i)
                        e = fmaxf(e, sgn * buf[(bb * K + a) * W + px * K + i]);
                ext_plane[(b0 + bb) * Wo + px] = stats.pooled(e);
            }
        }
        __syncwarp();  // the next chunk overwrites the buffer
    }
    if (split == splits - 1)
        stats.take_run((max(plane_size - Ho * band - lane, 0) + 31) / 32,
                       [&](int i) { return plane[Ho * band + lane + 32 * i]; });
    const double2 sums = warp_sum(stats.sums());
    if (lane == 0) partial[(n * C + c) * splits + split] = sums;
}

// pool_extremum_stats for a channels-last y with 16-byte loads: a thread owns 4 consecutive
// channels (C % 4 == 0; y, its position strides and sn 16-byte aligned), so one load
// instruction moves 4 values where the scalar kernel needs 4 (its channels-last pass is
// issue-bound, not bandwidth-bound). Block (32, 8) per (n, 32-channel tile, split): bits 0-2
// of threadIdx.x pick the channel quad, the other bits and threadIdx.y one of 32 position
// lanes. Same arguments and outputs as pool_extremum_stats (k_runtime and sc unused), except
// that with EXT_CHANNELS_LAST ext is contiguous channels-last in blocks of ext_block channels
// (blocked_channels_last; ext_block = C: (N, Ho, Wo, C)), ext_block % 4 == 0, 16-byte
// aligned: each thread stores its 4 pooled values as one float4, with no staging barrier
// (pipeline B's GroupNorm reads it so, in place). At most 128 registers: two blocks per SM,
// so one block's staging barrier does not idle the SM.
template <int K, bool EXT_CHANNELS_LAST>
__global__ void __launch_bounds__(256, 2) pool_extremum_stats_nhwc4(const float* __restrict__ y,
                                          const float* __restrict__ bias,
                                          const float* __restrict__ sign_a,
                                          const float* __restrict__ sign_b,
                                          float* __restrict__ ext, double2* __restrict__ partial,
                                          float* __restrict__ shift_out, int C, int H, int W,
                                          int k_runtime, int Ho, int Wo, int splits, int c_tiles,
                                          index_t sn, index_t sc, int sh, int sw,
                                          int shift_group, int shift_per_sample, int ext_block) {
    constexpr int KK = K * K;
    // Positions per thread and iteration: 8-16 loads of 16 bytes in flight. Without the
    // staging buffer 4 fit in 128 registers, and 4 are faster than 2 or 3 for B.
    constexpr int U = K == 2 ? (EXT_CHANNELS_LAST ? 4 : 2) : 1;
    constexpr int STEP = 32;
    constexpr int SPAN = U * STEP;
    __shared__ double2 red[8][33];
    __shared__ float stage[EXT_CHANNELS_LAST ? 1 : SPAN][33];
    const SampleBlock block = sample_block_last_first(splits, c_tiles);
    const int split = block.split, tile = block.tile;
    const index_t n = block.n;
    const int quad = threadIdx.x & 7;
    const int lane = (threadIdx.x >> 3) + 4 * threadIdx.y;
    const int c0 = tile * 32 + quad * 4;
    const bool active = c0 < C;
    const int cc0 = active ? c0 : C - 4;  // idle quads of a partial tile read valid channels
    const int P = Ho * Wo;
    int p_begin, p_end;
    split_range(P, splits, split, p_begin, p_end);
    const float inv_wo = 1.0f / Wo;

    ChannelStats<4> quad_stats(y, bias, sign_a, sign_b, shift_out, cc0, n, sn, 1, C,
                               shift_group, shift_per_sample, active && split == 0 && lane == 0);
    const float* plane = y + n * sn + cc0;
    auto load4 = [&](int offset) {
        return __ldcs(reinterpret_cast<const float4*>(plane + offset));
    };
    for (int base = p_begin; base < p_end; base += SPAN) {  // same trip count for the block
        float4 v[U][KK];
        window_positions<U, STEP>(base + lane, p_end, Wo, inv_wo, [&](int u, int py, int px) {
#pragma unroll
            for (int a = 0; a < K; ++a)
#pragma unroll
                for (int j = 0; j < K; ++j)
                    v[u][a * K + j] = load4((py * K + a) * sh + (px * K + j) * sw);
        });
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int p = base + lane + u * STEP;
            float e[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
            if (active && p < p_end) {
#pragma unroll
                for (int j = 0; j < KK; ++j) {
                    quad_stats.take_window(v[u][j], e);
                    if (j & 1) quad_stats.flush();
                }
                if (KK & 1) quad_stats.flush();
                int py, px;
                row_col(p, Wo, inv_wo, py, px);
                const int h0 = py * K, w0 = px * K;
                // The last window row / column also owns the rows / columns the pool drops.
                const int w1 = (px == Wo - 1) ? W : w0 + K;
                if (py == Ho - 1)
                    for (int h = h0 + K; h < H; ++h)
                        quad_stats.take_run(w1 - w0,
                                            [&](int i) { return load4(h * sh + (w0 + i) * sw); });
                if (px == Wo - 1)
                    for (int h = h0; h < h0 + K; ++h)
                        quad_stats.take_run(W - w0 - K, [&](int i) {
                            return load4(h * sh + (w0 + K + i) * sw);
                        });
            }
            if (EXT_CHANNELS_LAST) {
                if (active && p < p_end)
                    *reinterpret_cast<float4*>(ext + blocked_channels_last(
                        n, c0, p, C, P, ext_block)) = make_float4(
                        quad_stats.pooled(e[0], 0), quad_stats.pooled(e[1], 1),
                        quad_stats.pooled(e[2], 2), quad_stats.pooled(e[3], 3));
            } else {  // stage the extrema; written position-contiguous below (coalesced)
#pragma unroll
                for (int q = 0; q < 4; ++q)
                    stage[lane + u * STEP][quad * 4 + q] = quad_stats.pooled(e[q], q);
            }
        }
        if (!EXT_CHANNELS_LAST)
            write_staged_extrema<SPAN>(stage, ext, n, C, P, tile * 32, 32, base, p_end);
    }
    // Reduce over the 32 position lanes of each channel: 4 in the warp (threadIdx.x bits 3-4),
    // then the 8 warps through shared memory.
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const double2 sums = warp_sum_above(quad_stats.sums(q), 8);
        if (threadIdx.x < 8) red[threadIdx.y][quad * 4 + q] = sums;
    }
    __syncthreads();
    if (threadIdx.y == 0) {
        const int c = tile * 32 + threadIdx.x;
        if (c < C) partial[(n * C + c) * splits + split] = column_sum(red, threadIdx.x);
    }
}

// pool_extremum_stats for a channels-last y and k = K, one warp per pooled position: a
// window row's K columns of all C channels are K * C contiguous floats, read as 512-byte
// coalesced float4 rows (the per-channel kernels above touch 128 bytes per instruction, and
// for K = 4 the 16-byte one is no faster than the scalar one). Lane l holds chunks
// j = l + 32 t (t < T = K * C / 128) of a row: channel quad l % (C / 4), column j / (C / 4);
// needs C / 4 to divide 32, T >= 1, and 16-byte alignment. The lanes of one channel quad
// combine their extrema and sums through shuffles. Block (32, 8), grid N * splits, all C
// channels per block (c_tiles = 1); same arguments and outputs as pool_extremum_stats, except
// that with EXT_CHANNELS_LAST ext is contiguous channels-last in blocks of ext_block channels
// (blocked_channels_last; ext_block % 4 == 0), 16-byte aligned:
// the first C / 4 lanes store a position's extrema as float4, with no staging barrier.
// 2 blocks per SM (128 registers) are set as a bound: without one, ptxas aims some variants
// at 64 or 80 registers and spills their double sums.
template <int K, int T, bool EXT_CHANNELS_LAST>
__global__ void __launch_bounds__(256, 2) pool_extremum_stats_nhwc_rows(
        const float* __restrict__ y, const float* __restrict__ bias,
        const float* __restrict__ sign_a, const float* __restrict__ sign_b,
        float* __restrict__ ext, double2* __restrict__ partial, float* __restrict__ shift_out,
        int C, int H, int W, int k_runtime, int Ho, int Wo, int splits, int c_tiles, index_t sn,
        index_t sc, int sh, int sw, int shift_group, int shift_per_sample, int ext_block) {
    // Positions per warp and iteration, U * K * T loads in flight. Without the staging
    // barrier one is fastest for A (two and three are slower).
    constexpr int U = EXT_CHANNELS_LAST ? 1 : 2;
    constexpr int SPAN = 8 * U;
    __shared__ float stage[EXT_CHANNELS_LAST ? 1 : SPAN][129];
    __shared__ double2 red[8][128];
    const SampleBlock block = sample_block_last_first(splits, 1);
    const int split = block.split;
    const index_t n = block.n;
    const int lane = threadIdx.x, warp = threadIdx.y;
    const int quads = C / 4;
    const int c0 = (lane % quads) * 4;
    const int P = Ho * Wo;
    int p_begin, p_end;
    split_range(P, splits, split, p_begin, p_end);
    const float inv_wo = 1.0f / Wo;

    ChannelStats<4> quad_stats(y, bias, sign_a, sign_b, shift_out, c0, n, sn, 1, C, shift_group,
                               shift_per_sample, split == 0 && warp == 0 && lane < quads);
    const float* plane = y + n * sn + 4 * lane;
    auto load4 = [&](int offset) { return __ldg(reinterpret_cast<const float4*>(plane + offset)); };
    // Values of row h, columns [wa, wb): chunks j = lane, lane + 32, ... of (wb - wa) * C floats.
    auto take_span = [&](int h, int wa, int wb) {
        quad_stats.take_run((max((wb - wa) * quads - lane, 0) + 31) / 32,
                            [&](int i) { return load4(h * sh + wa * sw + 128 * i); });
    };
    for (int base = p_begin; base < p_end; base += SPAN) {  // same trip count for the block
        float4 v[U][K][T];
        window_positions<U, 1>(base + warp * U, p_end, Wo, inv_wo, [&](int u, int py, int px) {
#pragma unroll
            for (int a = 0; a < K; ++a)
#pragma unroll
                for (int t = 0; t < T; ++t)
                    v[u][a][t] = load4((py * K + a) * sh + px * K * sw + 128 * t);
        });
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int p = base + warp * U + u;
            float e[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
            if (p < p_end) {  // warp-uniform
#pragma unroll
                for (int a = 0; a < K; ++a)
#pragma unroll
                    for (int t = 0; t < T; ++t) {
                        quad_stats.take_window(v[u][a][t], e);
                        if ((a * T + t) & 1) quad_stats.flush();
                    }
                if ((K * T) & 1) quad_stats.flush();
                int py, px;
                row_col(p, Wo, inv_wo, py, px);
                const int h0 = py * K, w0 = px * K;
                // The last window row / column also owns the rows / columns the pool drops.
                const int w1 = (px == Wo - 1) ? W : w0 + K;
                if (py == Ho - 1)
                    for (int h = h0 + K; h < H; ++h) take_span(h, w0, w1);
                if (px == Wo - 1)
                    for (int h = h0; h < h0 + K; ++h) take_span(h, w0 + K, W);
            }
#pragma unroll
            for (int off = quads; off < 32; off <<= 1)
#pragma unroll
                for (int q = 0; q < 4; ++q)
                    e[q] = fmaxf(e[q], __shfl_xor_sync(0xffffffffu, e[q], off));
            if (lane < quads) {
                if (EXT_CHANNELS_LAST) {
                    if (p < p_end)
                        *reinterpret_cast<float4*>(ext + blocked_channels_last(
                            n, c0, p, C, P, ext_block)) = make_float4(
                            quad_stats.pooled(e[0], 0), quad_stats.pooled(e[1], 1),
                            quad_stats.pooled(e[2], 2), quad_stats.pooled(e[3], 3));
                } else {
#pragma unroll
                    for (int q = 0; q < 4; ++q)
                        stage[warp * U + u][c0 + q] = quad_stats.pooled(e[q], q);
                }
            }
        }
        if (!EXT_CHANNELS_LAST) {
            __syncthreads();
            for (int i = warp * 32 + lane; i < C * SPAN; i += 256) {
                const int ch = i / SPAN, q = i - ch * SPAN;
                if (base + q < p_end) ext[(n * C + ch) * (index_t)P + base + q] = stage[q][ch];
            }
            __syncthreads();
        }
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const double2 sums = warp_sum_above(quad_stats.sums(q), quads);  // a power of two
        if (lane < quads) red[warp][c0 + q] = sums;
    }
    __syncthreads();
    for (int c = warp * 32 + lane; c < C; c += 256)
        partial[(n * C + c) * splits + split] = column_sum(red, c);
}

// Pipeline A's exact path for channels whose GroupNorm or scale coefficients are not finite.
// The fused pass keeps one extremum per window and applies the folded affine
// (ChannelAffine with scale) to it, which equals PyTorch's max over the window of
// clamp(s * (a * v + b)) only for finite a, b, s: with an infinite gamma or scale, one
// window holds +-inf and NaN values that no single extremum predicts. One block per channel
// checks every sample's coefficients (a = gamma * rstd, b = beta - mean * a, as PyTorch forms
// them) and recomputes the flagged (sample, channel) planes of out from the convolution output
// y (strides sn, sc, sh, sw; plus bias) in PyTorch's order: GroupNorm affine, scale, max
// (NaN-propagating) over each k x k window, clamp. `centered`: a convolution output of one
// value per channel (1 x 1), whose GroupNorm PyTorch CUDA computes as
// (v - mean) * rstd * gamma + beta. A finite-parameter call costs one flag check per
// (sample, channel).
//
// The body of both kernels below: value_at(n, h, w) is the convolution output + bias of
// channel c (blockIdx.x) at (n, h, w).
template <class ValueAt>
__device__ __forceinline__ void affine_nonfinite_planes(
        ValueAt value_at, const float2* __restrict__ moments, const float* __restrict__ gamma,
        const float* __restrict__ beta, const float* __restrict__ scale, float* __restrict__ out,
        int N, int C, int G, int k, int Ho, int Wo, float lo, float hi, bool centered) {
    const int c = blockIdx.x;
    const float g = gamma ? gamma[c] : 1.0f, bt = beta ? beta[c] : 0.0f;
    const float s = scale ? scale[c] : 1.0f;
    const int group = c / (C / G);
    auto coefficients = [&](int n, float& a, float& b) {
        const float2 m = moments[(index_t)n * G + group];
        a = g * m.y;
        b = bt - m.x * a;
        return isfinite(a) && isfinite(b) && isfinite(s) && isfinite(a * s) && isfinite(b * s);
    };
    int flagged = 0;
    for (int n = threadIdx.x; n < N; n += blockDim.x) {
        float a, b;
        flagged |= !coefficients(n, a, b);
    }
    if (!__syncthreads_or(flagged)) return;
    const int P = Ho * Wo;
    for (int n = 0; n < N; ++n) {
        float a, b;
        if (coefficients(n, a, b)) continue;
        const float2 m = moments[(index_t)n * G + group];
        auto normalized = [&](float v) { return centered ? (v - m.x) * m.y * g + bt : a * v + b; };
        for (int p = threadIdx.x; p < P; p += blockDim.x) {
            const int i = p / Wo, j = p - i * Wo;
            float acc = -INFINITY;
            for (int di = 0; di < k; ++di)
                for (int dj = 0; dj < k; ++dj)
                    acc = nan_max(acc, normalized(value_at(n, i * k + di, j * k + dj)) * s);
            out[((index_t)n * C + c) * P + p] = clamp_nan(acc, lo, hi);
        }
    }
}

__global__ void pool_affine_nonfinite(const float* __restrict__ y, const float* __restrict__ bias,
                                      const float2* __restrict__ moments,
                                      const float* __restrict__ gamma,
                                      const float* __restrict__ beta,
                                      const float* __restrict__ scale, float* __restrict__ out,
                                      int N, int C, int G, int k, int Ho, int Wo, index_t sn,
                                      index_t sc, index_t sh, index_t sw, float lo, float hi,
                                      int centered) {
    const int c = blockIdx.x;
    const float b0 = bias ? bias[c] : 0.0f;
    auto value_at = [&](int n, int h, int w) {
        return y[n * sn + c * sc + h * sh + w * sw] + b0;
    };
    affine_nonfinite_planes(value_at, moments, gamma, beta, scale, out, N, C, G, k, Ho, Wo, lo,
                            hi, centered != 0);
}

// pool_affine_nonfinite for a convolution output that was never stored (the fused
// convolution conv2d_halo_pool_stats): each value it needs is computed from x (N, Cin, H, W)
// and w (C, Cin, kh, kw) directly, in float32, only in the flagged planes.
__global__ void pool_affine_nonfinite_conv(
        const float* __restrict__ x, const float* __restrict__ w,
        const float* __restrict__ bias, const float2* __restrict__ moments,
        const float* __restrict__ gamma, const float* __restrict__ beta,
        const float* __restrict__ scale, float* __restrict__ out, int N, int C, int G, int k,
        int Ho, int Wo, int Cin, int H, int W, int kh, int kw, int sh, int sw, int ph, int pw,
        int dh, int dw, float lo, float hi) {
    const int c = blockIdx.x;
    const float b0 = bias ? bias[c] : 0.0f;
    auto value_at = [&](int n, int p, int q) {
        float v = b0;
        for (int ci = 0; ci < Cin; ++ci)
            for (int u = 0; u < kh; ++u) {
                const int h = p * sh - ph + u * dh;
                if (h < 0 || h >= H) continue;
                for (int t = 0; t < kw; ++t) {
                    const int ww = q * sw - pw + t * dw;
                    if (ww >= 0 && ww < W)
                        v = fmaf(x[(((index_t)n * Cin + ci) * H + h) * W + ww],
                                 w[(((index_t)c * Cin + ci) * kh + u) * kw + t], v);
                }
            }
        return v;
    };
    // Its windows (pool 2 or 4) never hold a convolution output of one value per channel.
    affine_nonfinite_planes(value_at, moments, gamma, beta, scale, out, N, C, G, k, Ho, Wo, lo,
                            hi, false);
}

// Pipeline B's exact path for channels whose BatchNorm coefficients are not finite (an
// infinite or NaN weight or bias). The fused pass keeps the window extremum that the sign of
// the weight selects, which equals PyTorch's max over the window of tanh(a * v + b) only for
// finite a, b. One block per channel recomputes that max from the convolution output y
// (strides sn, sc, sh, sw; plus the convolution bias, with which PyTorch forms the
// statistics: a = gamma * rstd, b = beta - (mean + bias) * a) and stores atanh of it (+-inf
// for +-1, NaN for NaN) in ext (NCHW, or blocked channels-last with ext_block > 0), then sets
// the channel's coefficients (ChannelAffine rows of C entries in coef) to the identity, so that
// the GroupNorm pass's tanh(1 * (e - 0) + 0) reads back the exact value. Runs after
// bn_coefficients and before the GroupNorm pass.
__global__ void pool_bn_tanh_nonfinite(const float* __restrict__ y,
                                       const float* __restrict__ bias,
                                       const float2* __restrict__ moments,
                                       const float* __restrict__ gamma,
                                       const float* __restrict__ beta, float* coef, float* ext,
                                       int N, int C, int k, int Ho,
                                       int Wo, index_t sn, index_t sc, index_t sh, index_t sw,
                                       int ext_block) {
    const int c = blockIdx.x;
    if (ChannelAffine::load<false>(coef, C, c).finite()) return;  // coef changes below
    const float2 m = moments[c];
    const float b0 = bias ? bias[c] : 0.0f;
    const float a = (gamma ? gamma[c] : 1.0f) * m.y;
    const float b = (beta ? beta[c] : 0.0f) - (m.x + b0) * a;
    const int P = Ho * Wo;
    for (index_t i = threadIdx.x; i < (index_t)N * P; i += blockDim.x) {
        const index_t n = i / P;
        const int p = (int)(i - n * P), r = p / Wo, q = p - r * Wo;
        const float* plane = y + n * sn + c * sc;
        float acc = -INFINITY;
        for (int dr = 0; dr < k; ++dr)
            for (int dq = 0; dq < k; ++dq) {
                const float v = plane[(r * k + dr) * sh + (q * k + dq) * sw] + b0;
                acc = nan_max(acc, tanh_branchless(a * v + b));
            }
        const index_t at = ext_block ? blocked_channels_last(n, c, p, C, P, ext_block)
                                     : ((index_t)n * C + c) * P + p;
        ext[at] = atanhf(acc);
    }
    __syncthreads();  // every thread has read the coefficients (at the top) before they change
    if (threadIdx.x == 0) ChannelAffine::identity().store(coef, C, c);
}
