// Normalization kernels: split statistics, their finalization into per-channel affine
// coefficients, the affine (+ activation) apply pass, and a one-block-per-row GroupNorm.
#include "common.cuh"

// Codes of the ACT and MODE template parameters: the launchers name them in the instantiations
// they request (cufused/_kernels/normalization.py), so these are their only values.
#define ACT_NONE 0
#define ACT_TANH 1
#define ACT_CLAMP 2

#define MODE_GROUP_NORM 0
#define MODE_BATCH_NORM 1

// A float32 sum of squares carried with its rounding errors: each square's exact low part
// (an FMA) and each addition's (TwoSum), so that the sum keeps about double's accuracy in
// float32 arithmetic, which every GPU runs at full rate (a double add and FMA per value would
// leave GPUs of slow double arithmetic short of their memory rate). The _rn intrinsics keep
// the compiler from contracting a square and a sum into one FMA, which would break TwoSum.
// A square or a sum past float32's range gives infinity, as a float32 sum does.
struct SquareSum {
    float hi = 0.0f, lo = 0.0f;

    __device__ __forceinline__ void add_square(float d) {
        const float p = __fmul_rn(d, d);
        const float e = fmaf(d, d, -p);  // d * d - p exactly
        const float s = __fadd_rn(hi, p);
        const float b = __fsub_rn(s, hi);
        lo = __fadd_rn(lo, __fadd_rn(__fadd_rn(__fsub_rn(hi, __fsub_rn(s, b)),
                                               __fsub_rn(p, b)), e));
        hi = s;
    }

    __device__ __forceinline__ double value() const {
        // An infinite or NaN square or sum makes the low part NaN: the sum is the high one.
        return isfinite(hi) ? (double)hi + (double)lo : (double)hi;
    }
};

// Shifted sums for one statistics key over x[o * outer_stride + key * key_stride + i],
// o < n_outer, i < inner, split into `splits` blocks per key (the split reduction that keeps
// the GPU busy when there are few keys). partial[key * splits + split] = (sum d, sum d*d) in
// double with d = x - shift, shift = the key's first element, 0 where infinite (written to
// shift_out[key]). A first value z standard deviations from the mean scales sum d*d, and a
// float32 sum's rounding with it, by about 1 + z * z, which the variance (sum d*d / n -
// mean(d)^2) keeps: each thread sums d in double and d*d as a SquareSum.
__global__ void key_stats_partial(const float* __restrict__ x, double2* __restrict__ partial,
                                  float* __restrict__ shift_out, index_t n_outer,
                                  index_t outer_stride, index_t key_stride, index_t inner,
                                  int splits) {
    __shared__ double2 scratch[32];
    const int split = blockIdx.x % splits;
    const index_t key = blockIdx.x / splits;
    const float* base = x + key * key_stride;
    const float shift = finite_shift(base[0]);
    if (split == 0 && threadIdx.x == 0) shift_out[key] = shift;
    const index_t total = n_outer * inner;
    index_t j_begin, j_end;
    split_range(total, splits, split, j_begin, j_end);
    double s1 = 0.0;
    SquareSum s2;
    index_t j = j_begin + threadIdx.x;
    index_t o = j / inner;
    index_t i = j - o * inner;
    // The block's step in (outer, inner) coordinates, so that a step costs one carry at most
    // whatever inner's size.
    const index_t step_o = blockDim.x / inner, step_i = blockDim.x - step_o * inner;
    for (; j < j_end; j += blockDim.x) {
        const float d = __ldg(base + o * outer_stride + i) - shift;
        s1 += d;
        s2.add_square(d);
        i += step_i;
        o += step_o;
        if (i >= inner) { i -= inner; ++o; }
    }
    const double2 sums = block_sum(make_double2(s1, s2.value()), scratch);
    if (threadIdx.x == 0) partial[key * splits + split] = sums;
}

// Channel c's value of an optional per-channel parameter (null: `fallback`).
__device__ __forceinline__ float param_or(const float* __restrict__ p, int c, float fallback) {
    return p ? __ldg(p + c) : fallback;
}

