// ctest-label: cuda
// test_cuda_ems_prefill.c - EMS at the end of a prompt on lists in GPU memory against the CPU,
// one line per case:
//  * cuda_ems_most_similar vs ems_prefill_list's loop (ems_redundancy over the centres, the
//    first largest): keys and values f32, f16, q8_0 and mixed, head_dim 64 and 128, probes
//    against 1 to 1500 centres given as a list of rows; R within 2e-6, and the same centre
//    except where the CPU's R of the two choices are within 4e-6 (near-ties, counted);
//  * ems_gpu_prefill_layer vs ems_prefill_list on the same lists (twin-lists.h): several
//    lists, budgets, tau (merging, evict-only) and gamma (with and without TBM entries); the
//    same kept positions, member counts and norms, rows byte for byte (the merges read the
//    same rows on both sides), and the same scores; then a second prompt over what each kept
//    (merged entries included) and a new chunk, the same again;
//  * before that second prompt, ws_attention_sums_device over the lists with merged entries
//    (the window kernel expanding each into its members) against a direct computation in
//    double: within 2e-5 of the largest sum.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-cuda/policy-kernels.h"
#include "kv/kv-cache.h"
#include "kv/policies/common/window-scores.h"
#include "kv/policies/ems/ems.h"
#include "model/model.h"

#define CUDA_CHECK_SEED 0x510E527FADE682D1ull
#include "cuda-check.h"
#include "twin-lists.h"

// n rows of d: keys and values around a shared direction each, so that R spreads over [0, 1).
static void clustered_rows(int32_t n, int d, float *k, float *v) {
    float kb[PYKV_MAX_HEAD_DIM], vb[PYKV_MAX_HEAD_DIM];
    for (int c = 0; c < d; c++) { kb[c] = uniform(-1.0f, 1.0f); vb[c] = uniform(-1.0f, 1.0f); }
    for (int32_t j = 0; j < n; j++) {
        const float spread = 0.3f + 1.5f * (float)next_int(4) / 3.0f;
        for (int c = 0; c < d; c++) {
            k[(size_t)j * d + c] = kb[c] + spread * uniform(-1.0f, 1.0f);
            v[(size_t)j * d + c] = vb[c] + spread * uniform(-1.0f, 1.0f);
        }
    }
}

// ---- the most similar centre ----

