// ctest-label: cuda
// test_cuda_value_weights.c - CriticalKV's value weights of a layer in GPU memory
// (critical_value_weights_device: the device's copy of W_o read by cuda_get_rows,
// ggml-cuda/value-weights.cu) against the same function on a copy of the layer in host memory
// (the host's W_o dequantized, the CPU's products), one line per case: values f32, f16
// and q8_0, head_dim 64 and 128, GQA groups 1, 2 and 4, 1 to 8 lists of up to 3000
// candidates (a list with none), n_embd not a multiple of the kernel's row stage, an F32
// and an F16 output projection; NMSE <= 1e-10 (float sums in another order).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/threadpool.h"
#include "cpu/quant.h"
#include "kv/kv-cache.h"
#include "kv/policies/criticalkv/critical.h"
#include "model/model.h"
#include "model/offload.h"

#define CUDA_CHECK_SEED 0x6A09E667F3BCC908ull
#include "cuda-check.h"
#include "twin-lists.h"

static void test_case(int fmt, int d, int n_kv, int group, int32_t n_max, int n_embd, int wo_type,
                      struct threadpool *pool) {
    const int n_head = n_kv * group;
    struct kv_cache host, dev;
    CHECK(kv_cache_init(&host, 1, n_kv, d, n_max, fmt, fmt) == PYKV_OK);
    CHECK(kv_cache_init(&dev, 1, n_kv, d, n_max, fmt, fmt) == PYKV_OK);
    kv_cache_set_device(&dev, 0, 0, NULL);
    float *k = malloc((size_t)n_max * d * sizeof(float)), *v = malloc((size_t)n_max * d * sizeof(float));
    int32_t n_cand[8];
    int64_t offset[8], total = 0;
    for (int g = 0; g < n_kv; g++) {
        const int32_t n = g == 0 ? n_max : 1 + next_int(n_max);
        for (size_t i = 0; i < (size_t)n * d; i++) {
            k[i] = uniform(-1.0f, 1.0f);
            v[i] = uniform(-1.0f, 1.0f) * (next_int(10) == 0 ? 5.0f : 1.0f);
        }
        twin_list_fill(&host, &dev, g, n, k, v);
        n_cand[g] = g == 1 ? 0 : n - next_int(n < 32 ? n : 32);   // the window's entries are no candidates
        offset[g] = total;
        total += n_cand[g];
    }
    // the output projection, (n_embd rows, n_head * d), as F32 or F16
    const size_t row = (size_t)n_head * d;
    float *wo = malloc((size_t)n_embd * row * sizeof(float));
    for (size_t i = 0; i < (size_t)n_embd * row; i++) wo[i] = uniform(-0.1f, 0.1f);
    void *wo_data = wo;
    if (wo_type == PYKV_TYPE_F16) {
        wo_data = malloc((size_t)n_embd * row * sizeof(uint16_t));
        fp32_to_fp16_row(wo, wo_data, (int64_t)(n_embd * row));
    }
    const struct tensor t = { .data = wo_data, .type = wo_type, .ne = { (int64_t)row, n_embd } };
    const size_t wo_bytes = (size_t)n_embd * row * (wo_type == PYKV_TYPE_F16 ? sizeof(uint16_t) : sizeof(float));
    const struct gpu_tensor t_dev = { .data = dev_upload(wo_data, wo_bytes), .type = wo_type,
                                      .ne = { (int64_t)row, n_embd } };   // the layer's copy on the GPU
    struct hparams hp = { .n_layer = 1, .n_embd = n_embd, .n_head = n_head, .n_head_kv = n_kv, .head_dim = d, .n_rot = d };
    struct ws_stats st = { .n_head_kv = n_kv, .group = group, .n_cand = n_cand, .offset_kv = offset, .total = total };
    float *want = malloc((size_t)(total + 1) * sizeof(float)), *got = malloc((size_t)(total + 1) * sizeof(float));
    struct policy_event eh = { .cache = &host, .hp = &hp, .pool = pool, .layer = 0, .wo = &t };
    struct policy_event ed = { .cache = &dev, .hp = &hp, .pool = pool, .layer = 0, .wo = &t, .wo_device = &t_dev };
    const int ran = ok(critical_value_weights(&eh, &st, want), "the host's weights") &&
                    ok(critical_value_weights(&ed, &st, got), "the device's weights");
    const double e = ran ? nmse(got, want, (size_t)total) : 1.0;
    printf("value weights v=%s d=%d lists=%d G=%d n<=%d n_embd=%d wo=%s: %lld candidates, NMSE %.2e\n",
           kv_format_name(fmt), d, n_kv, group, n_max, n_embd, wo_type == PYKV_TYPE_F16 ? "f16" : "f32",
           (long long)total, e);
    CHECK(ran);
    CHECK(e <= 1e-10);
    cuda_free(t_dev.data);
    if (wo_data != wo) free(wo_data);
    free(wo); free(k); free(v); free(want); free(got);
    kv_cache_free(&host);
    kv_cache_free(&dev);
}

int main(void) {
    if (!cuda_test_start("test_cuda_value_weights")) return CHECK_SKIP;
    CHECK(cuda_set_device(0) == PYKV_OK);
    struct threadpool *pool = threadpool_create(2);
    const int fmts[] = { KV_F32, KV_F16, KV_Q8_0 };
    for (int f = 0; f < 3; f++) {
        test_case(fmts[f], 64, 3, 4, 1500, 200, PYKV_TYPE_F32, pool);
        test_case(fmts[f], 128, 8, 1, 600, 96, PYKV_TYPE_F16, pool);
        test_case(fmts[f], 128, 2, 2, 3000, 77, PYKV_TYPE_F32, pool);
    }
    threadpool_free(pool);
    return check_report("test_cuda_value_weights");
}
