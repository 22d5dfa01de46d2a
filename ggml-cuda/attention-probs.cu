// attention-probs.cu - a decode step's attention probabilities per query head (twin:
// attention_weights of native/src/cpu/attention.c, which gives the CPU's attention sums on a
// decode step), for the policies that evict as they decode (h2o, tova, cake, ems). One block
// per query head; the list's length is read from n_dev when it is set, so a recorded decode
// step computes them at every step:
//  1. the logits x = q . k_j / sqrt(d) into the output row (a warp per entry, the window
//     kernel's lane layout and warp sum), and the row's max (of a merged entry: its largest
//     member logit, norm * x at either end of its ascending norms);
//  2. exp(x - max) in place (a merged entry: the sum over its members of exp(norm * x - max),
//     member order), and their sum in a fixed order (per thread, then per warp, then the
//     warps in order), so the result does not depend on the card;
//  3. each scaled by 1 / sum, as the CPU's softmax scales by the reciprocal.
#include "common.cuh"
#include "kv-rows.cuh"
#include "policy-kernels.h"
#include "window-math.cuh"

#define PROBS_THREADS 256
#define PROBS_WARPS (PROBS_THREADS / CUDA_WARP)

static __global__ void __launch_bounds__(PROBS_THREADS)
decode_probs_kernel(const struct cuda_kv_layer layer, const float *__restrict__ q, int group, float scale,
                    float *__restrict__ out, int64_t stride) {
    __shared__ float part[PROBS_WARPS];
    __shared__ float shared_m, shared_inv;
    const int h = blockIdx.x, g = h / group, d = layer.head_dim, fmt = layer.fmt_k;
    const int lane = threadIdx.x % CUDA_WARP, warp = threadIdx.x / CUDA_WARP;
    const int32_t n = layer.n_dev ? layer.n_dev[g] : layer.n[g];
    const float *qh = q + (size_t)h * d;
    float *row = out + (size_t)h * stride;
    const struct win_members mb = win_members_of(layer, g);

    float m = -INFINITY;   // the same in every lane of a warp: warp_sum gives each lane the sum
    for (int32_t j = warp; j < n; j += PROBS_WARPS) {
        float kreg[WIN_KREG];
        win_lane_key(kv_row(layer.k[g], fmt, d, j), fmt, d, lane, kreg);
        const float x = __fmul_rn(warp_sum(win_lane_dot(qh, kreg, d, lane)), scale);
        if (lane == 0) row[j] = x;
        m = fmaxf(m, win_entry_max(mb, j, x));
    }
    if (lane == 0) part[warp] = m;
    __syncthreads();   // the logits and the warps' maxima are written
    if (threadIdx.x == 0) {
        float M = -INFINITY;
        for (int w = 0; w < PROBS_WARPS; w++) M = fmaxf(M, part[w]);
        shared_m = M;
    }
    __syncthreads();
    const float M = shared_m;
    float s = 0.0f;
    for (int32_t j = threadIdx.x; j < n; j += PROBS_THREADS) {
        const float e = win_entry_exp(mb, j, row[j], M);
        row[j] = e;
        s += e;
    }
    s = warp_sum(s);
    __syncthreads();   // every thread has read M and part before part is written again
    if (lane == 0) part[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        float L = 0.0f;
        for (int w = 0; w < PROBS_WARPS; w++) L += part[w];
        shared_inv = L > 0.0f ? kv_div_rn(1.0f, L) : 0.0f;
    }
    __syncthreads();
    const float inv = shared_inv;
    for (int32_t j = threadIdx.x; j < n; j += PROBS_THREADS) row[j] = __fmul_rn(row[j], inv);
}

extern "C" void cuda_decode_probs(cuda_stream s, const struct cuda_kv_layer *layer, const float *q, int32_t n_head,
                                  float *out, int64_t stride) {
    const int d = layer->head_dim;
    if (n_head <= 0 || layer->n_head_kv <= 0 || n_head % layer->n_head_kv || d > WIN_MAX_D) return;
    decode_probs_kernel<<<(unsigned)n_head, PROBS_THREADS, 0, s>>>(*layer, q, n_head / layer->n_head_kv,
                                                                   1.0f / sqrtf((float)d), out, stride);
}
