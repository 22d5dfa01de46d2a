// ctest-label: cuda
// test_cuda_entry.c - the policies that score each entry by its own key and value (Knorm,
// KeyDiff, LagKV; Random by position), their step on a layer in GPU memory (the device's
// scorers of ggml-cuda/entry-scores.cu, its radix select and compaction) against the same
// policy on a copy of the layer in host memory (the CPU's scorers), one line per case:
// keys and values f32, f16 and q8_0, head_dim 64 and 128, 1 to 8 lists of 1 to 3000 entries
// (some no longer than the budget), budgets from a few entries to all but one; LagKV with
// partitions of 8 to 128, sinks 0 and 4, ranks and cross-partition weights, and lists short
// enough for its sinks-and-newest rule. The device's scores are the CPU's bits, so every
// list must keep the same positions, and its rows on the device must be the host's kept rows
// byte for byte (twin-lists.h).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/threadpool.h"
#include "kv/kv-cache.h"
#include "kv/policy.h"
#include "model/model.h"

#define CUDA_CHECK_SEED 0xA54FF53A5F1D36F1ull
#include "cuda-check.h"
#include "twin-lists.h"

struct entry_case {
    const char *policy, *args;
    int         fmt, d, n_kv;
    int32_t     n_max, budget;
};

// A list of n entries with keys around a per-list direction (KeyDiff's anchor is then not
// near zero) and a few outlying rows, in both caches.
static void fill_list(struct kv_cache *host, struct kv_cache *dev, int g, int32_t n, int d) {
    float *k = malloc((size_t)n * d * sizeof(float)), *v = malloc((size_t)n * d * sizeof(float));
    float bias[PYKV_MAX_HEAD_DIM];
    for (int c = 0; c < d; c++) bias[c] = uniform(-1.0f, 1.0f);
    for (int32_t j = 0; j < n; j++) {
        const float scale = next_int(40) == 0 ? 4.0f : 1.0f;
        for (int c = 0; c < d; c++) {
            k[(size_t)j * d + c] = bias[c] + uniform(-scale, scale);
            v[(size_t)j * d + c] = uniform(-scale, scale);
        }
    }
    twin_list_fill(host, dev, g, n, k, v);
    free(k);
    free(v);
}

// The policy's prefill end on layer 0 of the cache: a multi-token call's last chunk.
static int run_policy(const struct entry_case *ec, struct kv_cache *c, struct threadpool *pool) {
    const struct policy_ops *ops = policy_find(ec->policy);
    struct policy_config cfg = { .budget = ec->budget, .window = -1, .sink = -1, .args = ec->args, .name = ec->policy };
    struct kv_policy *p = NULL;
    if (!ok(ops->init(&cfg, &p), "the policy")) return 0;
    p->cfg = cfg;   // as the context sets it
    struct hparams hp = { .n_layer = 1, .n_head = ec->n_kv, .n_head_kv = ec->n_kv, .head_dim = ec->d };
    struct policy_event ev = { .cache = c, .hp = &hp, .pool = pool, .layer = 0, .n_past = ec->n_max,
                               .n_prompt = ec->n_max, .n_past_end = ec->n_max, .is_last_chunk = 1,
                               .is_first_chunk = 1, .T = 1 };
    const int done = ok(ops->after_layer(p, &ev), ec->policy);
    ops->free(p);
    return done;
}

static void test_case(const struct entry_case *ec, struct threadpool *pool) {
    struct kv_cache host, dev;
    CHECK(kv_cache_init(&host, 1, ec->n_kv, ec->d, ec->n_max, ec->fmt, ec->fmt) == PYKV_OK);
    CHECK(kv_cache_init(&dev, 1, ec->n_kv, ec->d, ec->n_max, ec->fmt, ec->fmt) == PYKV_OK);
    kv_cache_set_device(&dev, 0, 0, NULL);
    for (int g = 0; g < ec->n_kv; g++) {
        const int32_t n = g == 0 ? ec->n_max : g == 1 ? 1 + next_int(ec->budget) : 1 + next_int(ec->n_max);
        fill_list(&host, &dev, g, n, ec->d);
    }
    const int ran = run_policy(ec, &host, pool) && run_policy(ec, &dev, pool);
    int same = ran;
    int64_t kept = 0;
    for (int g = 0; g < ec->n_kv && ran; g++) same &= twin_list_same(&host, &dev, g, &kept);
    printf("%s%s%s %s d=%d lists=%d n<=%d B=%d: %lld kept, positions and rows %s\n", ec->policy,
           ec->args ? " " : "", ec->args ? ec->args : "", kv_format_name(ec->fmt), ec->d, ec->n_kv, ec->n_max,
           ec->budget, (long long)kept, same ? "equal" : "DIFFERENT");
    CHECK(same);
    kv_cache_free(&host);
    kv_cache_free(&dev);
}

int main(void) {
    if (!cuda_test_start("test_cuda_entry")) return CHECK_SKIP;
    CHECK(cuda_set_device(0) == PYKV_OK);
    struct threadpool *pool = threadpool_create(2);
    const int fmts[] = { KV_F32, KV_F16, KV_Q8_0 };
    for (int f = 0; f < 3; f++)
        for (int d = 64; d <= 128; d += 64) {
            const struct entry_case cases[] = {
                { "knorm", NULL, fmts[f], d, 8, 3000, 700 },
                { "knorm", NULL, fmts[f], d, 1, 50, 49 },
                { "keydiff", NULL, fmts[f], d, 8, 3000, 300 },
                { "keydiff", NULL, fmts[f], d, 3, 900, 899 },
                { "lagkv", "lag=16", fmts[f], d, 8, 2000, 500 },
                { "lagkv", "lag=16,cross=1", fmts[f], d, 3, 2000, 800 },
                { "lagkv", "lag=8,sink=0", fmts[f], d, 2, 1000, 100 },
                { "lagkv", NULL, fmts[f], d, 4, 3000, 1000 },   // lag 128
                { "lagkv", NULL, fmts[f], d, 2, 250, 200 },     // short lists: sinks and the newest
                { "lagkv", NULL, fmts[f], d, 2, 3000, 100 },    // a budget short of the unscored tail
                { "random", "seed=7", fmts[f], d, 4, 1000, 100 },
            };
            for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) test_case(&cases[i], pool);
        }
    threadpool_free(pool);
    return check_report("test_cuda_entry");
}
