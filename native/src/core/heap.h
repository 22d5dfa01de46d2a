// heap.h - a binary heap over an array of fixed-size elements (the tokenizers' merge queues).
//
// As with qsort, the caller passes the array, its element size and the order: `before(a, b)`
// is nonzero when a is to come out before b. The caller owns the array, sizes it for the most
// elements it will push, and keeps the count *n. Equal elements come out in an order fixed by
// the sequence of pushes and pops. The functions are inline so that each caller's element
// size and order compile into a copy of its own.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int (*heap_before_fn)(const void *a, const void *b);

static inline void *heap_slot(void *base, int32_t i, size_t size) { return (char *)base + (size_t)i * size; }

// Add *elem to the heap of *n elements at base (the array must have room for it).
static inline void heap_push(void *base, int32_t *n, const void *elem, size_t size, heap_before_fn before) {
    int32_t i = (*n)++;
    while (i > 0) {
        int32_t parent = (i - 1) / 2;
        if (!before(elem, heap_slot(base, parent, size))) break;
        memcpy(heap_slot(base, i, size), heap_slot(base, parent, size), size);
        i = parent;
    }
    memcpy(heap_slot(base, i, size), elem, size);
}

// Take the first element out into *out (the heap must not be empty).
static inline void heap_pop(void *base, int32_t *n, void *out, size_t size, heap_before_fn before) {
    memcpy(out, base, size);
    const int32_t left = --(*n);
    const void *last = heap_slot(base, left, size);   // sifted down from the root; its slot is not written below
    int32_t i = 0;
    for (;;) {
        int32_t c = 2 * i + 1;
        if (c >= left) break;
        if (c + 1 < left && before(heap_slot(base, c + 1, size), heap_slot(base, c, size))) c++;
        if (!before(heap_slot(base, c, size), last)) break;
        memcpy(heap_slot(base, i, size), heap_slot(base, c, size), size);
        i = c;
    }
    if (left > 0) memcpy(heap_slot(base, i, size), last, size);
}
