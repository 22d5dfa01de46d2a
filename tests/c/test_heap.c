// test_heap.c - core/heap.h: elements come out in the order the caller's function gives,
// checked against qsort of the same elements, with pushes and pops interleaved.
#include "core/heap.h"
#include "check.h"

#include <stdint.h>
#include <stdlib.h>

struct item {
    int32_t key, seq;   // seq: unique, so the order is total and qsort's result is the reference
    float   payload;
};

static int item_before(const void *pa, const void *pb) {
    const struct item *a = pa, *b = pb;
    return a->key < b->key || (a->key == b->key && a->seq < b->seq);
}

static int item_cmp(const void *pa, const void *pb) {
    return item_before(pa, pb) ? -1 : item_before(pb, pa) ? 1 : 0;
}

static uint32_t rng_state = 12345u;
static uint32_t next_rand(void) {
    rng_state = rng_state * 1664525u + 1013904223u;
    return rng_state >> 8;
}

// Push n random items (keys in [0, range): many ties), pop them all: ascending by (key, seq).
static void test_sorted_out(int n, int range) {
    struct item *heap = malloc(sizeof(struct item) * (size_t)n), *ref = malloc(sizeof(struct item) * (size_t)n);
    int32_t n_heap = 0;
    for (int i = 0; i < n; i++) {
        ref[i] = (struct item){ (int32_t)(next_rand() % (uint32_t)range), i, (float)i * 0.5f };
        heap_push(heap, &n_heap, &ref[i], sizeof(struct item), item_before);
    }
    CHECK(n_heap == n);
    qsort(ref, (size_t)n, sizeof(struct item), item_cmp);
    int in_order = 1;
    for (int i = 0; i < n; i++) {
        struct item got;
        heap_pop(heap, &n_heap, &got, sizeof(got), item_before);
        in_order &= got.key == ref[i].key && got.seq == ref[i].seq && got.payload == ref[i].payload;
    }
    CHECK(in_order);
    CHECK(n_heap == 0);
    free(heap); free(ref);
}

// Pops between pushes: every pop returns the least of what is held then (a linear scan).
static void test_interleaved(void) {
    enum { N = 500 };
    struct item heap[N], held[N];
    int32_t n_heap = 0, n_held = 0, seq = 0, ok = 1;
    for (int step = 0; step < 2000; step++) {
        if (n_heap < N && (n_heap == 0 || next_rand() % 3 != 0)) {
            struct item it = { (int32_t)(next_rand() % 50), seq++, 0.0f };
            heap_push(heap, &n_heap, &it, sizeof(it), item_before);
            held[n_held++] = it;
        } else {
            int least = 0;
            for (int i = 1; i < n_held; i++)
                if (item_before(&held[i], &held[least])) least = i;
            struct item got;
            heap_pop(heap, &n_heap, &got, sizeof(got), item_before);
            ok &= got.seq == held[least].seq;
            held[least] = held[--n_held];
        }
        ok &= n_heap == n_held;
    }
    CHECK(ok);
}

int main(void) {
    test_sorted_out(1, 1);
    test_sorted_out(2, 1);
    test_sorted_out(1000, 10);
    test_sorted_out(4096, 1 << 20);
    test_interleaved();
    return check_report("test_heap");
}
