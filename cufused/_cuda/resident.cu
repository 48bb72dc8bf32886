// Kernels that keep data on chip across a grid-wide barrier. They are launched cooperatively
// (cufused._cuda.COOPERATIVE_FILES), so the driver guarantees that every block of the grid is
// resident at once and the blocks may wait for each other.
#include "common.cuh"

// A grid-wide barrier (one use per launch, *count zero at launch): each block's writes before
// it are visible to every block after it.
__device__ __forceinline__ void grid_barrier(int* count) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(count, 1);
        while (*(volatile int*)count < (int)gridDim.x) __nanosleep(128);
        __threadfence();
    }
    __syncthreads();
}

// Pipeline B after its convolution, in one kernel: 2 x 2 max pool of y (N, C, H, W; NCHW,
// contiguous, H and W even) -> BatchNorm with batch statistics -> tanh -> GroupNorm, into
// out (N, C, H / 2, W / 2). Max-pooling commutes with BatchNorm's affine a * v + b when
// a >= 0 and becomes a min when a < 0; a = bn_gamma * rstd has the sign of bn_gamma, known
// before the statistics, so the pooled extremum is taken in the same read as the statistics.
//
// Block (32 * Cg): warp w always handles channel c = g * Cg + w of the block's group g, over
// the samples n = N - 1 - j - k * J (k < units; J = gridDim.x / G blocks per group, j the
// block's index among them; last samples first: the convolution wrote them last, so some are
// still in the L2). A (sample, group) unit's Cg * P extrema (P = H * W / 4) stay in shared
// memory for the block's first `slots` units; the rest go to out, where they are normalized
// in place. After the grid barrier every warp forms its channel's BatchNorm (a, b) from the
// blocks' shifted sums (partial: C * J float2; every block sums them in the same order, so
// all agree), block j = 0 of each group updates the running buffers, and each block maps its
// units (tanh(a * e + b)) and normalizes them (GroupNorm, shifted sums) from registers: the
// spilled units first, last-written first (the most likely still in the L2), then the kept
// ones, each unit's loads issued while the previous unit is reduced. A lane holds its windows
// p = lane + 32 * i, i < I (P <= 32 * I) of its warp's channel from the first read to the last
// write, so it reads only what it wrote itself, but for the unit's shift (value 0 of channel
// g * Cg), which barriers order. gate: one zeroed int.
template <int I>
__global__ void __launch_bounds__(1024) pool2_batch_norm_tanh_group_norm(
        const float* __restrict__ y, float* __restrict__ out,
        const float* __restrict__ bn_gamma, const float* __restrict__ bn_beta,
        const float* __restrict__ gn_gamma, const float* __restrict__ gn_beta,
        float2* __restrict__ partial, int* __restrict__ gate, float* running_mean,
        float* running_var, const float* __restrict__ mean_offset, int N, int C, int G, int H,
        int W, int slots, float eps, float momentum) {
    constexpr int U = 7;  // windows per lane with loads in flight at once (10 spills)
    extern __shared__ float4 kept_raw[];
    float* kept = reinterpret_cast<float*>(kept_raw);
    __shared__ float2 scratch[32];
    __shared__ float2 first_channel;  // (a, b) of channel g * Cg, for the units' shift
    const int cg = C / G, Wo = W / 2, P = (H / 2) * Wo, HW = H * W;
    const int J = gridDim.x / G;
    const int g = blockIdx.x / J, j = blockIdx.x - g * J;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int c = g * cg + w;
    const int units = (N - 1 - j) / J + 1;
    const float shift = y[(index_t)c * HW];  // sample 0's first value: a shift for the sums
    const float sgn = (bn_gamma ? bn_gamma[c] : 1.0f) < 0.0f ? -1.0f : 1.0f;
    // The lane's first window (row, column) and the step of 32 windows, without a division
    // per window.
    const float inv_wo = 1.0f / Wo;
    const int row0 = quotient(lane, Wo, inv_wo), col0 = lane - row0 * Wo;
    const int row_step = quotient(32, Wo, inv_wo), col_step = 32 - row_step * Wo;
    float s1 = 0.0f, s2 = 0.0f;
    for (int k = 0; k < units; ++k) {
        const index_t n = N - 1 - j - (index_t)k * J;
        const float* plane = y + (n * C + c) * (index_t)HW;
        float* ext = k < slots ? kept + (k * cg + w) * P : out + (n * C + c) * (index_t)P;
        int row = row0, col = col0;
#pragma unroll
        for (int i0 = 0; i0 < I; i0 += U) {
            float2 top[U], bottom[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (i0 + u < I && lane + 32 * (i0 + u) < P) {
                    const float* win = plane + 2 * (row * W + col);
                    top[u] = __ldcs(reinterpret_cast<const float2*>(win));
                    bottom[u] = __ldcs(reinterpret_cast<const float2*>(win + W));
                }
                row += row_step;
                col += col_step;
                if (col >= Wo) {
                    col -= Wo;
                    ++row;
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int p = lane + 32 * (i0 + u);
                if (i0 + u >= I || p >= P) break;
                const float v[4] = {top[u].x, top[u].y, bottom[u].x, bottom[u].y};
                float e = -INFINITY;
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const float d = v[q] - shift;
                    s1 += d;
                    s2 = fmaf(d, d, s2);
                    e = fmaxf(e, sgn * v[q]);  // NaN-dropping: see ChannelStats in pooling.cu
                }
                ext[p] = sgn * e;
            }
        }
    }
    s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    if (lane == 0) partial[(index_t)c * J + j] = make_float2(s1, s2);
    grid_barrier(gate);

    float a, b;
    {
        double2 s = make_double2(0.0, 0.0);
        for (int blk = lane; blk < J; blk += 32) {
            const float2 v = __ldcg(partial + (index_t)c * J + blk);
            s.x += v.x;
            s.y += v.y;
        }
        s = warp_sum(s);
        const double count = (double)N * HW;
        double mean, var;
        shifted_moments(s, count, shift, mean, var);
        const float rstd = (float)(1.0 / sqrt(var + (double)eps));
        a = (bn_gamma ? bn_gamma[c] : 1.0f) * rstd;
        b = (bn_beta ? bn_beta[c] : 0.0f) - (float)mean * a;
        if (lane == 0 && j == 0)
            update_running_stats(running_mean, running_var, c, mean, var, count, mean_offset,
                                 momentum);
        if (threadIdx.x == 0) first_channel = make_float2(a, b);
        __syncthreads();
    }
    const float a0 = first_channel.x, b0 = first_channel.y;
    const float gamma = gn_gamma ? gn_gamma[c] : 1.0f, beta = gn_beta ? gn_beta[c] : 0.0f;
    const int n_kept = min(slots, units), n_spilled = units - n_kept;
    // Unit q of the visiting order: spilled units last-written first, then the kept ones.
    const auto unit_of = [&](int q) { return q < n_spilled ? units - 1 - q : q - n_spilled; };
    const auto unit_out = [&](int k) {
        return out + ((N - 1 - j - (index_t)k * J) * C + g * cg) * (index_t)P;
    };
    const auto unit_ext = [&](int k) -> const float* {
        return k < slots ? kept + k * cg * P : unit_out(k);
    };
    float e[I], e0;
    const auto load_unit = [&](int k) {
        const float* src = unit_ext(k);
        e0 = src[0];
#pragma unroll
        for (int i = 0; i < I; ++i)
            if (lane + 32 * i < P) e[i] = src[w * P + lane + 32 * i];
    };
    load_unit(unit_of(0));
    for (int q = 0; q < units; ++q) {
        float* dst = unit_out(unit_of(q)) + w * P;
        const float unit_shift = tanh_branchless(fmaf(a0, e0, b0));
        float t[I];
        float u1 = 0.0f, u2 = 0.0f;
#pragma unroll
        for (int i = 0; i < I; ++i) {
            if (lane + 32 * i < P) {
                t[i] = tanh_branchless(fmaf(a, e[i], b));
                const float d = t[i] - unit_shift;
                u1 += d;
                u2 = fmaf(d, d, u2);
            }
        }
        if (q + 1 < units) load_unit(unit_of(q + 1));
        float mean, rstd;
        row_moments(u1, u2, unit_shift, cg * P, eps, scratch, mean, rstd);
        const float scale = gamma * rstd;
#pragma unroll
        for (int i = 0; i < I; ++i)
            if (lane + 32 * i < P) dst[lane + 32 * i] = fmaf(scale, t[i] - mean, beta);
    }
}
