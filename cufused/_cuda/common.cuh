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

// The shift of shifted sums taken from a data value: an infinite one would turn every
// d = value - shift into NaN or -inf, and the mean of a row holding one infinity NaN where
// PyTorch's is that infinity (BatchNorm's running mean shows it); 0 keeps the sums' own
// infinities. A finite shift only keeps |mean| >> std accurate.
__device__ __forceinline__ float finite_shift(float v) { return isinf(v) ? 0.0f : v; }

// x rounded to TF32 (to nearest, ties away from zero), as the bits of a float32: half a TF32
// unit added to the magnitude's bits, the 13 low bits cleared, as cvt.rna.tf32.f32 does for
// finite values below (2 - 2^-11) * 2^127. Above it cvt.rna gives an infinity, and a NaN whose
// payload lies in the 13 low bits alone becomes one: here the first keeps its truncation
// (TF32's largest finite value, as the tensor cores read it), the second is quieted.
__device__ __forceinline__ unsigned to_tf32(float x) {
    const unsigned raw = __float_as_uint(x), magnitude = raw & 0x7FFFFFFFu;
    const unsigned rounded = (magnitude < 0x7F7FF000u ? raw + 0x1000u : raw) & 0xFFFFE000u;
    return magnitude > 0x7F800000u ? rounded | 0x00400000u : rounded;
}

// d += a * b for one mma.sync m16n8k8 step (TF32 operands, float32 accumulation; the
// fragments in PTX's .row.col layouts); FRESH: d = a * b (a zero addend), opening a 3xTF32
// step sum without clearing it.
template <bool FRESH = false>
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4],
                                         const unsigned (&b)[2]) {
    float c[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) c[e] = FRESH ? 0.0f : d[e];
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
          "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// NaN-propagating max/min of a running extremum a and a later value b (fmaxf/fminf drop NaN;
// PyTorch's pooling keeps it). Equal values keep a, as PyTorch keeps a window's first: the max
// of (-0, +0) is -0.
__device__ __forceinline__ float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }

// -1 where a * b < 0 in exact arithmetic, else +1 (also for a zero or NaN factor): the sign of
// the slope that chooses a pooling window's max or min. The float32 product of two tiny
// factors flushes to -0, and that of two huge ones overflows, so it is not formed.
__device__ __forceinline__ float product_sign(float a, float b) {
    return (a < 0.0f && b > 0.0f) || (a > 0.0f && b < 0.0f) ? -1.0f : 1.0f;
}

// tanh without tanhf's branch: a warp whose |x| fall on both sides of tanhf's cutoff runs
// both of its paths, and pipeline B's GroupNorm maps every value through tanh. An odd
// Taylor polynomial for |x| < 0.25 (truncation below 1e-8 relative), else
// sign(x) * (1 - t) / (1 + t), t = exp(-2|x|): within ~5 ulp (tanhf: 2). t comes from the
// flush-to-zero ex2 instruction, which exp2f wraps in a denormal fix-up (3 more
// instructions); a denormal t (|x| > 43) makes no difference to 1 - t or 1 + t. NaN and
// +-inf map as tanhf maps them, and a zero keeps its sign (the polynomial's sum gives +0 for
// -0).
__device__ __forceinline__ float tanh_branchless(float x) {
    const float a = fabsf(x);
    const float x2 = x * x;
    float p = fmaf(x2, 62.0f / 2835.0f, -17.0f / 315.0f);
    p = fmaf(p, x2, 2.0f / 15.0f);
    p = fmaf(p, x2, -1.0f / 3.0f);
    const float small = copysignf(fmaf(p * x2, x, x), x);
    float t;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(t) : "f"(-2.88539008f * a));  // 2 / ln 2
    const float large = copysignf(__fdividef(1.0f - t, 1.0f + t), x);
    return a < 0.25f ? small : large;
}

// torch.clamp semantics: NaN stays NaN, and lo > hi gives hi.
__device__ __forceinline__ float clamp_nan(float v, float lo, float hi) {
    return v != v ? v : fminf(fmaxf(v, lo), hi);
}

// A statistics row's normalization moments: its float64 mean as the float32 mean plus the
// remainder mean_lo, and rstd. mean_lo is 0 where the float32 mean is not finite, and without
// `centered_sums`: sums that are not of the normalized values themselves (pipeline A's with a
// convolution bias, which skip the rounding of y + bias) give a float64 mean no closer to
// theirs than its float32 rounding, which also rounds a constant row's inexact sums back to
// its value.
struct NormMoments {
    float mean, mean_lo, rstd;