// Channel c's affine for a normalization of moments m, times scale (centered_only: see
// ChannelAffine::of).
__device__ __forceinline__ ChannelAffine channel_affine_of(const float* __restrict__ gamma,
                                                           const float* __restrict__ beta,
                                                           const float* __restrict__ scale,
                                                           int c, const NormMoments& m,
                                                           bool centered_only = false) {
    return ChannelAffine::of(param_or(gamma, c, 1.0f), param_or(beta, c, 0.0f),
                             param_or(scale, c, 1.0f), m, centered_only);
}

// A partial's (sum d, sum d * d) with d taken from the row's shift: a double2 of
// stats_finalize's partials has them already; a float4 entry of group_affine_rows' (sum d,
// sum d * d, s, count as int bits) has d = value - s, s a shift of the entry's own, and its
// sums move by e = s - row_shift in double.
__device__ __forceinline__ double2 row_shifted_sums(double2 p, double) { return p; }

__device__ __forceinline__ double2 row_shifted_sums(float4 p, double row_shift) {
    const double e = (double)p.z - row_shift, n = __float_as_int(p.w);
    return make_double2(p.x + n * e, p.y + e * (2.0 * p.x + n * e));
}

// (mean, variance) in double of a row's shifted sums s = (sum d, sum d * d) over count values:
// a sum of squared deviations past float32's range gives an infinite variance, as PyTorch's
// float32 sums give it, however the row's values split into partial sums. The variance is as
// the sums give it (below 0 by rounding, or NaN).
__device__ __forceinline__ double2 shifted_moments(double2 s, double shift, double count) {
    if (s.y > 3.4028234663852886e38) s.y = INFINITY;  // float32 max
    const double m1 = s.x / count;
    return make_double2(shift + m1, s.y / count - m1 * m1);
}

// (mean, variance) in double of statistics row `row` from its partials at
// partial[o * outer_stride + row * row_len + m], o < n_outer, m < row_len, whose d are taken
// from row_shift (row_shifted_sums). Reduced over the block (every thread gets them), as
// shifted_moments forms them.
template <typename Partial>
__device__ __forceinline__ double2 partial_moments(const Partial* __restrict__ partial,
                                                   double row_shift, index_t row,
                                                   index_t n_outer, index_t outer_stride,
                                                   int row_len, double count, double2* scratch) {
    double2 s = make_double2(0.0, 0.0);
    const index_t total = n_outer * row_len;
    for (index_t j = threadIdx.x; j < total; j += blockDim.x) {
        const index_t o = j / row_len;
        const double2 p = row_shifted_sums(
            partial[o * outer_stride + row * row_len + (j - o * row_len)], row_shift);
        s.x += p.x;
        s.y += p.y;
    }
    return shifted_moments(block_sum(s, scratch), row_shift, count);
}

// rstd in double of a variance: rounding can push it below 0 (0 then); a NaN stays NaN.
__device__ __forceinline__ double inverse_std(double var, double eps) {
    return 1.0 / sqrt((var < 0.0 ? 0.0 : var) + eps);
}

