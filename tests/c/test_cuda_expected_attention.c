// ctest-label: cuda
// test_cuda_expected_attention.c - Expected Attention on a layer in GPU memory (its query
// statistics and scores in ggml-cuda/expected-attention.cu, the device's selection and
// compaction) against the same policy on a copy of the layer in host memory, one line per
// case: keys and values f32, f16 and q8_0, head_dim 64 and 128, GQA groups 1 and 4, 1 to 8
// lists of up to 1500 entries, sinks 0, 4 and 200, calls of 1 to 4 chunks (the statistics
// merged chunk by chunk on the device, the first chunks' sink queries left out), with and
// without the covariance term and the value norms. The products of the statistics' outer sums
// and of the logits (A k) are summed in another order on the device, so kept sets may differ
// where two scores are within rounding: counted, and bounded to 0.2% of the kept entries;
// every list whose positions agree holds the host's rows byte for byte (twin-lists.h).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/threadpool.h"
#include "cpu/ops.h"
#include "ggml-cuda/policy-kernels.h"
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
    int         chunks;   // the call's chunks of EA_CHUNK queries, from position 0 (the sinks' queries left out)
};

#define EA_CHUNK 96

// The call's chunks through the policy: queries from q (host) or d_q (device), row r of the
// call at r * n_head * d.
static int run_policy(const struct ea_case *ec, struct kv_cache *c, struct threadpool *pool, const float *q,
                      const float *d_q, const float *inv_freq) {
    const struct policy_ops *ops = policy_find("expected_attention");
    struct policy_config cfg = { .budget = ec->budget, .window = -1, .sink = -1, .args = ec->args,
                                 .name = "expected_attention" };
    struct kv_policy *p = NULL;
    if (!ok(ops->init(&cfg, &p), "the policy")) return 0;
    p->cfg = cfg;   // as the context sets it
    struct hparams hp = { .n_layer = 1, .n_head = ec->n_kv * ec->group, .n_head_kv = ec->n_kv, .head_dim = ec->d,
                          .n_rot = ec->d };
    const int32_t n_prompt = ec->chunks * EA_CHUNK;
    const size_t width = (size_t)hp.n_head * ec->d;
    int done = 1;
    for (int k = 0; k < ec->chunks && done; k++) {
        struct policy_event ev = { .cache = c, .hp = &hp, .pool = pool, .layer = 0, .n_past = (k + 1) * EA_CHUNK,
                                   .n_prompt = n_prompt, .n_past_end = n_prompt, .is_last_chunk = k == ec->chunks - 1,
                                   .is_first_chunk = k == 0, .T = EA_CHUNK };
        ev.q = q ? q + (size_t)k * EA_CHUNK * width : NULL;
        ev.q_device = d_q ? d_q + (size_t)k * EA_CHUNK * width : NULL;
        ev.probe.rope_inv_freq = inv_freq;
        done = ok(ops->after_layer(p, &ev), "expected_attention");
    }
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
            // a few channels the queries lean on, and a few where their chunks differ
            k[i] = uniform(-1.0f, 1.0f) * (i % d >= 4 && i % d < 12 ? 3.0f : 1.0f) + (i % d < 4 ? 1.5f : 0.0f);
            v[i] = uniform(-1.0f, 1.0f) * (next_int(20) == 0 ? 4.0f : 1.0f);
        }
        twin_list_fill(&host, &dev, g, n, k, v);
    }
    const int32_t T = ec->chunks * EA_CHUNK;   // the call's queries, around a mean of their own
    float *q = malloc((size_t)T * n_head * d * sizeof(float)), inv_freq[PYKV_MAX_HEAD_DIM / 2];
    for (int i = 0; i < d / 2; i++) inv_freq[i] = powf(10000.0f, -2.0f * (float)i / (float)d);
    for (size_t i = 0; i < (size_t)T * n_head * d; i++) {   // each chunk's mean elsewhere: the merge matters
        const float shift = (float)(i / ((size_t)EA_CHUNK * n_head * d)) * (i % d >= 4 && i % d < 12 ? 2.0f : 0.0f);
        q[i] = uniform(-1.0f, 1.0f) + (i % d < 4 ? 2.0f : 0.0f) + shift;
    }
    float *d_q = dev_upload(q, (size_t)T * n_head * d * sizeof(float));
    const int ran = run_policy(ec, &host, pool, q, NULL, inv_freq) && run_policy(ec, &dev, pool, NULL, d_q, inv_freq);
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
    printf("expected_attention %s %s d=%d lists=%d G=%d n<=%d B=%d, %d chunks: %lld kept, %lld differ, rows %s\n",
           ec->args ? ec->args : "defaults", kv_format_name(ec->fmt), d, ec->n_kv, ec->group, ec->n_max, ec->budget,
           ec->chunks, (long long)kept, (long long)diff, rows_same ? "equal" : "DIFFERENT");
    CHECK(ran);
    CHECK(diff <= kept / 500);
    CHECK(rows_same);
    cuda_free(d_q);
    free(k); free(v); free(q);
    kv_cache_free(&host);
    kv_cache_free(&dev);
}