    __device__ static NormMoments of(double mean, float rstd, bool centered_sums = true) {
        const float hi = (float)mean;
        return {hi, centered_sums && isfinite(hi) ? (float)(mean - (double)hi) : 0.0f, rstd};
    }
};

// A channel's normalization affine, gamma * (v - mean) * rstd + beta, times scale, as
// a * (v - center) + c. Finite coefficients take the centered form (a = gamma * rstd * scale,
// center = the float32 mean, c = beta * scale - a * mean_lo), in which |mean| >> std stays
// accurate and a constant channel gives beta * scale exactly: c takes out the float32 mean's
// rounding (up to half its ulp, for |mean| >> std a visible part of a standard deviation), so
// the values are centered on the float64 mean. Otherwise PyTorch's a * v + b (center 0,
// c = (beta - mean * gamma * rstd) * scale), so that an infinite or NaN parameter gives the
// infinities and NaNs that PyTorch gives. a = 0 (rstd 0 where the squared deviations
// overflow, or a zero gamma or scale) takes center 0 too: c is then beta * scale either way,
// and a value farther than float32's range from the mean gives c, not 0 * inf.
// `centered_only` keeps the centered form for the other coefficients too (center = the mean,
// c = beta * scale), as PyTorch CUDA's GroupNorm does for inputs of one value per channel and
// its native BatchNorm kernel always: an infinite gamma then gives +-inf, NaN only where v is
// the mean.
// Stored as three rows of K entries: coef[k] = a, coef[K + k] = center, coef[2 * K + k] = c.
struct ChannelAffine {
    float a, center, c;

    __device__ static ChannelAffine of(float gamma, float beta, float scale,
                                       const NormMoments& m, bool centered_only = false) {
        const float g = gamma * m.rstd, b = beta - m.mean * g;
        const float as = g * scale, bs = b * scale, cs = beta * scale;
        if (isfinite(g) && isfinite(b) && isfinite(as) && isfinite(bs) && isfinite(cs)
            && as != 0.0f)  // mean_lo = 0 leaves cs, its sign of zero included
            return {as, m.mean, m.mean_lo == 0.0f ? cs : fmaf(-as, m.mean_lo, cs)};
        if (centered_only) return {as, m.mean, cs};
        return {as, 0.0f, bs};
    }
    __device__ static ChannelAffine identity() { return {1.0f, 0.0f, 0.0f}; }
    // Entry k; READ_ONLY loads through the read-only data cache, for coefficients that no
    // thread of the kernel writes.
    template <bool READ_ONLY = true>
    __device__ static ChannelAffine load(const float* coef, index_t K, index_t k) {
        if (READ_ONLY) return {__ldg(coef + k), __ldg(coef + K + k), __ldg(coef + 2 * K + k)};
        return {coef[k], coef[K + k], coef[2 * K + k]};
    }
    __device__ void store(float* coef, index_t K, index_t k) const {
        coef[k] = a;
        coef[K + k] = center;
        coef[2 * K + k] = c;
    }
    // Whether a and c are finite: with scale 1 (BatchNorm), whether gamma * rstd and
    // beta - mean * gamma * rstd are.
    __device__ bool finite() const { return isfinite(a) && isfinite(c); }
    __device__ float operator()(float v) const { return fmaf(a, v - center, c); }
};

// The exponents' reference of a softmax over values clamped to [lo, hi] without a max pass:
// halfway between the least value the clamp gives, min(lo, hi) (hi where lo > hi), and hi.
// For hi - lo <= 60 (checked on the host, skips_max) every exp(v - ref) lies in
// [e^-30, e^30], so a row's sum neither overflows nor underflows, and the factor scale / sum
// stays a normal float32 for |scale| between about 1e-25 * (values a row) and 1e25.
__device__ __forceinline__ float clamp_middle(float lo, float hi) {
    const float floor = fminf(lo, hi);
    return floor + 0.5f * (hi - floor);
}

// The (split, channel tile, sample) of a block in the 1-D grid of a pass over a convolution
// output, splits x c_tiles blocks per sample, last samples first: the convolution wrote them
// last, so they are the ones that may still be in L2 (the pass after this one then visits
// the samples first-first, reading the last-written ones of this pass first). The whole
// block order is reversed, splits and tiles within a sample too (no pass depends on it).
struct SampleBlock {
    int split, tile;
    index_t n;
};