// One block per statistics row. The row's partials (double2: sum d, sum d * d, d = value -
// shift[row]) sit at partial[o * outer_stride + row * row_len + m], o < n_outer,
// m < row_len, and are summed in double; centered_sums: d are of the normalized values
// themselves (NormMoments). They become the ChannelAffine coefficients (rows of K entries in
// coef) that the next pass applies:
//  MODE_GROUP_NORM: row = n * G + g; entry n * C + c for each of the group's channels c, with
//                   scale (K = N * C);
//  MODE_BATCH_NORM: row = c; entry c (K = C); with training = 0
//                   the running statistics replace the batch ones, the mean running_mean[c]
//                   plus, when given, running_mean_lo[c] (the float32 remainder of a float64
//                   mean, cufused.dask's batch statistics); with training = 1 the running
//                   buffers (when given) are updated in place as PyTorch does, the batch mean
//                   including mean_offset[c] (a convolution bias that the statistics skipped).
// centered_only: ChannelAffine::of's.
template <int MODE>
__global__ void stats_finalize(const double2* __restrict__ partial,
                               const float* __restrict__ shift,
                               index_t n_outer, index_t outer_stride, int row_len, double count,
                               const float* __restrict__ gamma, const float* __restrict__ beta,
                               const float* __restrict__ scale, float* __restrict__ coef,
                               index_t K, int C, int G, double eps, int training,
                               int centered_sums, int centered_only, float* running_mean,
                               float* running_var, const float* __restrict__ running_mean_lo,
                               const float* __restrict__ mean_offset, float momentum,
                               float2* __restrict__ moments) {
    __shared__ double2 scratch[32];
    __shared__ NormMoments stats;
    const index_t row = blockIdx.x;
    if (training) {
        const double2 moments_row = partial_moments(partial, (double)shift[row], row, n_outer,
                                                    outer_stride, row_len, count, scratch);
        if (threadIdx.x == 0) {
            double mean = moments_row.x, var = moments_row.y < 0.0 ? 0.0 : moments_row.y;
            const double offset = mean_offset ? (double)mean_offset[row] : 0.0;
            // The offset (a convolution bias the statistics skipped) cancels in the
            // normalized values; the running mean takes it. Added to every value first, an
            // infinite one makes the mean that infinity and the variance NaN (inf - inf), as
            // in PyTorch; a NaN one makes both NaN.
            if (!isfinite(offset)) var = __longlong_as_double(0x7ff8000000000000LL);
            stats = NormMoments::of(mean, (float)inverse_std(var, eps), centered_sums);
            if (MODE == MODE_BATCH_NORM) {
                const double m = momentum;
                if (running_mean)
                    running_mean[row] =
                        (float)((1.0 - m) * running_mean[row] + m * (mean + offset));
                if (running_var)
                    running_var[row] = (float)((1.0 - m) * running_var[row]
                                               + m * var * count / (count - 1.0));
            }
        }
    } else if (threadIdx.x == 0) {
        // In double from the exact values: a denormal running variance is not flushed to
        // zero, and a negative or NaN one gives NaN, as in PyTorch.
        stats = NormMoments{running_mean[row], running_mean_lo ? running_mean_lo[row] : 0.0f,
                            (float)(1.0 / sqrt(exact_double(running_var[row]) + eps))};
    }
    __syncthreads();
    const NormMoments m = stats;
    if (moments && threadIdx.x == 0) moments[row] = make_float2(m.mean, m.rstd);
    const int channels = MODE == MODE_GROUP_NORM ? C / G : 1;
    for (int j = threadIdx.x; j < channels; j += blockDim.x) {
        const int c = MODE == MODE_GROUP_NORM ? (int)(row % G) * channels + j : (int)row;
        const index_t out = MODE == MODE_GROUP_NORM ? (row / G) * C + c : row;
        channel_affine_of(gamma, beta, scale, c, m, centered_only != 0).store(coef, K, out);
    }
}

template <int ACT>
__device__ __forceinline__ float activate(float v, float lo, float hi) {
    if (ACT == ACT_TANH) return tanh_branchless(v);
    if (ACT == ACT_CLAMP) return clamp_nan(v, lo, hi);
    return v;
}

// Maps the VEC lanes of a vector whose values belong to at most two channels (a VEC-wide
// vector of a row, or of a tensor of planes of at least VEC values): lane k to
// apply(affine_of(0), value) while k < left (the first channel's values), to
// apply(affine_of(1), value) after; the second channel's affine is built only where the
// vector reaches it.
template <int VEC, class Left, class AffineOf, class Apply>
__device__ __forceinline__ void map_two_channels(float4& v, Left left, AffineOf affine_of,
                                                 Apply apply) {
    const ChannelAffine first = affine_of(0);
    const ChannelAffine second = left < VEC ? affine_of(1) : first;
    float* t = &v.x;
#pragma unroll
    for (int k = 0; k < VEC; ++k) t[k] = apply(k < left ? first : second, t[k]);
}