// ---- the query statistics alone ----

// cuda_ea_stats_chunk over a call of n_chunks chunks of T queries (positions from 0, the rows
// from t0 on counted) against the mean and m2 of the same rows computed directly, in
// double, from their rotation undone here (x_2i = a cos + b sin, x_2i+1 = b cos - a sin): an
// independent reference for the chunk statistics and their pairwise merge.
static void test_stats(int n_head, int d, int n_rot, int n_chunks, int32_t T, int32_t t0) {
    const size_t width = (size_t)n_head * d, n_m = width * d;
    float inv_freq[PYKV_MAX_HEAD_DIM / 2], *cs = malloc((size_t)T * (n_rot ? n_rot : 1) * sizeof(float));
    for (int i = 0; i < n_rot / 2; i++) inv_freq[i] = powf(500000.0f, -2.0f * (float)i / (float)n_rot);
    float *q = malloc((size_t)n_chunks * T * width * sizeof(float));
    for (size_t i = 0; i < (size_t)n_chunks * T * width; i++)   // chunks around different means
        q[i] = uniform(-1.0f, 1.0f) + (float)(i / ((size_t)T * width) % 2) * (i % d < 8 ? 3.0f : 0.0f);
    double *x = calloc((size_t)n_chunks * T * width, sizeof(double)), *mean = calloc(width, sizeof(double));
    double *m2 = calloc(n_m, sizeof(double));
    int64_t count = 0;
    for (int32_t row = 0; row < n_chunks * T; row++) {
        if (row < t0) continue;
        for (int h = 0; h < n_head; h++) {
            const float *qr = q + ((size_t)row * n_head + h) * d;
            double *xr = x + ((size_t)count * n_head + h) * d;
            for (int c = 0; c < d; c++) xr[c] = qr[c];
            for (int i = 0; i < n_rot / 2; i++) {
                const double th = (double)((float)row * inv_freq[i]), co = cos(th), si = sin(th);
                xr[2 * i] = qr[2 * i] * co + qr[2 * i + 1] * si;
                xr[2 * i + 1] = qr[2 * i + 1] * co - qr[2 * i] * si;
            }
            for (int c = 0; c < d; c++) mean[(size_t)h * d + c] += xr[c];
        }
        count++;
    }
    for (size_t i = 0; i < width; i++) mean[i] /= (double)count;
    for (int64_t r = 0; r < count; r++)
        for (int h = 0; h < n_head; h++) {
            const double *xr = x + ((size_t)r * n_head + h) * d, *mh = mean + (size_t)h * d;
            for (int i = 0; i < d; i++)
                for (int j = 0; j < d; j++) m2[((size_t)h * d + i) * d + j] += (xr[i] - mh[i]) * (xr[j] - mh[j]);
        }
    double *d_stats = dev_upload(NULL, (width + n_m) * sizeof(double));
    CHECK(cuda_memset(d_stats, 0, (width + n_m) * sizeof(double), NULL) == PYKV_OK);
    float *d_q = dev_upload(q, (size_t)n_chunks * T * width * sizeof(float));
    int64_t seen = 0;
    for (int k = 0; k < n_chunks; k++) {
        const int32_t left = t0 - k * T, first = left <= 0 ? 0 : left < T ? left : T, rows = T - first;
        if (rows == 0) continue;   // a chunk of sinks only
        for (int32_t r = 0; r < rows; r++) rope_angles(cs + (size_t)r * n_rot, n_rot, k * T + first + r, inv_freq);
        float *d_cs = dev_upload(cs, (size_t)rows * (n_rot ? n_rot : 1) * sizeof(float));
        const struct cuda_ea_chunk c = { .n_head = n_head, .d = d, .n_rot = n_rot, .t0 = first, .rows = rows,
                                         .count = seen, .cs = d_cs };
        void *work = dev_upload(NULL, cuda_ea_chunk_work_bytes(&c));
        cuda_ea_stats_chunk(NULL, d_q + (size_t)k * T * width, &c, d_stats, d_stats + width, work);
        CHECK(cuda_stream_sync(NULL) == PYKV_OK);
        cuda_free(work);
        cuda_free(d_cs);
        seen += rows;
    }
    double *got = malloc((width + n_m) * sizeof(double));
    double e_mean = 1.0, e_m2 = 1.0;
    if (fetch(got, d_stats, (width + n_m) * sizeof(double), "cuda_ea_stats_chunk")) {
        double num = 0.0, den = 0.0;
        for (size_t i = 0; i < width; i++) { num += (got[i] - mean[i]) * (got[i] - mean[i]); den += mean[i] * mean[i]; }
        e_mean = num / den;
        num = den = 0.0;
        for (size_t i = 0; i < n_m; i++) {
            num += (got[width + i] - m2[i]) * (got[width + i] - m2[i]);
            den += m2[i] * m2[i];
        }
        e_m2 = num / den;
    }
    printf("expected_attention statistics heads=%d d=%d n_rot=%d: %d chunks of %d from row %d: NMSE mean %.2e, m2 %.2e\n",
           n_head, d, n_rot, n_chunks, T, t0, e_mean, e_m2);
    CHECK(seen == count);
    CHECK(e_mean <= 1e-12);
    CHECK(e_m2 <= 1e-10);
    cuda_free(d_stats); cuda_free(d_q);
    free(cs); free(q); free(x); free(mean); free(m2); free(got);
}