__device__ __forceinline__ SampleBlock sample_block_last_first(int splits, int c_tiles) {
    const unsigned b = gridDim.x - 1 - blockIdx.x;  // 32-bit: fewer than 2**31 blocks
    return {int(b % splits), int(b / splits % c_tiles), index_t(b / (splits * c_tiles))};
}

// Sum over a warp; every lane gets it.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// NaN-propagating max over a warp; every lane gets it.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Sums of (s1, s2) pairs of statistics over the lanes that share their bits below `lowest` (a
// power of two): lane offsets 16, 8, ..., lowest; every lane of such a group gets its sum. The
// loop stops at a warp-uniform `break`, so a runtime `lowest` keeps the shuffles unrolled.
__device__ __forceinline__ double2 warp_sum_above(double2 v, int lowest) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        if (offset < lowest) break;
        v.x += __shfl_xor_sync(0xffffffffu, v.x, offset);
        v.y += __shfl_xor_sync(0xffffffffu, v.y, offset);
    }
    return v;
}

__device__ __forceinline__ double2 warp_sum(double2 v) { return warp_sum_above(v, 1); }

// A reduction over the whole block (blockDim.x * blockDim.y a multiple of 32, at most 1024
// threads): each warp reduces with `warp` (a warp_sum or warp_max), the warps' results meet in
// `scratch` (32 values) and the first warp reduces them, `identity` filling its idle lanes.
// Every thread gets the result.
template <typename T, typename Warp>
__device__ T block_reduce(T v, T* scratch, T identity, Warp warp) {
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int nwarps = (blockDim.x * blockDim.y) >> 5;
    v = warp(v);
    __syncthreads();  // scratch may still be read by a previous call
    if ((tid & 31) == 0) scratch[tid >> 5] = v;
    __syncthreads();
    v = (tid < nwarps) ? scratch[tid] : identity;
    if (tid < 32) v = warp(v);
    if (tid == 0) scratch[0] = v;
    __syncthreads();
    return scratch[0];
}

// Sum over the whole block of a number or a double2 pair (one set of barriers for both sums).
// `scratch` holds 32 of them.
template <typename T>
__device__ T block_sum(T v, T* scratch) {
    return block_reduce(v, scratch, T{}, [](T u) { return warp_sum(u); });
}

// NaN-propagating max over the whole block. `scratch` holds 32 floats.
__device__ __forceinline__ float block_max(float v, float* scratch) {
    return block_reduce(v, scratch, -INFINITY, [](float u) { return warp_max(u); });
}

// i / d for 0 <= i < 2**31 and 0 < d < 2**31 without an integer division: a float estimate
// times the precomputed inv_d = 1.0f / d, then corrected (one step at most for i < 2**24,
// about i / d / 2**24 beyond). The checks multiply in unsigned 32 bits: the estimate's q * d
// stays within i * (1 + 2**-22) and (q + 1) * d, once q * d <= i, within i + d, both below
// 2**32, where signed products near 2**31 would wrap.
__device__ __forceinline__ int quotient(int i, int d, float inv_d) {
    unsigned q = (unsigned)__float2int_rz((float)i * inv_d);
    const unsigned ui = (unsigned)i, ud = (unsigned)d;
    while (q * ud > ui) --q;
    while ((q + 1) * ud <= ui) ++q;
    return (int)q;
}

// [begin, end): the part of 0 .. total - 1 that split `split` of `splits` equal parts covers.
template <class I>
__device__ __forceinline__ void split_range(I total, int splits, int split, I& begin, I& end) {
    const I chunk = (total + splits - 1) / splits;
    begin = split * chunk;
    end = min(total, begin + chunk);
}

// Row and column of position p in rows of `width` values (inv_width = 1.0f / width).
__device__ __forceinline__ void row_col(int p, int width, float inv_width, int& row, int& col) {
    row = quotient(p, width, inv_width);
    col = p - row * width;
}

// Offset of value (n, c, p) in a channels-last tensor of C channels and P positions stored in
// blocks of `block` channels, (N, C / block, P, block). block = C is plain channels-last
// (N, P, C); block = a GroupNorm group's channel count puts each (n, group) row on the bytes
// that the row has in NCHW, so a pass that turns one layout into the other can run in place.
__device__ __forceinline__ index_t blocked_channels_last(index_t n, int c, index_t p, int C,
                                                         index_t P, int block) {
    return (n * C + c / block * block) * P + p * block + c % block;
}