// y = act(f_k(x)) over a contiguous tensor of planes of `inner` values, f_k the ChannelAffine
// of entry k = plane % n_coef in coef (rows of n_coef entries), visited flat as vectors of VEC
// values (VEC = 4: 16-byte accesses; needs size % 4 == 0, inner >= 4 and 16-byte aligned x, y,
// so a vector spans at most two planes; the planes themselves need no alignment: pipeline A's
// are 31 x 31). Each thread has UNROLL vectors in flight (a grid-stride loop). x may equal y.
template <int ACT, int VEC>
__global__ void channel_affine(const float* x, float* y, const float* __restrict__ coef,
                               index_t n_vec, index_t inner, index_t n_coef, float lo,
                               float hi) {
    const index_t stride = (index_t)gridDim.x * blockDim.x;
    // A float-reciprocal quotient while offsets fit in 32 bits, a 64-bit division beyond.
    const bool small = n_vec * VEC < (1LL << 31);
    const float inv_inner = 1.0f / (float)inner;
    const index_t first = blockIdx.x * (index_t)blockDim.x + threadIdx.x;
    for_each_vector<VEC, 4>(x, first, n_vec, stride, [&](index_t i, float4& v) {
        const index_t e = i * VEC;
        const index_t plane = small ? quotient((int)e, (int)inner, inv_inner) : e / inner;
        const index_t left = (plane + 1) * inner - e;  // values of this plane from e on
        const index_t k0 = plane % n_coef;  // n_coef = N * C may pass 2**31
        const index_t k1 = k0 + 1 == n_coef ? 0 : k0 + 1;
        map_two_channels<VEC>(
            v, left,
            [&](int second) { return ChannelAffine::load(coef, n_coef, second ? k1 : k0); },
            [&](const ChannelAffine& f, float t) { return activate<ACT>(f(t), lo, hi); });
        store_vec<VEC>(y, i, v);
    });
}

// One (n, g) row of GroupNorm for a block: the row's Cg * HW values in NCHW order, visited
// as vectors of VEC (VEC = 4: 16-byte accesses, which needs Cg * HW % 4 == 0, HW >= 4 and
// 16-byte aligned buffers; a vector then spans at most two channels, c and c + 1). PRE =
// ACT_TANH first maps each value to tanh(pre affine c (x)), with the ChannelAffine rows of C
// entries in pre (pipeline B's BatchNorm affine + tanh on the pooled extremum).
template <int PRE, int VEC>
struct GroupNormRow {
    const float* pre;
    const float* gamma;
    const float* beta;
    int C, c0, cg, HW, n_vec;  // channels, first channel, its group's channels, values per
                               // channel, vectors in the row
    float inv_hw;

    // The block's row, (n, g) = (blockIdx.x / G, blockIdx.x % G) of an (N, C, HW) tensor.
    __device__ static GroupNormRow of_block(const float* pre, const float* gamma,
                                            const float* beta, int C, int G, int HW) {
        const int cg = C / G;
        return {pre, gamma, beta, C, (int)(blockIdx.x % G) * cg, cg, HW, cg * HW / VEC,
                1.0f / HW};
    }

    __device__ int len() const { return cg * HW; }
    // The row's first value in a contiguous (N, C, HW) tensor.
    __device__ static index_t start(int len) { return (index_t)blockIdx.x * len; }

    // A vector's values belong to channel c (the first `left` of them) and c + 1.
    struct Span { int c, left; };

    __device__ Span span(int q) const {
        const int e = q * VEC;
        const int c = quotient(e, HW, inv_hw);
        return Span{c0 + c, (c + 1) * HW - e};
    }

    __device__ static float& lane(float4& v, int k) {
        return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
    }

    // Channel c's pre-map affine (the identity without PRE).
    __device__ ChannelAffine pre_affine(int c) const {
        return PRE == ACT_TANH ? ChannelAffine::load(pre, C, c) : ChannelAffine::identity();
    }

    __device__ static float pre_value(const ChannelAffine& f, float v) {
        return PRE == ACT_TANH ? tanh_branchless(f(v)) : v;
    }

    // Value v of channel c after the pre-map (a row's shift is its first value, mapped).
    __device__ float pre_map(int c, float v) const { return pre_value(pre_affine(c), v); }

