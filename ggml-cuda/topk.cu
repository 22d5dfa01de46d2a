// topk.cu - exact top-k of many score lists (twin: ws_select_top of
// native/src/kv/policies/common/window-select.c). One thread block per list: a radix select
// over the unique 64-bit keys of topk-radix.cuh finds the k-th largest key K in 64 / 8 passes
// over the list (a shared histogram of the next 8 bits of the keys that match the digits
// chosen so far, then one thread picks the digit), so the selected entries are exactly those
// with key >= K; a final pass writes their indices in ascending order (per chunk of the
// block's threads: a ballot per warp, the warps' counts added in warp order).
#include "common.cuh"
#include "policy-kernels.h"
#include "topk-radix.cuh"

#define TOPK_THREADS 256
#define TOPK_WARPS (TOPK_THREADS / CUDA_WARP)

static __global__ void __launch_bounds__(TOPK_THREADS)
select_top_kernel(const float *__restrict__ scores, const int64_t *__restrict__ off, const int32_t *__restrict__ n_of,
                  const int32_t *__restrict__ k_of, int32_t *__restrict__ idx, int32_t *__restrict__ count) {
    __shared__ uint32_t hist[TOPK_BINS];
    __shared__ uint64_t prefix_s;
    __shared__ uint32_t need_s;
    __shared__ uint32_t warp_count[TOPK_WARPS];
    const int i = blockIdx.x, tid = threadIdx.x, lane = tid % CUDA_WARP, warp = tid / CUDA_WARP;
    const int64_t o = off[i];
    const int32_t n = n_of[i] > 0 ? n_of[i] : 0;
    const int32_t k = k_of[i] < 0 ? 0 : k_of[i] > n ? n : k_of[i];
    const float *s = scores + o;
    int32_t *out = idx + o;
    if (tid == 0 && count) count[i] = k;
    if (k == 0) return;
    if (k == n) {
        for (int32_t j = tid; j < n; j += TOPK_THREADS) out[j] = j;
        return;
    }

    // The k-th largest key: fix its digits from the top, keeping only the keys that share
    // the digits fixed so far (mask) in play.
    uint64_t prefix = 0, mask = 0;
    if (tid == 0) need_s = (uint32_t)k;
    for (int shift = 64 - TOPK_RADIX_BITS; shift >= 0; shift -= TOPK_RADIX_BITS) {
        for (int b = tid; b < TOPK_BINS; b += TOPK_THREADS) hist[b] = 0;
        __syncthreads();
        for (int32_t j = tid; j < n; j += TOPK_THREADS) {
            const uint64_t key = topk_key(s[j], (uint32_t)j);
            if ((key & mask) == prefix) atomicAdd(&hist[topk_digit(key, shift)], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            uint32_t need = need_s;
            const uint32_t digit = topk_pick_digit(hist, &need);
            need_s = need;
            prefix_s = prefix | ((uint64_t)digit << shift);
        }
        __syncthreads();
        prefix = prefix_s;
        mask |= (uint64_t)(TOPK_BINS - 1) << shift;
    }
    const uint64_t kth = prefix;   // every digit fixed: the key itself

    // Entries with key >= kth (exactly k of them, the keys being unique), in index order.
    int32_t base = 0;
    for (int32_t j0 = 0; j0 < n; j0 += TOPK_THREADS) {
        const int32_t j = j0 + tid;
        const bool sel = j < n && topk_key(s[j], (uint32_t)j) >= kth;
        const uint32_t ballot = __ballot_sync(0xFFFFFFFFu, sel);
        if (lane == 0) warp_count[warp] = (uint32_t)__popc(ballot);
        __syncthreads();
        int32_t before = 0, total = 0;
        for (int w = 0; w < TOPK_WARPS; w++) {
            before += w < warp ? (int32_t)warp_count[w] : 0;
            total += (int32_t)warp_count[w];
        }
        if (sel) out[base + before + __popc(ballot & ((1u << lane) - 1u))] = j;
        base += total;
        __syncthreads();   // warp_count is rewritten by the next chunk
    }
}

extern "C" void cuda_select_top(cuda_stream s, const float *scores, const int64_t *off, const int32_t *n,
                                const int32_t *k, int32_t m, int32_t *idx, int32_t *count) {
    if (m <= 0) return;
    select_top_kernel<<<(unsigned)m, TOPK_THREADS, 0, s>>>(scores, off, n, k, idx, count);
}
