// test_attention_flash.c - the attention paths that keep no weights row, against a
// double-precision softmax attention:
//  * blocked prefill attention (attention_flash, AVX2 and scalar): blocks of tokens with their
//    GQA group of query heads, causal inside the block, lists that end inside a key block or
//    on its edge, head sizes on and off the SIMD path (d % 32), floats, halves and Q8_0, and an
//    infinite value that only the last token sees;
//  * decode split into segments (attention_group_partial + attention_merge) for every way of
//    cutting a list.
#include "cpu/attention.h"
#include "check.h"
#include "kv/kv-cache.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static float frand(void) { return (float)rand() / (float)RAND_MAX * 2.0f - 1.0f; }

// Softmax attention of q over the first n entries, in doubles, from the stored (rounded) K/V.
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

// fmts: a key and a value format, fmt_k + KV_N_FORMATS * fmt_v (as -ctk and -ctv may differ)
#define N_FORMAT_PAIRS (KV_N_FORMATS * KV_N_FORMATS)
static int pair_fits(int fmts, int d) {
    return d % 32 == 0 || (fmts % KV_N_FORMATS != KV_Q8_0 && fmts / KV_N_FORMATS != KV_Q8_0);
}

static struct kv_list *random_list(struct kv_cache *cache, int d, int n, int fmts) {
    CHECK(kv_cache_init(cache, 1, 1, d, n, fmts % KV_N_FORMATS, fmts / KV_N_FORMATS) == PYKV_OK);
    struct kv_list *l = kv_cache_list(cache, 0, 0);
    CHECK(kv_list_reserve(cache, l, n) == PYKV_OK);
    float *k = malloc((size_t)d * sizeof(float)), *v = malloc((size_t)d * sizeof(float));
    for (int j = 0; j < n; j++) {
        for (int i = 0; i < d; i++) { k[i] = 2.0f * frand(); v[i] = frand(); }
        kv_list_push(cache, l, k, v, j);
    }
    free(k); free(v);
    return l;
}

// n_tok tokens with n_rep heads each; token i sees n_vis0 + i entries of a list of
// n_vis0 + n_tok - 1 (the block is the end of a chunk) plus `extra` entries nobody sees.
// poison: the entry only the last token sees gets infinite values, and the other tokens'
// outputs must not notice (the last token's is not checked).
static void check_flash(int d, int n_rep, int n_tok, int n_vis0, int extra, int fmts, int scalar, int poison) {
    struct kv_cache cache;
    const int n = n_vis0 + n_tok - 1 + extra;
    struct kv_list *l = random_list(&cache, d, n, fmts);
    if (poison) {
        float k[PYKV_MAX_HEAD_DIM], v[PYKV_MAX_HEAD_DIM], tmp[PYKV_MAX_HEAD_DIM];
        const int j = n_vis0 + n_tok - 2;
        memcpy(k, kv_key_f32(l, j, d, tmp), (size_t)d * sizeof(float));
        for (int i = 0; i < d; i++) v[i] = INFINITY;
        kv_list_set_kv(l, j, k, v, d);
    }
    const size_t stride = (size_t)(n_rep + 1) * d;   // one unused head between tokens
    float *q = malloc((size_t)n_tok * stride * sizeof(float)), *out = malloc((size_t)n_tok * stride * sizeof(float));
    float *work = malloc(flash_work_floats(d, n_rep) * sizeof(float));
    double *ref = malloc((size_t)d * sizeof(double));
    for (size_t i = 0; i < (size_t)n_tok * stride; i++) { q[i] = 3.0f * frand(); out[i] = 7.0f; }
    (scalar ? attention_flash_scalar : attention_flash)(q, stride, n_tok, n_rep, n_vis0, l, d, out, stride, work);
    for (int t = 0; t < n_tok; t++) {
        for (int h = 0; h < n_rep && !(poison && t == n_tok - 1); h++) {
            reference(q + (size_t)t * stride + (size_t)h * d, l, n_vis0 + t, d, ref);
            for (int i = 0; i < d; i++) CHECK_NEAR(out[(size_t)t * stride + (size_t)h * d + i], ref[i], 3e-5);
        }
        for (int i = 0; i < d; i++) CHECK(out[(size_t)t * stride + (size_t)n_rep * d + i] == 7.0f);   // untouched
    }
    free(q); free(out); free(work); free(ref);
    kv_cache_free(&cache);
}

