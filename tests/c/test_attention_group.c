// test_attention_group.c - the GQA tiles (the query heads sharing a KV head attend together,
// reading each key and value row once) against a double-precision softmax attention, for
// tile sizes 1-4, head sizes on and off the SIMD path, and
// lists from 1 entry up (odd counts reach the pairwise tail), keys and values stored as
// floats, halves or Q8_0 blocks (the reference then reads the same rounded values).
#include "cpu/attention.h"
#include "check.h"
#include "kv/kv-cache.h"

#include <math.h>
#include <stdlib.h>

static float frand(void) { return (float)rand() / (float)RAND_MAX * 2.0f - 1.0f; }

static void reference(const float *q, const struct kv_list *l, int n, int d, double *out) {
    double *s = malloc((size_t)n * sizeof(double)), max = -INFINITY, z = 0;
    float tmp[PYKV_MAX_HEAD_DIM];
    for (int j = 0; j < n; j++) {
        double dot = 0;
        const float *k = kv_key_f32(l, j, d, tmp);
        for (int i = 0; i < d; i++) dot += (double)q[i] * k[i];
        s[j] = dot / sqrt((double)d);
        if (s[j] > max) max = s[j];
    }
    for (int j = 0; j < n; j++) z += s[j] = exp(s[j] - max);
    for (int i = 0; i < d; i++) {
        double acc = 0;
        for (int j = 0; j < n; j++) acc += s[j] / z * kv_value_f32(l, j, d, tmp)[i];
        out[i] = acc;
    }
    free(s);
}

// fmt_k, fmt_v: the keys' and the values' formats (as -ctk and -ctv may differ)
static void check_case(int d, int n, int nq, int fmt_k, int fmt_v) {
    struct kv_cache cache;
    if ((fmt_k == KV_Q8_0 || fmt_v == KV_Q8_0) && d % 32) return;
    CHECK(kv_cache_init(&cache, 1, 1, d, n + 4, fmt_k, fmt_v) == PYKV_OK);
    struct kv_list *l = kv_cache_list(&cache, 0, 0);
    CHECK(kv_list_reserve(&cache, l, n + 4) == PYKV_OK);
    float *k = malloc((size_t)d * sizeof(float)), *v = malloc((size_t)d * sizeof(float));
    for (int j = 0; j < n + 4; j++) {   // 4 more than n: attention must stop at n
        for (int i = 0; i < d; i++) { k[i] = frand(); v[i] = frand(); }
        kv_list_push(&cache, l, k, v, j);
    }
    float *q = malloc((size_t)nq * d * sizeof(float)), *out = malloc((size_t)nq * d * sizeof(float));
    float *w = malloc((size_t)ATTENTION_TILE * (n + 4) * sizeof(float)), *one = malloc((size_t)d * sizeof(float));
    double *ref = malloc((size_t)d * sizeof(double));
    for (int i = 0; i < nq * d; i++) q[i] = 4.0f * frand();
    attention_group(q, nq, l, n, d, w, out);
    for (int r = 0; r < nq; r++) {   // each query's weights: a row of n that sums to 1
        double sum = 0;
        for (int j = 0; j < n; j++) sum += w[(size_t)r * n + j];
        CHECK_NEAR(sum, 1.0, 1e-5);
    }
    for (int r = 0; r < nq; r++) {
        reference(q + (size_t)r * d, l, n, d, ref);
        attention_head(q + (size_t)r * d, l, n, d, w, one);
        for (int i = 0; i < d; i++) {
            CHECK_NEAR(out[(size_t)r * d + i], ref[i], 2e-5);
            CHECK_NEAR(out[(size_t)r * d + i], one[i], 2e-5);
        }
    }
    free(k); free(v); free(q); free(out); free(w); free(one); free(ref);
    kv_cache_free(&cache);
}

int main(void) {
    srand(11);
    const int ds[] = { 64, 48, 40, 128 };
    const int ns[] = { 1, 2, 3, 17, 300 };
    const int nqs[] = { 1, 2, 3, 4 };
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 5; b++)
            for (int c = 0; c < 4; c++) {
                for (int fk = 0; fk < KV_N_FORMATS; fk++)
                    for (int fv = 0; fv < KV_N_FORMATS; fv++) check_case(ds[a], ns[b], nqs[c], fk, fv);
            }
    return check_report("test_attention_group");
}