// VEC (1 or 4) consecutive floats p[VEC * i ...] in the first VEC lanes of a float4 (VEC = 4:
// one 16-byte access, p 16-byte aligned). No __ldg: callers may write where they read.
template <int VEC>
__device__ __forceinline__ float4 load_vec(const float* p, index_t i) {
    if (VEC == 4) return reinterpret_cast<const float4*>(p)[i];
    return make_float4(p[i], 0.0f, 0.0f, 0.0f);
}

template <int VEC>
__device__ __forceinline__ void store_vec(float* p, index_t i, float4 v) {
    if (VEC == 4)
        reinterpret_cast<float4*>(p)[i] = v;
    else
        p[i] = v.x;
}

// f(i, v) for the vectors i = first, first + stride, ... < n of src (v: VEC values, see
// load_vec), with UNROLL loads in flight per thread before any is used.
template <int VEC, int UNROLL, class I, class F>
__device__ __forceinline__ void for_each_vector(const float* src, I first, I n, I stride, F&& f) {
    for (I i0 = first; i0 < n; i0 += UNROLL * stride) {
        float4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            if (i0 + u * stride < n) v[u] = load_vec<VEC>(src, i0 + u * stride);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const I i = i0 + u * stride;
            if (i >= n) break;
            f(i, v[u]);
        }
    }
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

// The residue classes of a sub-pixel transposed convolution (see cufused/_subpixel.py) are
// stored class-major: blocks [P][R][Md][Mh][Mw], P = sd * sh * SW classes, class index
// (rd * sh + rh) * SW + rw, R = N * C rows. This visits the NC(D)HW output
// out[R][sd * Md][sh * Mh][SW * Mw] with coalesced reads and writes: each item reads VEC
// consecutive values of each of the SW classes that share a (row, d, h) and writes their
// SW * VEC interleaved outputs; op.row(r) is called once per item, op(v) maps each value.
// VEC = 4 needs Mw % 4 == 0 and 16-byte aligned buffers.
template <int SW, int VEC, class Op>
__device__ __forceinline__ void interleave_classes(const float* __restrict__ classes,
                                                   float* __restrict__ out, index_t rows,
                                                   int Md, int Mh, int Mw, int sd, int sh,
                                                   Op op) {
    const int wvecs = Mw / VEC;
    const index_t plane_items = (index_t)sd * Md * sh * Mh;  // (d, h) pairs of one output row
    const bool narrow = plane_items < (1LL << 31);  // 32-bit division of dh below
    const index_t block = rows * Md * Mh * (index_t)Mw;
    const index_t items = rows * plane_items * wvecs;
    for (index_t i = blockIdx.x * (index_t)blockDim.x + threadIdx.x; i < items;
         i += (index_t)gridDim.x * blockDim.x) {
        const index_t t = i / wvecs;
        const int wv = (int)(i - t * wvecs);
        const index_t row = t / plane_items;
        const index_t dh = t - row * plane_items;
        const int d = narrow ? (int)dh / (sh * Mh) : (int)(dh / (sh * Mh));
        const int h = (int)(dh - (index_t)d * (sh * Mh));
        const int rd = d % sd, qd = d / sd, rh = h % sh, qh = h / sh;
        const float* src = classes + (index_t)((rd * sh + rh) * SW) * block +
                           (row * Md * Mh + (index_t)qd * Mh + qh) * Mw + wv * VEC;
        float v[SW][VEC];
#pragma unroll
        for (int rw = 0; rw < SW; ++rw) {
            if (VEC == 4) {
                const float4 q = __ldg(reinterpret_cast<const float4*>(src + rw * block));
                v[rw][0] = q.x; v[rw][1] = q.y; v[rw][2] = q.z; v[rw][3] = q.w;
            } else {
#pragma unroll
                for (int j = 0; j < VEC; ++j) v[rw][j] = __ldg(src + rw * block + j);
            }
        }
        op.row(row);
        float* dst = out + (t * (index_t)SW * Mw) + (index_t)wv * VEC * SW;
        if ((SW * VEC) % 4 == 0) {
#pragma unroll
            for (int q = 0; q < SW * VEC / 4; ++q) {
                float o[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) o[e] = op(v[(4 * q + e) % SW][(4 * q + e) / SW]);
                reinterpret_cast<float4*>(dst)[q] = make_float4(o[0], o[1], o[2], o[3]);
            }
        } else {
#pragma unroll
            for (int e = 0; e < SW * VEC; ++e) dst[e] = op(v[e % SW][e / SW]);
        }
    }
}