    __device__ void map_pre(float4& v, Span s) const {
        if (PRE != ACT_TANH) return;
        map_two_channels<VEC>(v, s.left, [&](int second) { return pre_affine(s.c + second); },
                              [](const ChannelAffine& f, float t) { return pre_value(f, t); });
    }

    // y row = ChannelAffine of moments m (value) from src (the cached, already mapped row,
    // or the input row that is mapped again), 4 vectors in flight per thread;
    // centered_only as ChannelAffine::of's.
    __device__ void normalize(const float* src, bool mapped, float* yr, const NormMoments& m,
                              bool centered_only) const {
        for_each_vector<VEC, 4>(src, (int)threadIdx.x, n_vec, (int)blockDim.x,
                                [&](int q, float4& v) {
            const Span s = span(q);
            if (!mapped) map_pre(v, s);
            map_two_channels<VEC>(
                v, s.left,
                [&](int second) {
                    return channel_affine_of(gamma, beta, nullptr, s.c + second, m,
                                             centered_only);
                },
                [](const ChannelAffine& f, float t) { return f(t); });
            store_vec<VEC>(yr, q, v);
        });
    }
};

// GroupNorm times scale and an activation, y = act(affine(x)), with the statistics from
// partials with shifts and counts of their own (row_shifted_sums' float4 entries):
// one block per (n, g) row of a contiguous (N, C, HW) tensor (GroupNormRow; x may equal y)
// reduces the row's partials, forms (mean, rstd) and each channel's ChannelAffine as
// stats_finalize does (moments[row] = (mean, rstd); centered_sums as there) and applies them:
// stats_finalize and channel_affine in one pass (pipeline A's pooled extrema).
template <int ACT, int VEC>
__global__ void group_affine_rows(const float* x, float* y, const float4* __restrict__ partial,
                                  int row_len, double count, const float* __restrict__ gamma,
                                  const float* __restrict__ beta,
                                  const float* __restrict__ scale, int C, int G, int HW,
                                  double eps, int centered_sums, float lo, float hi,
                                  float2* __restrict__ moments) {
    __shared__ double2 scratch[32];
    using Row = GroupNormRow<ACT_NONE, VEC>;
    const Row gn = Row::of_block(nullptr, nullptr, nullptr, C, G, HW);  // spans only
    const double2 mv = partial_moments(partial, (double)partial[blockIdx.x * row_len].z,
                                       blockIdx.x, 1, 0, row_len, count, scratch);
    const NormMoments m = NormMoments::of(mv.x, (float)inverse_std(mv.y, eps),
                                          centered_sums != 0);
    if (moments && threadIdx.x == 0) moments[blockIdx.x] = make_float2(m.mean, m.rstd);
    const int len = gn.len();
    float* yr = y + Row::start(len);
    for_each_vector<VEC, 4>(x + Row::start(len), (int)threadIdx.x, gn.n_vec, (int)blockDim.x,
                            [&](int q, float4& v) {
        const typename Row::Span s = gn.span(q);
        map_two_channels<VEC>(
            v, s.left,
            [&](int second) { return channel_affine_of(gamma, beta, scale, s.c + second, m); },
            [&](const ChannelAffine& f, float t) { return activate<ACT>(f(t), lo, hi); });
        store_vec<VEC>(yr, q, v);
    });
}

// The moments of a row from its threads' shifted sums (len values; d in double, d*d as a
// SquareSum, for key_stats_partial's reason), combined and formed as stats_finalize forms them
// (shifted_moments): deviations wider than float32's squares allow give rstd 0 and (for a
// finite v - mean) the outputs the bias, as PyTorch gives, whose Welford mean stays finite.
__device__ __forceinline__ NormMoments row_moments(double s1, const SquareSum& s2, float shift,
                                                   int len, double eps, double2* scratch) {
    const double2 mv = shifted_moments(block_sum(make_double2(s1, s2.value()), scratch), shift,
                                       len);
    return NormMoments::of(mv.x, (float)inverse_std(mv.y, eps));
}

