// window-select.c - GQA reduction, pooling, top-k selection and compaction for the window
// policies (docs/policies.md#the-observation-window).
#include "kv/policies/common/window-scores.h"
#include "core/error.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void ws_gqa_reduce(const float *rows, int64_t stride, int32_t group, int32_t n, enum ws_gqa mode, float *out) {
    memcpy(out, rows, (size_t)n * sizeof(float));
    for (int32_t r = 1; r < group; r++) {
        const float *x = rows + (size_t)r * (size_t)stride;
        if (mode == WS_GQA_MAX)
            for (int32_t j = 0; j < n; j++) out[j] = x[j] > out[j] ? x[j] : out[j];
        else
            for (int32_t j = 0; j < n; j++) out[j] += x[j];
    }
    if (mode == WS_GQA_MEAN && group > 1)
        for (int32_t j = 0; j < n; j++) out[j] /= (float)group;
}

void ws_pool1d(const float *x, int32_t n, int32_t kernel, enum ws_pool type, float *out) {
    const int32_t r = kernel / 2;
    for (int32_t j = 0; j < n; j++) {
        const int32_t a = j - r < 0 ? 0 : j - r, b = j + r >= n ? n - 1 : j + r;
        if (type == WS_POOL_MAX) {
            float m = x[a];
            for (int32_t t = a + 1; t <= b; t++) m = x[t] > m ? x[t] : m;
            out[j] = m;
        } else {
            float s = 0.0f;   // out-of-range terms are zeros, still counted in the divisor
            for (int32_t t = a; t <= b; t++) s += x[t];
            out[j] = s / (float)kernel;
        }
    }
}

// Ranks below every score: NaN counts as -inf, and among equal scores the higher index is
// the lower rank (the sort's tie rule, so both paths choose the same entries).
static int ranks_below(float a, int64_t ia, float b, int64_t ib) {
    if (isnan(a)) a = -INFINITY;
    if (isnan(b)) b = -INFINITY;
    return a < b || (a == b && ia > ib);
}

// The lowest-ranked of s[0..n) other than the n_taken indices in taken.
static int64_t lowest_ranked(const float *s, int64_t n, const int64_t *taken, int64_t n_taken) {
    int64_t lo = -1;
    for (int64_t j = 0; j < n; j++) {
        int is_taken = 0;
        for (int64_t e = 0; e < n_taken; e++) is_taken |= taken[e] == j;
        if (!is_taken && (lo < 0 || ranks_below(s[j], j, s[lo], lo))) lo = j;
    }
    return lo;
}

// A decode step drops one or two entries of a list: a few linear scans instead of a sort.
static pykv_status drop_lowest(const float *s, int64_t n, int64_t n_drop, int64_t *idx) {
    int64_t drop[4];
    for (int64_t d = 0; d < n_drop; d++) drop[d] = lowest_ranked(s, n, drop, d);
    int64_t m = 0;
    for (int64_t j = 0; j < n; j++) {
        int dropped = 0;
        for (int64_t e = 0; e < n_drop; e++) dropped |= drop[e] == j;
        if (!dropped) idx[m++] = j;
    }
    return PYKV_OK;
}

// The rank key of entry j with score s: (ordered bits of s) << 32 | ~j. Keys are unique in a
// list, and key a > key b exactly when a outranks b (higher score, or an equal score at a
// lower index; NaN as -inf, -0 equal to +0): the keys of the GPU's select
// (ggml-cuda/topk-radix.cuh). Ranking integers instead of calling a comparator is what makes
// a cascade's many selections cheap.
static uint64_t rank_key(float s, int64_t j) {
    uint32_t u;
    memcpy(&u, &s, sizeof(u));
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) u = 0xFF800000u;   // NaN: -inf
    else if (a == 0) u = 0;                 // -0: +0
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((uint64_t)u << 32) | (uint32_t)~(uint32_t)j;
}

static pykv_status check_rank_size(int64_t n) {
    if (n > (int64_t)INT32_MAX)
        return pykv_error(PYKV_ERR_UNSUPPORTED, "cannot rank %lld entries at once (at most %d)", (long long)n, INT32_MAX);
    return PYKV_OK;
}