static void test_most_similar(int fmt_k, int fmt_v, int d, int32_t n, int32_t nc, int n_probes) {
    struct kv_cache c;
    CHECK(kv_cache_init(&c, 1, 1, d, n, fmt_k, fmt_v) == PYKV_OK);
    struct kv_list *l = kv_cache_list(&c, 0, 0);
    CHECK(kv_list_reserve(&c, l, n) == PYKV_OK);
    float *k = malloc((size_t)n * d * sizeof(float)), *v = malloc((size_t)n * d * sizeof(float));
    clustered_rows(n, d, k, v);
    for (int32_t j = 0; j < n; j++) kv_list_push(&c, l, k + (size_t)j * d, v + (size_t)j * d, j);
    int32_t *cent = malloc((size_t)nc * sizeof(int32_t)), *probe_row = malloc((size_t)n_probes * sizeof(int32_t));
    for (int32_t i = 0, j = 0; i < nc; j++)   // an ascending subset of the rows
        if (next_int(n - j) < nc - i) cent[i++] = j;
    for (int p = 0; p < n_probes; p++) probe_row[p] = next_int(n);
    void *dk = dev_upload(l->k, kv_format_row_bytes(fmt_k, d) * (size_t)n);
    void *dv = dev_upload(l->v, kv_format_row_bytes(fmt_v, d) * (size_t)n);
    int32_t *d_cent = dev_upload(cent, (size_t)nc * sizeof(int32_t));
    struct cuda_ems_probe *jobs = malloc((size_t)n_probes * sizeof(*jobs));
    for (int p = 0; p < n_probes; p++)
        jobs[p] = (struct cuda_ems_probe){ .k = dk, .v = dv, .centre = d_cent, .weak = probe_row[p], .nc = nc, .out = p };
    struct cuda_ems_probe *d_jobs = dev_upload(jobs, (size_t)n_probes * sizeof(*jobs));
    int32_t *d_best = dev_alloc((size_t)n_probes * sizeof(int32_t)), *best = malloc((size_t)n_probes * sizeof(int32_t));
    float *d_r = dev_alloc((size_t)n_probes * sizeof(float)), *r = malloc((size_t)n_probes * sizeof(float));
    cuda_ems_most_similar(NULL, d_jobs, n_probes, fmt_k, fmt_v, d, d_best, d_r);
    int ok_fetch = fetch(best, d_best, (size_t)n_probes * sizeof(int32_t), "cuda_ems_most_similar");
    ok_fetch = ok_fetch && fetch(r, d_r, (size_t)n_probes * sizeof(float), "cuda_ems_most_similar");
    double worst = 0.0;
    int near_ties = 0, wrong = 0;
    for (int p = 0; p < n_probes && ok_fetch; p++) {
        struct ems_probe probe;
        ems_probe_init(&probe, l, d, probe_row[p]);
        int32_t want = -1;
        float r_want = 0.0f, r_of_got = NAN;
        for (int32_t i = 0; i < nc; i++) {
            const float x = ems_redundancy(l, d, &probe, cent[i]);
            if (want < 0 || x > r_want) { want = cent[i]; r_want = x; }
            if (cent[i] == best[p]) r_of_got = x;
        }
        const double e = fabs((double)r[p] - r_want);
        worst = e > worst || isnan(e) ? e : worst;
        if (best[p] != want) {
            if (fabs((double)r_of_got - r_want) <= 4e-6) near_ties++;
            else wrong++;
        }
    }
    printf("ems most similar k=%s v=%s d=%d: %d probes over %d of %d rows: max |R diff| %.2e, %d near-ties, %d wrong\n",
           kv_format_name(fmt_k), kv_format_name(fmt_v), d, n_probes, nc, n, worst, near_ties, wrong);
    CHECK(ok_fetch);
    CHECK(worst <= 2e-6);
    CHECK(wrong == 0);
    CHECK(near_ties <= n_probes / 50);
    cuda_free(dk); cuda_free(dv); cuda_free(d_cent); cuda_free(d_jobs); cuda_free(d_best); cuda_free(d_r);
    free(k); free(v); free(cent); free(probe_row); free(jobs); free(best); free(r);
    kv_cache_free(&c);
}

// ---- a layer's prompt end ----

struct prefill_case {
    int            fmt, d, n_kv;
    int32_t        n_max, budget;
    struct ems_opts o;
};

// Scores as a prompt leaves them: s_Glo of the entries from m0 on accumulated (the same on
// both sides; earlier entries keep theirs), s_Loc of every entry over the window.
static void random_scores(struct ems_list *sh, struct ems_list *sd, int32_t m0, int32_t n, float *loc) {
    CHECK(ems_list_track(sh, n) == PYKV_OK);
    CHECK(ems_list_track(sd, n) == PYKV_OK);
    for (int32_t j = m0; j < n; j++) sh->glo[j] = sd->glo[j] = uniform(0.0f, 4.0f);
    for (int32_t j = 0; j < n; j++) loc[j] = uniform(0.0f, 1.0f);
}

static int same_scores(const struct ems_list *a, const struct ems_list *b) {
    if (a->n != b->n) return 0;
    const size_t bytes = (size_t)a->n * sizeof(float);
    return !memcmp(a->glo, b->glo, bytes) && !memcmp(a->lp, b->lp, bytes) && !memcmp(a->lc, b->lc, bytes) &&
           !memcmp(a->wsum, b->wsum, bytes) && !memcmp(a->kmag, b->kmag, bytes);
}

