// Kernels that keep data on chip across a grid-wide barrier. They are launched cooperatively
// (cufused._cuda.COOPERATIVE_FILES), so the driver guarantees that every block of the grid is
// resident at once and the blocks may wait for each other.
#include "common.cuh"

// A grid-wide barrier at which the last block to arrive runs last() before any block goes
// on: gate[0] counts arrivals, gate[1] is the release flag, both zero at launch (one use per
// launch). Fences order every block's writes before last() and last()'s writes before the
// release.
template <class Last>
__device__ __forceinline__ void grid_barrier_last(int* gate, Last&& last) {
    __shared__ int is_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        is_last = atomicAdd(gate, 1) == (int)gridDim.x - 1;
    }
    __syncthreads();
    if (is_last) {
        __threadfence();
        last();
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) atomicExch(gate + 1, 1);
    } else {
        if (threadIdx.x == 0) {
            while (*(volatile int*)(gate + 1) == 0) __nanosleep(64);
            __threadfence();
        }
        __syncthreads();
    }
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
// in place. Then, at the grid barrier, the last block turns the per-block shifted sums into
// BatchNorm's per-channel (a, b) (coef[c], coef[C + c]) and updates the running buffers, and
// every block maps its units (tanh(a * e + b)) and normalizes each (GroupNorm, shifted sums)
// from registers: the spilled units first, last-written first (the most likely still in the
// L2), then the kept ones. A lane holds its windows p = lane + 32 * i, i < I (P <= 32 * I)
// of its warp's channel from the first read to the last write, so it reads only what it
// wrote itself until the units' shift (value 0 of channel g * Cg), which the barrier orders.
// partial holds C * J float2 (a block's sums per channel), gate 2 zeroed ints.
template <int I>
__global__ void __launch_bounds__(1024) pool2_batch_norm_tanh_group_norm(
        const float* __restrict__ y, float* __restrict__ out,
        const float* __restrict__ bn_gamma, const float* __restrict__ bn_beta,
        const float* __restrict__ gn_gamma, const float* __restrict__ gn_beta,
        float2* __restrict__ partial, float* __restrict__ coef, int* __restrict__ gate,
        float* running_mean, float* running_var, const float* __restrict__ mean_offset,
        int N, int C, int G, int H, int W, int slots, float eps, float momentum) {
    constexpr int U = 5;  // windows per lane with their loads in flight at once
    extern __shared__ float4 kept_raw[];
    float* kept = reinterpret_cast<float*>(kept_raw);
    __shared__ float2 scratch[32];
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

    grid_barrier_last(gate, [&] {
        const double count = (double)N * HW;
        for (int ch = w; ch < C; ch += blockDim.x >> 5) {
            double2 s = make_double2(0.0, 0.0);
            for (int b = lane; b < J; b += 32) {
                const float2 v = __ldcg(partial + (index_t)ch * J + b);
                s.x += v.x;
                s.y += v.y;
            }
            s = warp_sum(s);
            if (lane == 0) {
                double mean, var;
                shifted_moments(s, count, y[(index_t)ch * HW], mean, var);
                const float rstd = (float)(1.0 / sqrt(var + (double)eps));
                const float a = (bn_gamma ? bn_gamma[ch] : 1.0f) * rstd;
                coef[ch] = a;
                coef[C + ch] = (bn_beta ? bn_beta[ch] : 0.0f) - (float)mean * a;
                update_running_stats(running_mean, running_var, ch, mean, var, count,
                                     mean_offset, momentum);
            }
        }
    });

    const float a = __ldcg(coef + c), b = __ldcg(coef + C + c);
    const float a0 = __ldcg(coef + g * cg), b0 = __ldcg(coef + C + g * cg);
    const float gamma = gn_gamma ? gn_gamma[c] : 1.0f, beta = gn_beta ? gn_beta[c] : 0.0f;
    const int n_kept = min(slots, units), n_spilled = units - n_kept;
    for (int q = 0; q < units; ++q) {
        const int k = q < n_spilled ? units - 1 - q : q - n_spilled;
        const index_t n = N - 1 - j - (index_t)k * J;
        float* unit_out = out + (n * C + g * cg) * (index_t)P;
        const float* unit_ext = k < slots ? kept + k * cg * P : unit_out;
        const float unit_shift = tanh_branchless(fmaf(a0, unit_ext[0], b0));
        float t[I];
        float u1 = 0.0f, u2 = 0.0f;
#pragma unroll
        for (int i = 0; i < I; ++i) {
            const int p = lane + 32 * i;
            if (p < P) {
                t[i] = tanh_branchless(fmaf(a, unit_ext[w * P + p], b));
                const float d = t[i] - unit_shift;
                u1 += d;
                u2 = fmaf(d, d, u2);
            }
        }
        float mean, rstd;
        row_moments(u1, u2, unit_shift, cg * P, eps, scratch, mean, rstd);  // all read [0]
        const float scale = gamma * rstd;
#pragma unroll
        for (int i = 0; i < I; ++i) {
            const int p = lane + 32 * i;
            if (p < P) unit_out[w * P + p] = fmaf(scale, t[i] - mean, beta);
        }
    }
}