// The k-th largest (1 <= k <= n) of n unique keys, by a radix select from the top byte: each
// pass keeps only the keys that share the digits fixed so far (keys is reordered).
static uint64_t kth_largest_key(uint64_t *keys, int64_t n, int64_t k) {
    for (int shift = 56; shift >= 0 && n > 1; shift -= 8) {
        int64_t hist[256] = { 0 };
        for (int64_t i = 0; i < n; i++) hist[(keys[i] >> shift) & 255]++;
        int d = 255;
        for (; d > 0 && hist[d] < k; d--) k -= hist[d];
        int64_t m = 0;
        for (int64_t i = 0; i < n; i++)
            if ((int)((keys[i] >> shift) & 255) == d) keys[m++] = keys[i];
        n = m;
    }
    return keys[0];
}

pykv_status ws_select_top(const float *s, int64_t n, int64_t k, int64_t *idx, int64_t *n_out) {
    if (k > n) k = n;
    if (k < 0) k = 0;
    *n_out = k;
    if (k == 0) return PYKV_OK;
    if (k == n) {
        for (int64_t j = 0; j < n; j++) idx[j] = j;
        return PYKV_OK;
    }
    if (n - k <= 4) return drop_lowest(s, n, n - k, idx);
    PYKV_TRY(check_rank_size(n));
    uint64_t *keys = malloc((size_t)n * sizeof(*keys));
    if (!keys)
        return pykv_error(PYKV_ERR_NOMEM, "out of memory selecting %lld of %lld entries", (long long)k, (long long)n);
    for (int64_t j = 0; j < n; j++) keys[j] = rank_key(s[j], j);
    const uint64_t kth = kth_largest_key(keys, n, k);
    int64_t m = 0;
    for (int64_t j = 0; j < n; j++)   // exactly k keys are >= the k-th: ascending indices
        if (rank_key(s[j], j) >= kth) idx[m++] = j;
    free(keys);
    return PYKV_OK;
}

pykv_status ws_rank(const float *s, int64_t n, int32_t *order) {
    if (n <= 0) return PYKV_OK;
    PYKV_TRY(check_rank_size(n));
    uint64_t *a = malloc((size_t)n * sizeof(*a)), *b = malloc((size_t)n * sizeof(*b));
    if (!a || !b) {
        free(a); free(b);
        return pykv_error(PYKV_ERR_NOMEM, "out of memory ranking %lld entries", (long long)n);
    }
    for (int64_t j = 0; j < n; j++) a[j] = ~rank_key(s[j], j);   // ascending ~key = descending rank
    for (int shift = 0; shift < 64; shift += 8) {   // LSD radix sort, one byte a pass
        int64_t count[256] = { 0 };
        for (int64_t i = 0; i < n; i++) count[(a[i] >> shift) & 255]++;
        if (count[(a[0] >> shift) & 255] == n) continue;   // one digit everywhere: the order stands
        int64_t at = 0;
        for (int d = 0; d < 256; d++) {
            const int64_t c = count[d];
            count[d] = at;
            at += c;
        }
        for (int64_t i = 0; i < n; i++) b[count[(a[i] >> shift) & 255]++] = a[i];
        uint64_t *t = a;
        a = b;
        b = t;
    }
    for (int64_t i = 0; i < n; i++) order[i] = (int32_t)(uint32_t)a[i];   // ~~j
    free(a); free(b);
    return PYKV_OK;
}

pykv_status ws_keep(const struct policy_event *ev, int32_t g, const int64_t *chosen, int64_t n_chosen,
                    int32_t n_cand) {
    struct kv_cache *c = ev->cache;
    struct kv_list *l = kv_cache_list(c, ev->layer, g);
    if (n_chosen >= n_cand) return PYKV_OK;   // everything kept
    int32_t n_keep = (int32_t)n_chosen + (l->n - n_cand);
    int32_t *keep = malloc((size_t)(n_keep ? n_keep : 1) * sizeof(int32_t));
    if (!keep) return pykv_error(PYKV_ERR_NOMEM, "out of memory compacting the KV cache");
    int32_t m = 0;
    for (int64_t j = 0; j < n_chosen; j++) keep[m++] = (int32_t)chosen[j];
    for (int32_t j = n_cand; j < l->n; j++) keep[m++] = j;
    pykv_status st = kv_list_retain(c, l, keep, n_keep);
    free(keep);
    return st;
}

