// ctest-label: cuda
// test_cuda_expected_attention.c - Expected Attention's step at the end of a prompt on a layer
// in GPU memory (the scores of ggml-cuda/expected-attention.cu, the device's selection and
// compaction) against the same policy on a copy of the layer in host memory, one line per
// case: keys and values f32, f16 and q8_0, head_dim 64 and 128, GQA groups 1 and 4, 1 to 8
// lists of up to 1500 entries, sinks 0 and 4, with and without the covariance term and the
// value norms. The statistics come from the same queries on both sides (the host's); the
// logits' products A k are summed in another order on the device, so kept sets may differ
// where two scores are within rounding: counted, and bounded to 0.2% of the kept entries;
// every list whose positions agree holds the host's rows byte for byte (twin-lists.h).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/threadpool.h"
#include "kv/kv-cache.h"
#include "kv/policy.h"
#include "model/model.h"

#define CUDA_CHECK_SEED 0x1F83D9ABFB41BD6Bull
#include "cuda-check.h"
#include "twin-lists.h"

struct ea_case {
    int         fmt, d, n_kv, group;
    int32_t     n_max, budget;
    const char *args;
};

static int run_policy(const struct ea_case *ec, struct kv_cache *c, struct threadpool *pool, const float *q,
                      const float *d_q, int32_t T, const float *inv_freq) {
    const struct policy_ops *ops = policy_find("expected_attention");
    struct policy_config cfg = { .budget = ec->budget, .window = -1, .sink = -1, .args = ec->args,
                                 .name = "expected_attention" };
    struct kv_policy *p = NULL;
    if (!ok(ops->init(&cfg, &p), "the policy")) return 0;
    p->cfg = cfg;   // as the context sets it
    struct hparams hp = { .n_layer = 1, .n_head = ec->n_kv * ec->group, .n_head_kv = ec->n_kv, .head_dim = ec->d,
                          .n_rot = ec->d };
    struct policy_event ev = { .cache = c, .hp = &hp, .pool = pool, .layer = 0, .n_past = ec->n_max,
                               .n_prompt = T, .n_past_end = ec->n_max, .is_last_chunk = 1, .is_first_chunk = 1,
                               .q = q, .q_device = d_q, .T = T };
    ev.probe.rope_inv_freq = inv_freq;
    const int done = ok(ops->after_layer(p, &ev), "expected_attention");
    ops->free(p);
    return done;
}

static void test_case(const struct ea_case *ec, struct threadpool *pool) {
    const int d = ec->d, n_head = ec->n_kv * ec->group;
    struct kv_cache host, dev;
    CHECK(kv_cache_init(&host, 1, ec->n_kv, d, ec->n_max, ec->fmt, ec->fmt) == PYKV_OK);
    CHECK(kv_cache_init(&dev, 1, ec->n_kv, d, ec->n_max, ec->fmt, ec->fmt) == PYKV_OK);
    kv_cache_set_device(&dev, 0, 0, NULL);
    float *k = malloc((size_t)ec->n_max * d * sizeof(float)), *v = malloc((size_t)ec->n_max * d * sizeof(float));
    for (int g = 0; g < ec->n_kv; g++) {
        const int32_t n = g == 0 ? ec->n_max : g == 1 ? 1 + next_int(ec->budget) : 1 + next_int(ec->n_max);
        for (size_t i = 0; i < (size_t)n * d; i++) {
            k[i] = uniform(-1.0f, 1.0f) + (i % d < 4 ? 1.5f : 0.0f);   // a few channels the queries lean on
            v[i] = uniform(-1.0f, 1.0f) * (next_int(20) == 0 ? 4.0f : 1.0f);
        }
        twin_list_fill(&host, &dev, g, n, k, v);
    }
    const int32_t T = 96;   // the call's queries (its last chunk), around a mean of their own
    float *q = malloc((size_t)T * n_head * d * sizeof(float)), inv_freq[PYKV_MAX_HEAD_DIM / 2];
    for (int i = 0; i < d / 2; i++) inv_freq[i] = powf(10000.0f, -2.0f * (float)i / (float)d);
    for (size_t i = 0; i < (size_t)T * n_head * d; i++) q[i] = uniform(-1.0f, 1.0f) + (i % d < 4 ? 2.0f : 0.0f);
    float *d_q = dev_upload(q, (size_t)T * n_head * d * sizeof(float));
    const int ran = run_policy(ec, &host, pool, q, NULL, T, inv_freq) && run_policy(ec, &dev, pool, NULL, d_q, T, inv_freq);
    int64_t kept = 0, diff = 0;
    int rows_same = ran;
    for (int g = 0; g < ec->n_kv && ran; g++) {
        const struct kv_list *h = kv_cache_list(&host, 0, g), *l = kv_cache_list(&dev, 0, g);
        CHECK(h->n == l->n);
        for (int32_t a = 0, b = 0; a < h->n || b < l->n;) {   // positions in one list only (both ascending)
            if (b >= l->n || (a < h->n && h->pos[a] < l->pos[b])) { diff++; a++; }
            else if (a >= h->n || l->pos[b] < h->pos[a]) { diff++; b++; }
            else { a++; b++; }
        }
        int64_t ignored = 0;
        if (h->n == l->n && memcmp(h->pos, l->pos, (size_t)h->n * sizeof(int32_t)) == 0)
            rows_same &= twin_list_same(&host, &dev, g, &ignored);
        kept += h->n;
    }
    printf("expected_attention %s %s d=%d lists=%d G=%d n<=%d B=%d: %lld kept, %lld differ, rows %s\n",
           ec->args ? ec->args : "defaults", kv_format_name(ec->fmt), d, ec->n_kv, ec->group, ec->n_max, ec->budget,
           (long long)kept, (long long)diff, rows_same ? "equal" : "DIFFERENT");
    CHECK(ran);
    CHECK(diff <= kept / 500);
    CHECK(rows_same);
    cuda_free(d_q);
    free(k); free(v); free(q);
    kv_cache_free(&host);
    kv_cache_free(&dev);
}

int main(void) {
    if (!cuda_test_start("test_cuda_expected_attention")) return CHECK_SKIP;
    CHECK(cuda_set_device(0) == PYKV_OK);
    struct threadpool *pool = threadpool_create(2);
    const int fmts[] = { KV_F32, KV_F16, KV_Q8_0 };
    for (int f = 0; f < 3; f++)
        for (int d = 64; d <= 128; d += 64) {
            const struct ea_case cases[] = {
                { fmts[f], d, 2, 4, 1500, 300, NULL },
                { fmts[f], d, 8, 1, 600, 100, "sink=0" },
                { fmts[f], d, 3, 4, 800, 400, "use_covariance=0" },
                { fmts[f], d, 2, 2, 700, 200, "use_vnorm=0,n_future_positions=64" },
                { fmts[f], d, 1, 4, 300, 299, "epsilon=0.01" },
            };
            for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) test_case(&cases[i], pool);
        }
    threadpool_free(pool);
    return check_report("test_cuda_expected_attention");
}
