// ctest-label: cuda
// test_cuda_kvzip.c - KVzip's reconstruction pass on the GPU (cuda_kvzip_pass) against the
// pass computed here in double from its definition (each row's softmax over the sinks, the
// chunk and the pass's own entries up to the row; each chunk entry's largest weight), one line
// per case: keys f32, f16 and q8_0, head_dim 64 and 128, GQA groups 1 and 4, lists whose chunk
// starts at the sinks or past them, no sinks, passes of 1 to 96 rows; NMSE <= 1e-9.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-cuda/policy-kernels.h"
#include "kv/kv-cache.h"

#define CUDA_CHECK_SEED 0xBB67AE8584CAA73Bull
#include "cuda-check.h"

static void test_pass(int fmt, int d, int n_kv, int group, int32_t sink, int32_t width, int32_t T) {
    const int n_head = n_kv * group;
    struct kv_cache c;
    const int32_t before = 40;   // entries between the sinks and the chunk
    const int32_t n = sink + before + width + T;
    CHECK(kv_cache_init(&c, 1, n_kv, d, n, fmt, fmt) == PYKV_OK);
    struct cuda_kv_layer layer;
    memset(&layer, 0, sizeof(layer));
    layer.n_head_kv = n_kv;
    layer.head_dim = d;
    layer.fmt_k = layer.fmt_v = fmt;
    struct cuda_kvzip_args a = { .n_head = n_head, .T = T, .width = width };
    float k[PYKV_MAX_HEAD_DIM], v[PYKV_MAX_HEAD_DIM];
    for (int g = 0; g < n_kv; g++) {
        struct kv_list *l = kv_cache_list(&c, 0, g);
        CHECK(kv_list_reserve(&c, l, n) == PYKV_OK);
        for (int32_t j = 0; j < n; j++) {
            for (int i = 0; i < d; i++) { k[i] = uniform(-1.0f, 1.0f) * 2.0f; v[i] = 0.0f; }
            kv_list_push(&c, l, k, v, j);
        }
        layer.k[g] = dev_upload(l->k, kv_format_row_bytes(fmt, d) * (size_t)n);
        layer.v[g] = NULL;
        layer.n[g] = n;
        a.sink[g] = g == 0 ? 0 : sink;   // list 0: no sinks
        a.c0[g] = g == 1 ? sink : sink + before;   // list 1: the chunk starts at the sinks
        a.self0[g] = sink + before + width;
    }
    float *q = malloc((size_t)T * n_head * d * sizeof(float));
    for (size_t i = 0; i < (size_t)T * n_head * d; i++) q[i] = uniform(-1.0f, 1.0f);
    double *want = calloc((size_t)n_head * width + 1, sizeof(double)), *z = malloc((size_t)n * sizeof(double));
    float tmp[PYKV_MAX_HEAD_DIM];
    for (int h = 0; h < n_head; h++) {
        const int g = h / group;
        const struct kv_list *l = kv_cache_list(&c, 0, g);
        for (int32_t t = 0; t < T; t++) {
            const float *qr = q + ((size_t)t * n_head + h) * d;
            int32_t m = 0;
            int32_t rows[4096];
            for (int32_t j = 0; j < a.sink[g]; j++) rows[m++] = j;
            for (int32_t j = 0; j < width; j++) rows[m++] = a.c0[g] + j;
            for (int32_t j = 0; j <= t; j++) rows[m++] = a.self0[g] + j;
            double top = -INFINITY, sum = 0.0;
            for (int32_t e = 0; e < m; e++) {
                const float *kr = kv_key_f32(l, rows[e], d, tmp);
                double dot = 0.0;
                for (int i = 0; i < d; i++) dot += (double)qr[i] * kr[i];
                z[e] = dot / sqrt((double)d);
                top = z[e] > top ? z[e] : top;
            }
            for (int32_t e = 0; e < m; e++) sum += exp(z[e] - top);
            for (int32_t j = 0; j < width; j++) {
                const double p = exp(z[a.sink[g] + j] - top) / sum;
                double *w = want + (size_t)h * width + j;
                *w = p > *w ? p : *w;
            }
        }
    }
    float *dq = dev_upload(q, (size_t)T * n_head * d * sizeof(float));
    float *dbest = dev_upload(NULL, (size_t)n_head * width * sizeof(float) + 1);
    float *got = malloc((size_t)n_head * width * sizeof(float) + 1);
    CHECK(cuda_kvzip_pass_supported(&layer, &a));
    cuda_kvzip_pass(NULL, &layer, dq, &a, dbest);
    double e = 1.0;
    if (fetch(got, dbest, (size_t)n_head * width * sizeof(float), "cuda_kvzip_pass"))
        e = nmse_d(got, want, (int64_t)n_head * width);
    printf("kvzip pass k=%s d=%d lists=%d G=%d sinks=%d chunk=%d rows=%d: NMSE %.2e\n", kv_format_name(fmt), d, n_kv,
           group, sink, width, T, e);
    CHECK(e <= 1e-9);
    for (int g = 0; g < n_kv; g++) cuda_free(layer.k[g]);
    cuda_free(dq); cuda_free(dbest);
    free(q); free(want); free(z); free(got);
    kv_cache_free(&c);
}

int main(void) {
    if (!cuda_test_start("test_cuda_kvzip")) return CHECK_SKIP;
    CHECK(cuda_set_device(0) == PYKV_OK);
    const int fmts[] = { KV_F32, KV_F16, KV_Q8_0 };
    for (int f = 0; f < 3; f++) {
        test_pass(fmts[f], 64, 3, 4, 4, 200, 96);
        test_pass(fmts[f], 128, 2, 1, 4, 333, 17);
        test_pass(fmts[f], 64, 4, 2, 0, 50, 1);
    }
    return check_report("test_cuda_kvzip");
}