// Maps every value of a row cached in shared memory as (Cg, HW), one warp per channel at a
// time and its lanes over the channel's positions: channel(c) returns the channel's value map,
// so its parameters are warp-uniform registers and no value needs channel arithmetic (B's
// GroupNorm executes about a sixth fewer instructions than with GroupNormRow's per-vector
// channel). Lanes idle past HW, so callers use it for HW >= 32.
template <class Channel>
__device__ __forceinline__ void map_cached_row(float* row, int cg, int HW, Channel&& channel) {
    const int lane = threadIdx.x & 31;
    for (int c = threadIdx.x >> 5; c < cg; c += blockDim.x >> 5) {
        const auto f = channel(c);
        float* v = row + c * HW;
#pragma unroll 4
        for (int p = lane; p < HW; p += 32) v[p] = f(v[p]);
    }
}

// y row = ChannelAffine of moments m (value) for a cached, already mapped row: normalized
// in place channel by channel (map_cached_row), then stored with VEC-wide accesses.
template <int VEC>
__device__ void normalize_cached_row(float* row_cache, float* yr, const float* gamma,
                                     const float* beta, int c0, int cg, int HW,
                                     const NormMoments& m) {
    map_cached_row(row_cache, cg, HW, [&](int c) {
        return channel_affine_of(gamma, beta, nullptr, c0 + c, m);
    });
    __syncthreads();
    for (int q = threadIdx.x; q < cg * HW / VEC; q += blockDim.x)
        store_vec<VEC>(yr, q, load_vec<VEC>(row_cache, q));
}

// Copies n_vec vectors of VEC floats from global src to shared dst with cp.async: no
// registers hold them, so each thread has all of its copies in flight at once. Returns once
// the thread's own copies have landed (the caller's barrier then publishes them).
template <int VEC>
__device__ __forceinline__ void copy_to_shared(float* dst, const float* src, int n_vec) {
    for (int q = threadIdx.x; q < n_vec; q += blockDim.x) {
        const unsigned d = (unsigned)__cvta_generic_to_shared(dst + q * VEC);
        if (VEC == 4)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src + q * 4));
        else
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src + q));
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
}

// GroupNorm with one block per (n, g) row of a contiguous (N, C, HW) tensor (see
// GroupNormRow). With CACHE the mapped row stays in dynamic shared memory between the
// statistics and the normalize step; otherwise it is recomputed from x. x may equal y: every
// element is read and written by the same thread. centered_only: ChannelAffine::of's.
template <int PRE, bool CACHE, int VEC>
__global__ void group_norm_rows(const float* x, float* y, const float* __restrict__ pre,
                                const float* __restrict__ gamma, const float* __restrict__ beta,
                                int C, int G, int HW, double eps, int centered_only) {
    extern __shared__ float4 cache[];
    __shared__ double2 scratch[32];
    using Row = GroupNormRow<PRE, VEC>;
    const Row gn = Row::of_block(pre, gamma, beta, C, G, HW);
    const int len = gn.len();
    const float* xr = x + Row::start(len);
    const float shift = gn.pre_map(gn.c0, xr[0]);
    double s1 = 0.0;
    SquareSum s2;
    for_each_vector<VEC, 4>(xr, (int)threadIdx.x, gn.n_vec, (int)blockDim.x,
                            [&](int q, float4& v) {
        gn.map_pre(v, gn.span(q));
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            const float d = gn.lane(v, k) - shift;
            s1 += d;
            s2.add_square(d);
        }
        if (CACHE) store_vec<VEC>(reinterpret_cast<float*>(cache), q, v);
    });
    const NormMoments m = row_moments(s1, s2, shift, len, eps, scratch);
    gn.normalize(CACHE ? reinterpret_cast<const float*>(cache) : xr, CACHE, y + Row::start(len),
                 m, centered_only != 0);
}

