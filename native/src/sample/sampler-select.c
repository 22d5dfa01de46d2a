// sampler-select.c - partial selection of the best candidates, so top-k over a 49152-token
// vocabulary never sorts the whole vocabulary. Small k: a bounded heap (one well-predicted
// comparison per token); large k: quickselect. Then a sort of the k.
#include "sample/sampler.h"

#include <stdlib.h>

static void swap_cand(struct sampler_cand *a, struct sampler_cand *b) {
    struct sampler_cand t = *a;
    *a = *b;
    *b = t;
}

// Partition c[lo..hi] around a median-of-three pivot; return the pivot's final index.
// Everything before it ranks before the pivot, everything after ranks after it.
static int32_t partition(struct sampler_cand *c, int32_t lo, int32_t hi) {
    int32_t mid = lo + (hi - lo) / 2;
    if (sampler_cand_before(&c[mid], &c[lo])) swap_cand(&c[mid], &c[lo]);
    if (sampler_cand_before(&c[hi], &c[lo])) swap_cand(&c[hi], &c[lo]);
    if (sampler_cand_before(&c[hi], &c[mid])) swap_cand(&c[hi], &c[mid]);
    // c[mid] is the median; park it at hi and sweep (Lomuto).
    swap_cand(&c[mid], &c[hi]);
    struct sampler_cand pivot = c[hi];
    int32_t store = lo;
    for (int32_t i = lo; i < hi; i++) {
        if (sampler_cand_before(&c[i], &pivot)) {
            swap_cand(&c[i], &c[store]);
            store++;
        }
    }
    swap_cand(&c[store], &c[hi]);
    return store;
}

// Rearrange so that c[0..k) holds the k best (unordered).
static void quickselect(struct sampler_cand *c, int32_t n, int32_t k) {
    int32_t lo = 0, hi = n - 1;
    while (lo < hi) {
        int32_t p = partition(c, lo, hi);
        if (p == k - 1 || p == k) return;   // c[0..k) are then exactly the k best
        if (p < k) lo = p + 1;
        else hi = p - 1;
    }
}

// Restore the heap property below i in a heap whose root ranks last (the worst kept one).
static void sift_down(struct sampler_cand *h, int32_t k, int32_t i) {
    for (;;) {
        int32_t l = 2 * i + 1, r = l + 1, worst = i;
        if (l < k && sampler_cand_before(&h[worst], &h[l])) worst = l;
        if (r < k && sampler_cand_before(&h[worst], &h[r])) worst = r;
        if (worst == i) return;
        swap_cand(&h[i], &h[worst]);
        i = worst;
    }
}

// Keep the k best in c[0..k) as a heap; a candidate beating the root replaces it and the
// root moves out to the candidate's slot, so c stays a permutation of the input.
static void heapselect(struct sampler_cand *c, int32_t n, int32_t k) {
    for (int32_t i = k / 2 - 1; i >= 0; i--) sift_down(c, k, i);
    for (int32_t i = k; i < n; i++) {
        if (sampler_cand_before(&c[i], &c[0])) {
            swap_cand(&c[i], &c[0]);
            sift_down(c, k, 0);
        }
    }
}

static int cmp_cand(const void *pa, const void *pb) {
    const struct sampler_cand *a = pa, *b = pb;
    if (sampler_cand_before(a, b)) return -1;
    if (sampler_cand_before(b, a)) return 1;
    return 0;
}

void sampler_select_top(struct sampler_cand *c, int32_t n, int32_t k) {
    if (n <= 0 || k <= 0) return;
    if (k > n) k = n;
    if (k < n) {
        if (k <= 1024 && k <= n / 16) heapselect(c, n, k);
        else quickselect(c, n, k);
    }
    qsort(c, (size_t)k, sizeof(*c), cmp_cand);
}

void sampler_sort_more(struct sampler_cand *c, int32_t n, int32_t *n_sorted) {
    int32_t grow = *n_sorted < 64 ? 64 : *n_sorted * 3;
    if (grow > n - *n_sorted) grow = n - *n_sorted;
    sampler_select_top(c + *n_sorted, n - *n_sorted, grow);
    *n_sorted += grow;
}
