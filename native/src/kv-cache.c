// kv-cache.c - per-(layer, KV head) entry lists with real allocation accounting.
#include "kv-cache.h"
#include "error.h"

#include <stdlib.h>
#include <string.h>

#define KV_MIN_CAP 16

static int64_t list_bytes(const struct kv_cache *c, int32_t cap) {
    return (int64_t)cap * ((int64_t)2 * c->head_dim * (int64_t)sizeof(float) + (int64_t)sizeof(int32_t));
}

static pykv_status list_resize(struct kv_cache *c, struct kv_list *l, int32_t cap) {
    if (cap == l->cap) return PYKV_OK;
    if (cap == 0) {
        free(l->k); free(l->v); free(l->pos);
        l->k = l->v = NULL;
        l->pos = NULL;
    } else {
        size_t row = (size_t)c->head_dim * sizeof(float);
        float *k = realloc(l->k, (size_t)cap * row);
        if (!k) return pykv_error(PYKV_ERR_NOMEM, "out of memory growing the KV cache to %d entries per head", cap);
        l->k = k;
        float *v = realloc(l->v, (size_t)cap * row);
        if (!v) return pykv_error(PYKV_ERR_NOMEM, "out of memory growing the KV cache to %d entries per head", cap);
        l->v = v;
        int32_t *pos = realloc(l->pos, (size_t)cap * sizeof(int32_t));
        if (!pos) return pykv_error(PYKV_ERR_NOMEM, "out of memory growing the KV cache to %d entries per head", cap);
        l->pos = pos;
    }
    c->bytes += list_bytes(c, cap) - list_bytes(c, l->cap);
    if (c->bytes > c->peak_bytes) c->peak_bytes = c->bytes;
    l->cap = cap;
    return PYKV_OK;
}

pykv_status kv_cache_init(struct kv_cache *c, int n_layer, int n_head_kv, int head_dim, int max_entries) {
    memset(c, 0, sizeof(*c));
    c->n_layer = n_layer;
    c->n_head_kv = n_head_kv;
    c->head_dim = head_dim;
    c->max_entries = max_entries;
    c->lists = calloc((size_t)n_layer * n_head_kv, sizeof(struct kv_list));
    if (!c->lists) return pykv_error(PYKV_ERR_NOMEM, "out of memory creating the KV cache");
    return PYKV_OK;
}

void kv_cache_clear(struct kv_cache *c) {
    for (int i = 0; i < c->n_layer * c->n_head_kv; i++) {
        list_resize(c, &c->lists[i], 0);
        c->lists[i].n = 0;
    }
    c->bytes = 0;
    c->peak_bytes = 0;
    c->evicted = 0;
    c->merged = 0;
}

void kv_cache_free(struct kv_cache *c) {
    if (!c->lists) return;
    kv_cache_clear(c);
    free(c->lists);
    c->lists = NULL;
}

pykv_status kv_list_reserve(struct kv_cache *c, struct kv_list *l, int32_t extra) {
    int64_t need = (int64_t)l->n + extra;
    if (need <= l->cap) return PYKV_OK;
    if (need > c->max_entries)
        return pykv_error(PYKV_ERR_CONTEXT_FULL, "KV cache list full: %lld entries needed, %d allowed",
                          (long long)need, c->max_entries);
    // Grow by an eighth (amortised O(1) appends) so the slack stays small next to a budget.
    int64_t cap = l->cap + l->cap / 8;
    if (cap < need) cap = need;
    if (cap < KV_MIN_CAP) cap = KV_MIN_CAP;
    if (cap > c->max_entries) cap = c->max_entries;
    return list_resize(c, l, (int32_t)cap);
}

void kv_list_push(struct kv_cache *c, struct kv_list *l, const float *k, const float *v, int32_t pos) {
    size_t row = (size_t)c->head_dim;
    memcpy(l->k + (size_t)l->n * row, k, row * sizeof(float));
    memcpy(l->v + (size_t)l->n * row, v, row * sizeof(float));
    l->pos[l->n] = pos;
    l->n++;
}

pykv_status kv_list_retain(struct kv_cache *c, struct kv_list *l, const int32_t *keep, int32_t n_keep) {
    size_t row = (size_t)c->head_dim;
    for (int32_t j = 0; j < n_keep; j++) {
        int32_t i = keep[j];
        if (i < j || i >= l->n || (j > 0 && i <= keep[j - 1]))
            return pykv_error(PYKV_ERR_INTERNAL, "kv_list_retain: keep indices must be ascending and in range");
        if (i == j) continue;
        memcpy(l->k + (size_t)j * row, l->k + (size_t)i * row, row * sizeof(float));
        memcpy(l->v + (size_t)j * row, l->v + (size_t)i * row, row * sizeof(float));
        l->pos[j] = l->pos[i];
    }
    c->evicted += l->n - n_keep;
    l->n = n_keep;
    // Give the memory of the dropped entries back now: the bytes reported are the bytes held.
    int32_t cap = n_keep > KV_MIN_CAP ? n_keep : KV_MIN_CAP;
    return cap < l->cap ? list_resize(c, l, cap) : PYKV_OK;
}

void kv_list_truncate(struct kv_cache *c, struct kv_list *l, int32_t n) {
    if (n < l->n) l->n = n;
}

int64_t kv_cache_entries(const struct kv_cache *c) {
    int64_t total = 0;
    for (int i = 0; i < c->n_layer * c->n_head_kv; i++) total += c->lists[i].n;
    return total;
}
