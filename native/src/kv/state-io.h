// state-io.h - writing and reading a saved state's bytes (state.c, state-load.c, and the
// policies that keep state of their own between calls: policy.h's state_write/state_read).
// A writer with no buffer only counts, so one function gives both a state's size and its
// bytes; a reader refuses to go past the end of what it was given, however the bytes lie.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <string.h>

struct state_writer {
    uint8_t *at;   // NULL: count only
    size_t   n;    // bytes written (or counted)
};

static inline void state_put(struct state_writer *w, const void *src, size_t n) {
    if (w->at && n) {
        memcpy(w->at, src, n);
        w->at += n;
    }
    w->n += n;
}

static inline void state_put_i32(struct state_writer *w, int32_t x) { state_put(w, &x, sizeof(x)); }

struct state_reader {
    const uint8_t *at;
    size_t         left;
};

// Copy n bytes out (or skip them when out is NULL); 0 when fewer than n are left.
static inline int state_take(struct state_reader *r, void *out, size_t n) {
    if (n > r->left) return 0;
    if (out && n) memcpy(out, r->at, n);
    r->at += n;
    r->left -= n;
    return 1;
}

static inline int state_take_i32(struct state_reader *r, int32_t *x) { return state_take(r, x, sizeof(*x)); }