static void check_split(int d, int nq, int n, int n_seg, int fmts) {
    struct kv_cache cache;
    struct kv_list *l = random_list(&cache, d, n, fmts);
    float *q = malloc((size_t)nq * d * sizeof(float)), *w = malloc((size_t)nq * n * sizeof(float));
    float *o = malloc((size_t)n_seg * nq * d * sizeof(float)), *m = malloc((size_t)n_seg * nq * sizeof(float));
    float *lsum = malloc((size_t)n_seg * nq * sizeof(float)), *out = malloc((size_t)d * sizeof(float));
    double *ref = malloc((size_t)d * sizeof(double));
    for (int i = 0; i < nq * d; i++) q[i] = 3.0f * frand();
    for (int s = 0; s < n_seg; s++) {
        const int j0 = (int)((long)n * s / n_seg), j1 = (int)((long)n * (s + 1) / n_seg);
        float po[ATTENTION_TILE * PYKV_MAX_HEAD_DIM], pm[ATTENTION_TILE], pl[ATTENTION_TILE];
        attention_group_partial(q, nq, l, j0, j1, d, w, po, pm, pl);
        for (int r = 0; r < nq; r++) {   // regroup per query row: its n_seg parts together
            m[r * n_seg + s] = pm[r];
            lsum[r * n_seg + s] = pl[r];
            for (int i = 0; i < d; i++) o[((size_t)r * n_seg + s) * d + i] = po[(size_t)r * d + i];
        }
    }
    for (int r = 0; r < nq; r++) {
        attention_merge(n_seg, m + r * n_seg, lsum + r * n_seg, o + (size_t)r * n_seg * d, d, out);
        reference(q + (size_t)r * d, l, n, d, ref);
        for (int i = 0; i < d; i++) CHECK_NEAR(out[i], ref[i], 3e-5);
    }
    free(q); free(w); free(o); free(m); free(lsum); free(out); free(ref);
    kv_cache_free(&cache);
}

int main(void) {
    srand(5);
    const int ds[] = { 64, 128, 48 };       // 48: the scalar path only
    const int reps[] = { 1, 3, 4, 8 };
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 4; b++) {
            const int n_tok = flash_tokens_per_block(reps[b]);
            const int vis0[] = { 1, 31, 32, 33, 70, 97 };
            for (int c = 0; c < 6; c++)
                for (int fmts = 0; fmts < N_FORMAT_PAIRS; fmts++) {
                    if (!pair_fits(fmts, ds[a])) continue;
                    check_flash(ds[a], reps[b], n_tok, vis0[c], 0, fmts, 0, 0);
                    check_flash(ds[a], reps[b], n_tok, vis0[c], 0, fmts, 1, 0);
                    if (n_tok > 1) check_flash(ds[a], reps[b], n_tok, vis0[c], 0, fmts, 0, 1);
                }
            check_flash(ds[a], reps[b], 1, 40, 5, KV_F16 * (KV_N_FORMATS + 1), 0, 0);   // a single token
            check_flash(ds[a], reps[b], n_tok > 2 ? 2 : 1, 64, 3, 0, 0, 0);
        }
    for (int a = 0; a < 3; a++)
        for (int nq = 1; nq <= ATTENTION_TILE; nq++) {
            const int ns[] = { 1, 5, 300 };
            for (int c = 0; c < 3; c++)
                for (int n_seg = 1; n_seg <= 4 && n_seg <= ns[c]; n_seg++) {
                    for (int fmts = 0; fmts < N_FORMAT_PAIRS; fmts++)
                        if (pair_fits(fmts, ds[a])) check_split(ds[a], nq, ns[c], n_seg, fmts);
                }
        }
    return check_report("test_attention_flash");
}