// The attention sums over the device lists (ws_attention_sums_device: the window kernel,
// merged entries expanded) against a direct computation in double over the same lists in
// host memory: T random query rows per query head (G per list), the last `rows` of them
// summed, row r seeing the first n - (rows - 1 - r) entries; member m of a merged entry j
// has logit norm_m * q . k_j / sqrt(d). Returns the worst error relative to the largest sum.
static double attention_sums_error(struct kv_cache *host, struct kv_cache *dev, int G, int32_t T, int32_t rows) {
    const int hkv = host->n_head_kv, d = host->head_dim, n_head = hkv * G;
    int32_t n_max = 1;
    for (int g = 0; g < hkv; g++) n_max = kv_cache_list(host, 0, g)->n > n_max ? kv_cache_list(host, 0, g)->n : n_max;
    float *q = malloc((size_t)T * n_head * d * sizeof(float));
    fill(q, (size_t)T * n_head * d, -0.4f, 0.4f);
    float *d_q = dev_upload(q, (size_t)T * n_head * d * sizeof(float));
    float *got = calloc((size_t)n_head * n_max, sizeof(float));
    double *want = calloc((size_t)n_head * n_max, sizeof(double)), *w = malloc((size_t)n_max * sizeof(double));
    struct hparams hp = { .n_layer = 1, .n_head = n_head, .n_head_kv = hkv, .head_dim = d };
    struct policy_event ev = { .cache = dev, .hp = &hp, .layer = 0, .T = T, .q_device = d_q };
    const int ran = ok(ws_attention_sums_device(&ev, rows, got, (size_t)n_max), "ws_attention_sums_device");
    double worst = 0.0, top = 0.0;
    float tk[PYKV_MAX_HEAD_DIM];
    for (int h = 0; h < n_head && ran; h++) {
        const struct kv_list *l = kv_cache_list(host, 0, h / G);
        for (int32_t r = 0; r < rows; r++) {
            const float *qr = q + ((size_t)(T - rows + r) * n_head + h) * d;
            const int32_t seen = l->n - (rows - 1 - r);
            double mx = -INFINITY, z = 0.0;
            for (int32_t j = 0; j < seen; j++) {
                const float *k = kv_key_f32(l, j, d, tk);
                double x = 0.0;
                for (int c = 0; c < d; c++) x += (double)qr[c] * k[c];
                w[j] = x / sqrt((double)d);
                const float *norm = kv_member_norms(l, j);
                const int32_t cnt = ems_members(l, j);
                for (int32_t m = 0; m < cnt; m++) mx = fmax(mx, (norm ? norm[m] : 1.0) * w[j]);
            }
            for (int32_t j = 0; j < seen; j++) {
                const float *norm = kv_member_norms(l, j);
                double e = 0.0;
                for (int32_t m = 0; m < ems_members(l, j); m++) e += exp((norm ? norm[m] : 1.0) * w[j] - mx);
                w[j] = e;
                z += e;
            }
            for (int32_t j = 0; j < seen; j++) want[(size_t)h * n_max + j] += w[j] / z;
        }
        for (int32_t j = 0; j < l->n; j++) top = fmax(top, want[(size_t)h * n_max + j]);
    }
    for (int h = 0; h < n_head && ran; h++)
        for (int32_t j = 0; j < kv_cache_list(host, 0, h / G)->n; j++)
            worst = fmax(worst, fabs((double)got[(size_t)h * n_max + j] - want[(size_t)h * n_max + j]));
    cuda_free(d_q);
    free(q); free(got); free(want); free(w);
    return ran && top > 0.0 ? worst / top : INFINITY;
}