// group_norm_rows with the mapped row cached in dynamic shared memory, filled one of two
// ways. X_BLOCKED = false: x is contiguous (N, C, HW) with HW >= 32, and the row is visited
// channel by channel: copied in (copy_to_shared), mapped (PRE) and summed with
// map_cached_row, then normalized by normalize_cached_row. X_BLOCKED = true: x is stored
// channels-last in blocks of `block` channels (blocked_channels_last: block = C is
// (N, HW, C)), the output NCHW: pipeline B's pooled extrema, which its channels-last fused
// pass writes with 16-byte stores. Each thread reads 16-byte quads of the group's channels
// (Cg / 4 dividing 32, so a thread's quad is fixed: its pre-map affines are loaded once) and
// scatters them into the cached row in NCHW order; the normalize step is
// normalize_cached_row's (HW >= 32) or GroupNormRow's. Needs C % 4 == 0, a block of whole
// groups and x 16-byte aligned. `block` is read only with X_BLOCKED. x may equal y: with
// X_BLOCKED and block = Cg a row has the same bytes in x as in y, and the block reads its
// whole row before it writes (no __ldg).
template <int PRE, int VEC, bool X_BLOCKED>
__global__ void group_norm_rows_cached(const float* x, float* y, const float* __restrict__ pre,
                                       const float* __restrict__ gamma,
                                       const float* __restrict__ beta, int C, int G, int HW,
                                       double eps, int block) {
    extern __shared__ float4 cache[];
    float* row_cache = reinterpret_cast<float*>(cache);
    __shared__ double2 scratch[32];
    using Row = GroupNormRow<PRE, VEC>;
    const Row gn = Row::of_block(pre, gamma, beta, C, G, HW);
    const int c0 = gn.c0, cg = gn.cg, len = gn.len();
    float shift;
    double s1 = 0.0;
    SquareSum s2;
    if constexpr (!X_BLOCKED) {
        // The shift comes from x, not from row_cache[0]: the warp of channel 0 maps the
        // cached row in place while other warps may not have read its first value yet.
        const float* xr = x + Row::start(len);
        shift = gn.pre_map(c0, xr[0]);
        copy_to_shared<VEC>(row_cache, xr, gn.n_vec);
        __syncthreads();
        map_cached_row(row_cache, cg, HW, [&](int c) {
            const ChannelAffine f = gn.pre_affine(c0 + c);
            return [&, f](float v) {
                const float t = Row::pre_value(f, v);
                const float d = t - shift;
                s1 += d;
                s2.add_square(d);
                return t;
            };
        });
    } else {
        const index_t n = blockIdx.x / G;
        const int quads = cg / 4;
        const int quad = threadIdx.x % quads, lanes = blockDim.x / quads;
        const int cq = c0 + 4 * quad;
        ChannelAffine f[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) f[k] = gn.pre_affine(cq + k);
        const float* xs = x + blocked_channels_last(n, cq, 0, C, HW, block);
        shift = gn.pre_map(c0, x[blocked_channels_last(n, c0, 0, C, HW, block)]);
        // Positions p = threadIdx.x / quads + lanes * i, UNROLL loads in flight (8 are slower
        // on B: 80 registers, 3 blocks per SM instead of 4).
        constexpr int UNROLL = 4;
        for (int p0 = threadIdx.x / quads; p0 < HW; p0 += UNROLL * lanes) {
            float4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                if (p0 + u * lanes < HW)
                    v[u] = *reinterpret_cast<const float4*>(xs + (index_t)(p0 + u * lanes) *
                                                                      block);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int p = p0 + u * lanes;
                if (p >= HW) break;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const float t = Row::pre_value(f[k], gn.lane(v[u], k));
                    const float d = t - shift;
                    s1 += d;
                    s2.add_square(d);
                    row_cache[(4 * quad + k) * HW + p] = t;
                }
            }
        }
    }
    // row_moments' barriers order the cache.
    const NormMoments m = row_moments(s1, s2, shift, len, eps, scratch);
    if (!X_BLOCKED || HW >= 32)  // the NCHW fill runs only for HW >= 32
        normalize_cached_row<VEC>(row_cache, y + Row::start(len), gamma, beta, c0, cg, HW, m);
    else
        gn.normalize(row_cache, true, y + Row::start(len), m, false);  // 4-D blocks only
}
