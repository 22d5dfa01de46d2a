// twin-lists.h - a layer's lists held twice, by a cache in host memory and by one in GPU memory
// with the same rows, for the CUDA tests that run a policy's step on both and compare what
// each list keeps. Static inline functions; the including test has included check.h.
#pragma once
#include <stdlib.h>
#include <string.h>

#include "kv/kv-cache.h"

// Rows k and v (n rows of head_dim floats each) as list g of layer 0 of both caches, at
// positions 3 j + 1 (apart from the indices).
static inline void twin_list_fill(struct kv_cache *host, struct kv_cache *dev, int g, int32_t n, const float *k,
                                  const float *v) {
    struct kv_list *h = kv_cache_list(host, 0, g), *l = kv_cache_list(dev, 0, g);
    const int d = host->head_dim;
    CHECK(kv_list_reserve(host, h, n) == PYKV_OK);
    for (int32_t j = 0; j < n; j++) kv_list_push(host, h, k + (size_t)j * d, v + (size_t)j * d, 3 * j + 1);
    CHECK(kv_list_reserve(dev, l, n) == PYKV_OK);
    memcpy(l->pos, h->pos, (size_t)n * sizeof(int32_t));
    CHECK(kv_list_write_rows(dev, l, 0, n, h->k) == PYKV_OK);
    CHECK(kv_list_write_rows(dev, l, 1, n, h->v) == PYKV_OK);
    l->n = n;
}

// m more rows k and v appended to list g of layer 0 of both caches, at positions pos0 + 3 t
// (a later prompt over what the lists kept).
static inline void twin_list_append(struct kv_cache *host, struct kv_cache *dev, int g, int32_t m, const float *k,
                                    const float *v, int32_t pos0) {
    struct kv_list *h = kv_cache_list(host, 0, g), *l = kv_cache_list(dev, 0, g);
    const int d = host->head_dim;
    const int32_t n = l->n;
    CHECK(kv_list_reserve(host, h, m) == PYKV_OK);
    for (int32_t t = 0; t < m; t++) kv_list_push(host, h, k + (size_t)t * d, v + (size_t)t * d, pos0 + 3 * t);
    CHECK(kv_list_reserve(dev, l, m) == PYKV_OK);
    kv_list_push_positions(l, pos0, m);   // the rows as the forward pass appends a chunk's
    memcpy(l->pos + n, h->pos + n, (size_t)m * sizeof(int32_t));
    CHECK(kv_list_write_rows(dev, l, 0, n + m, h->k) == PYKV_OK);
    CHECK(kv_list_write_rows(dev, l, 1, n + m, h->v) == PYKV_OK);
    CHECK(kv_list_sync_members(dev, l) == PYKV_OK);
}

// Whether list g of layer 0 is the same in both caches: its positions, its rows byte for byte,
// and its merged entries' member counts and norms. *kept += its entries.
static inline int twin_list_same(const struct kv_cache *host, const struct kv_cache *dev, int g, int64_t *kept) {
    const struct kv_list *h = kv_cache_list((struct kv_cache *)host, 0, g), *l = kv_cache_list((struct kv_cache *)dev, 0, g);
    *kept += h->n;
    if (h->n != l->n || memcmp(h->pos, l->pos, (size_t)h->n * sizeof(int32_t)) != 0) return 0;
    if (!h->n_members != !l->n_members) return 0;
    for (int32_t j = 0; h->n_members && j < h->n; j++) {
        if (h->n_members[j] != l->n_members[j]) return 0;
        if (h->n_members[j] > 1 &&
            memcmp(kv_member_norms(h, j), kv_member_norms(l, j), (size_t)h->n_members[j] * sizeof(float)) != 0)
            return 0;
    }
    const size_t kb = kv_cache_key_bytes(host), vb = kv_cache_value_bytes(host);
    unsigned char *k = malloc((size_t)h->n * kb + 1), *v = malloc((size_t)h->n * vb + 1);
    CHECK(cuda_stream_sync(NULL) == PYKV_OK);
    CHECK(kv_list_read_rows(dev, l, 0, l->n, k) == PYKV_OK);
    CHECK(kv_list_read_rows(dev, l, 1, l->n, v) == PYKV_OK);
    const int same = memcmp(k, h->k, (size_t)h->n * kb) == 0 && memcmp(v, h->v, (size_t)h->n * vb) == 0;
    free(k);
    free(v);
    return same;
}