// v as a double, a denormal one included: the kernels are built with -ftz=true, under which
// the float-to-double conversion (cvt.ftz.f64.f32) flushes a denormal to zero, so such a
// value is converted from its bits (its significand times 2^-149).
__device__ __forceinline__ double exact_double(float v) {
    const unsigned bits = __float_as_uint(v);
    if (bits & 0x7f800000u) return (double)v;  // normal, infinite or NaN
    const double magnitude = (double)(bits & 0x007fffffu) * 0x1p-149;
    return bits >> 31 ? -magnitude : magnitude;
}

// A position (od, oh, ow) of a plane of Do x Ho x Wo outputs (which may pass 2**31), stepped
// by a fixed count of outputs with carries: a loop over a plane's outputs then divides by
// neither Ho * Wo nor Wo (a 64-bit division is a call in SASS, whose live registers spill).
struct PlaneWalk {
    int3 at, step;
    int Ho, Wo;

    // From output first by stride outputs a step (both below 2**31).
    __device__ PlaneWalk(int first, int stride, int Ho_, int Wo_)
        : at(position(first, Ho_, Wo_)), step(position(stride, Ho_, Wo_)), Ho(Ho_), Wo(Wo_) {}

    __device__ static int3 position(int o, int Ho, int Wo) {
        int od = 0, r = o;
        if ((index_t)Ho * Wo <= o) {  // else o lies in the first layer
            od = o / (Ho * Wo);
            r = o - od * (Ho * Wo);
        }
        const int oh = r / Wo;
        return make_int3(od, oh, r - oh * Wo);
    }

    // Unsigned sums: a size near 2**31 plus a step stays below 2**32.
    __device__ void advance() {
        unsigned z = (unsigned)at.z + (unsigned)step.z, y = (unsigned)at.y + (unsigned)step.y;
        if (z >= (unsigned)Wo) {
            z -= (unsigned)Wo;
            ++y;
        }
        if (y >= (unsigned)Ho) {
            y -= (unsigned)Ho;
            ++at.x;
        }
        at.x += step.x;
        at.y = (int)y;
        at.z = (int)z;
    }
};

// The operands and geometry of a convolution by its definition (TransposedConvDefinition,
// ForwardConvDefinition; brace-initialized in this order): x (N, C_in, Di, Hi, Wi) in element
// strides xn .. xw, the contiguous weight, the input and output channels per group, the input,
// output and kernel sizes, strides, paddings and dilations (2-D as 3-D with a unit depth).
struct ConvGeometry {
    const float* x;
    const float* w;
    int c_in_group, c_out_group, Di, Hi, Wi, Do, Ho, Wo, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd,
        dh, dw;
    index_t xn, xc, xd, xh, xw;

    // Outputs per (sample, channel) row.
    __device__ index_t plane() const { return (index_t)Do * Ho * Wo; }
};

// A transposed 3-D convolution by its definition (PyTorch's): output o of channel c is the sum
// of x[i] * w[ci, c, k] over the (input, tap) pairs with o = i * stride - padding + k *
// dilation, so a non-finite weight meets only real inputs. A convolution algorithm that also
// multiplies zeros (those a stride inserts, padding, the zeros past the input's edge of a
// sub-pixel implicit GEMM) puts NaNs where the definition has no product: the outputs of an
// output channel with a non-finite weight are recomputed with this (whole rows, or a tile's
// outputs at a time, at). x (N, C_in, Di, Hi, Wi) in element strides xn .. xw; w (C_in, C /
// groups, KD, KH, KW) contiguous.
struct TransposedConvDefinition : ConvGeometry {
    // w[ci, col, tap] for input channel ci_local of output channel c's group.
    __device__ float weight(int c, int ci_local, int tap) const {
        const int group = c / c_out_group, col = c - group * c_out_group;
        return w[((index_t)(group * c_in_group + ci_local) * c_out_group + col) * (KD * KH * KW) +
                 tap];
    }

    // Whether output channel c's weight (every input channel of its group, every tap) is
    // finite, for the whole block (one barrier).
    __device__ bool block_finite_weight(int c) const {
        const int taps = KD * KH * KW;
        int nonfinite = 0;
        for (int i = threadIdx.x; i < c_in_group * taps; i += blockDim.x)
            nonfinite |= !isfinite(weight(c, i / taps, i % taps));
        return !__syncthreads_or(nonfinite);
    }