pykv_status ws_cascade_init(struct ws_cascade_list *c, int32_t n_cand) {
    c->s = malloc((size_t)(n_cand > 0 ? n_cand : 1) * sizeof(float));
    c->row = malloc((size_t)(n_cand > 0 ? n_cand : 1) * sizeof(int32_t));
    c->n_cand = c->list_cand = n_cand;
    if (!c->s || !c->row) return pykv_error(PYKV_ERR_NOMEM, "out of memory for a cascade's scores");
    for (int32_t j = 0; j < n_cand; j++) c->row[j] = j;
    return PYKV_OK;
}

void ws_cascade_free(struct ws_cascade_list *c) {
    free(c->s);
    free(c->row);
    memset(c, 0, sizeof(*c));
}

pykv_status ws_cascade_keep_top(const struct policy_event *ev, int32_t g, struct ws_cascade_list *c, int64_t b,
                                int apply) {
    if (b < c->n_cand) {
        int64_t *idx = malloc((size_t)(b > 0 ? b : 1) * sizeof(int64_t)), n = 0;
        if (!idx) return pykv_error(PYKV_ERR_NOMEM, "out of memory shrinking layer %d", ev->layer);
        const pykv_status rc = ws_select_top(c->s, c->n_cand, b, idx, &n);
        for (int64_t i = 0; rc == PYKV_OK && i < n; i++) {   // idx ascending: in place
            c->s[i] = c->s[idx[i]];
            c->row[i] = c->row[idx[i]];
        }
        free(idx);
        PYKV_TRY(rc);
        c->n_cand = (int32_t)n;
    }
    // unless asked, the list is compacted only once it holds over 1.5x the selection: a
    // cascade's shares shrink by a little at every later layer, and a compaction each time
    // would cost one per layer and list
    if (c->n_cand == c->list_cand || (!apply && 2 * (int64_t)c->list_cand <= 3 * (int64_t)c->n_cand)) return PYKV_OK;
    int64_t *chosen = malloc((size_t)(c->n_cand > 0 ? c->n_cand : 1) * sizeof(int64_t));
    if (!chosen) return pykv_error(PYKV_ERR_NOMEM, "out of memory shrinking layer %d", ev->layer);
    for (int32_t i = 0; i < c->n_cand; i++) chosen[i] = c->row[i];
    const pykv_status rc = ws_keep(ev, g, chosen, c->n_cand, c->list_cand);
    free(chosen);
    PYKV_TRY(rc);
    for (int32_t i = 0; i < c->n_cand; i++) c->row[i] = i;
    c->list_cand = c->n_cand;
    return PYKV_OK;
}

pykv_status ws_keep_top(const struct policy_event *ev, int32_t g, const float *scores, int32_t n_cand, int64_t b) {
    if (b >= n_cand) return PYKV_OK;
    struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
    if (b == n_cand - 1 && b > 0 && !l->n_members) {
        // a decode step's eviction: the one lowest-ranked candidate leaves, the rest keep their
        // order (the same entries and order as the general path, without its index lists)
        const int32_t lo = (int32_t)lowest_ranked(scores, n_cand, NULL, 0);
        return kv_list_drop(ev->cache, l, lo, l->n - lo - 1);
    }
    int64_t *idx = malloc((size_t)(b > 0 ? b : 1) * sizeof(int64_t));
    if (!idx) return pykv_error(PYKV_ERR_NOMEM, "out of memory selecting KV entries");
    int64_t n = 0;
    pykv_status st = ws_select_top(scores, n_cand, b, idx, &n);
    if (st == PYKV_OK) st = ws_keep(ev, g, idx, n, n_cand);
    free(idx);
    return st;
}

pykv_status ws_layer_keep_top(const struct policy_event *ev, const struct ws_opts *o, struct ws_window w, int64_t b) {
    if (ev->q_device) {
        int done = 0;
        PYKV_TRY(ws_layer_keep_top_device(ev, o, w, b, &done));
        if (done) return PYKV_OK;
    }
    struct ws_stats st;
    float *s = NULL;
    PYKV_TRY(ws_layer_scores(ev, o, w, &st, &s));
    pykv_status rc = PYKV_OK;
    for (int g = 0; g < st.n_head_kv && rc == PYKV_OK; g++)
        rc = ws_keep_top(ev, g, s + st.offset_kv[g], st.n_cand[g], b);
    free(s);
    ws_stats_free(&st);
    return rc;
}