// Two prompt ends on the same lists, on both sides: the first over single tokens, the second
// over what the first kept (its merged entries among them) and a new chunk.
static void test_prefill(const struct prefill_case *pc) {
    const int d = pc->d, hkv = pc->n_kv;
    struct kv_cache host, dev;
    CHECK(kv_cache_init(&host, 1, hkv, d, pc->n_max, pc->fmt, pc->fmt) == PYKV_OK);
    CHECK(kv_cache_init(&dev, 1, hkv, d, pc->n_max, pc->fmt, pc->fmt) == PYKV_OK);
    kv_cache_set_device(&dev, 0, 0, NULL);
    struct ems_list sh[8], sd[8];
    float *loc[8];
    memset(sh, 0, sizeof(sh));
    memset(sd, 0, sizeof(sd));
    memset(loc, 0, sizeof(loc));
    float *k = malloc((size_t)pc->n_max * d * sizeof(float)), *v = malloc((size_t)pc->n_max * d * sizeof(float));
    struct hparams hp = { .n_layer = 1, .n_head = hkv, .n_head_kv = hkv, .head_dim = d };
    struct policy_event eh = { .cache = &host, .hp = &hp, .layer = 0 }, ed = { .cache = &dev, .hp = &hp, .layer = 0 };
    for (int round = 0; round < 2; round++) {
        for (int g = 0; g < hkv; g++) {
            const int32_t had = kv_cache_list(&host, 0, g)->n;
            const int32_t n = round ? pc->n_max / 2 : g == 0 ? pc->n_max : g == 1 ? 1 + next_int(pc->budget)
                                                    : 1 + next_int(pc->n_max);
            clustered_rows(n, d, k, v);
            if (round) twin_list_append(&host, &dev, g, n, k, v, 3 * pc->n_max + 1);
            else twin_list_fill(&host, &dev, g, n, k, v);
            free(loc[g]);
            loc[g] = malloc((size_t)(had + n) * sizeof(float));
            random_scores(&sh[g], &sd[g], had, had + n, loc[g]);
        }
        double sums_err = 0.0;
        if (round) sums_err = attention_sums_error(&host, &dev, 2, pc->n_max / 2, pc->o.window);
        int ran = 1;
        for (int g = 0; g < hkv; g++)
            ran &= ok(ems_prefill_list(&eh, &pc->o, pc->budget, g, &sh[g], loc[g]), "ems_prefill_list");
        ran &= ok(ems_gpu_prefill_layer(&ed, &pc->o, pc->budget, sd, loc), "ems_gpu_prefill_layer");
        int same = ran;
        int64_t kept = 0, merged = 0;
        for (int g = 0; g < hkv && ran; g++) {
            same &= twin_list_same(&host, &dev, g, &kept) && same_scores(&sh[g], &sd[g]);
            const struct kv_list *l = kv_cache_list(&host, 0, g);
            for (int32_t j = 0; l->n_members && j < l->n; j++) merged += l->n_members[j] > 1;
        }
        printf("ems prefill %s %s d=%d lists=%d n<=%d B=%d tau=%.2f gamma=%d: %lld kept, %lld merged: %s",
               round ? "second" : "first", kv_format_name(pc->fmt), d, hkv, pc->n_max, pc->budget, pc->o.tau,
               pc->o.gamma, (long long)kept, (long long)merged, same ? "equal" : "DIFFERENT");
        if (round) printf("; attention sums before it: max error %.2e of the largest", sums_err);
        printf("\n");
        CHECK(same);
        CHECK(pc->o.tau >= 1.0 || pc->o.gamma == 1 || merged > 0);
        CHECK(sums_err <= 2e-5);
    }
    for (int g = 0; g < hkv; g++) {
        ems_list_free(&sh[g]);
        ems_list_free(&sd[g]);
        free(loc[g]);
    }
    free(k);
    free(v);
    kv_cache_free(&host);
    kv_cache_free(&dev);
}

int main(void) {
    if (!cuda_test_start("test_cuda_ems_prefill")) return CHECK_SKIP;
    CHECK(cuda_set_device(0) == PYKV_OK);
    for (int fmt = 0; fmt < KV_N_FORMATS; fmt++) {
        test_most_similar(fmt, fmt, 64, 900, 300, 200);
        test_most_similar(fmt, fmt, 128, 2000, 1500, 60);
    }
    test_most_similar(KV_F16, KV_Q8_0, 128, 400, 1, 20);
    test_most_similar(KV_F32, KV_F16, 64, 300, 37, 100);

    for (int fmt = 0; fmt < KV_N_FORMATS; fmt++)
        for (int d = 64; d <= 128; d += 64) {
            const struct prefill_case cases[] = {
                { fmt, d, 4, 600, 120, { .window = 8, .kernel = 7, .tau = 0.3, .gamma = 4 } },
                { fmt, d, 8, 400, 64, { .window = 16, .kernel = 5, .tau = 0.1, .gamma = 2 } },
                { fmt, d, 2, 300, 100, { .window = 8, .kernel = 7, .tau = 1.0, .gamma = 4 } },   // evict only
                { fmt, d, 2, 300, 100, { .window = 8, .kernel = 1, .tau = 0.3, .gamma = 1 } },   // no TBM entries
            };
            for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) test_prefill(&cases[i]);
        }
    return check_report("test_cuda_ems_prefill");
}