    // b plus output o (flat over the Do x Ho x Wo plane) of sample n, channel c.
    __device__ __forceinline__ float at(index_t n, int c, index_t o, float b) const {
        const int od = (int)(o / ((index_t)Ho * Wo)), r = (int)(o % ((index_t)Ho * Wo));
        const int oh = r / Wo;
        return at(n, c, od, oh, r - oh * Wo, b);
    }

    // b plus output (od, oh, ow) of sample n, channel c.
    __device__ __forceinline__ float at(index_t n, int c, int od, int oh, int ow, float b) const {
        const float* xs = x + n * xn + (index_t)(c / c_out_group) * c_in_group * xc;
        float v = b;
        for (int kd = 0; kd < KD; ++kd) {
            const int td = od + pd - kd * dd;
            if (td < 0 || td % sd || td / sd >= Di) continue;
            for (int kh = 0; kh < KH; ++kh) {
                const int th = oh + ph - kh * dh;
                if (th < 0 || th % sh || th / sh >= Hi) continue;
                for (int kw = 0; kw < KW; ++kw) {
                    const int tw = ow + pw - kw * dw;
                    if (tw < 0 || tw % sw || tw / sw >= Wi) continue;
                    const float* xi = xs + (td / sd) * xd + (th / sh) * xh + (tw / sw) * xw;
                    const int tap = (kd * KH + kh) * KW + kw;
                    for (int ci = 0; ci < c_in_group; ++ci) v += xi[ci * xc] * weight(c, ci, tap);
                }
            }
        }
        return v;
    }

    // Rewrites the (n, c) row of out (contiguous rows of plane() values, C channels) by the
    // definition plus bias[c], each thread of the block the outputs o = threadIdx.x + k
    // blockDim.x, and returns the row.
    __device__ float* rewrite_row(const float* bias, float* out, int C, index_t n,
                                  int c) const {
        const float b = bias ? bias[c] : 0.0f;
        const index_t length = plane();
        float* row = out + (n * C + c) * length;
        for (index_t o = threadIdx.x; o < length; o += blockDim.x) row[o] = at(n, c, o, b);
        return row;
    }
};

// A forward convolution by its definition (PyTorch's): output o of channel c is the sum of
// x[i] * w[c, ci, k] over every tap k, i = o * stride - padding + k * dilation, a tap past the
// input's edge multiplying a padding zero (0 * inf and 0 * NaN are NaN). x (N, C_in, Di, Hi,
// Wi) in element strides xn .. xw; w (C, C_in / groups, KD, KH, KW) contiguous.
struct ForwardConvDefinition : ConvGeometry {
    // Whether output channel c's weight is finite, for the whole block (one barrier).
    __device__ bool block_finite_weight(int c) const {
        const int count = c_in_group * KD * KH * KW;
        const float* wc = w + (index_t)c * count;
        int nonfinite = 0;
        for (int i = threadIdx.x; i < count; i += blockDim.x) nonfinite |= !isfinite(wc[i]);
        return !__syncthreads_or(nonfinite);
    }


    // b plus output (od, oh, ow) of sample n, channel c.
    __device__ __forceinline__ float at(index_t n, int c, int od, int oh, int ow, float b) const {
        const int taps = KD * KH * KW;
        const float* xs = x + n * xn + (index_t)(c / c_out_group) * c_in_group * xc;
        const float* wc = w + (index_t)c * c_in_group * taps;
        float v = b;
        for (int kd = 0; kd < KD; ++kd) {
            const long long id = (long long)od * sd - pd + (long long)kd * dd;
            for (int kh = 0; kh < KH; ++kh) {
                const long long ih = (long long)oh * sh - ph + (long long)kh * dh;
                for (int kw = 0; kw < KW; ++kw) {
                    const long long iw = (long long)ow * sw - pw + (long long)kw * dw;
                    const bool inside =
                        id >= 0 && id < Di && ih >= 0 && ih < Hi && iw >= 0 && iw < Wi;
                    const int tap = (kd * KH + kh) * KW + kw;
                    for (int ci = 0; ci < c_in_group; ++ci)
                        v += (inside ? xs[ci * xc + id * xd + ih * xh + iw * xw] : 0.0f) *
                             wc[ci * taps + tap];
                }
            }
        }
        return v;
    }
};