int main(void) {
    if (!cuda_test_start("test_cuda_expected_attention")) return CHECK_SKIP;
    CHECK(cuda_set_device(0) == PYKV_OK);
    test_stats(4, 64, 64, 3, 40, 4);
    test_stats(3, 128, 128, 2, 70, 0);
    test_stats(2, 64, 32, 4, 17, 20);   // n_rot < d; a first chunk of sinks only, then three in the second
    struct threadpool *pool = threadpool_create(2);
    const int fmts[] = { KV_F32, KV_F16, KV_Q8_0 };
    for (int f = 0; f < 3; f++)
        for (int d = 64; d <= 128; d += 64) {
            const struct ea_case cases[] = {
                { fmts[f], d, 2, 4, 1500, 300, NULL, 3 },
                { fmts[f], d, 8, 1, 600, 100, "sink=0", 1 },
                { fmts[f], d, 3, 4, 800, 400, "use_covariance=0", 2 },
                { fmts[f], d, 2, 2, 700, 200, "use_vnorm=0,n_future_positions=64", 1 },
                { fmts[f], d, 1, 4, 300, 299, "epsilon=0.01,sink=200", 4 },   // a chunk of sinks only
            };
            for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) test_case(&cases[i], pool);
        }
    threadpool_free(pool);
    return check_report("test_cuda_expected_attention");
}
