// cuda-check.h - what the CUDA tests (tests/c/test_cuda_*) share on top of check.h: the NMSE
// of an output against its reference, the start of a test that needs a GPU, device buffers
// whose failures count as failed checks, and the xorshift generator the tests draw their
// inputs from. Static inline functions, for the C tests and the host-run .cu tests alike.
//
// The generator: each test has its own, seeded by the test, and draws from it in a fixed
// order, so a test sees the same inputs on every run. A test defines CUDA_CHECK_SEED before
// including this file; or, when it also makes weight rows with random-rows.h (whose
// random_row draws from that header's generator, seed 0x9E3779B97F4A7C15), it includes
// random-rows.h first and defines CUDA_CHECK_RANDOM_ROWS, and everything draws from that one.
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "ggml-cuda/device.h"

// ---- errors of an output ----

// NMSE = sum((got - want)^2) / sum(want^2), in double (the plain sum of squares where want is
// all zero). A NaN in got (an output left unwritten) makes it NaN, which fails any `<=` bound.
static inline double nmse(const float *got, const float *want, size_t n) {
    double err = 0.0, ref = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double e = (double)got[i] - (double)want[i];
        err += e * e;
        ref += (double)want[i] * want[i];
    }
    return ref > 0.0 ? err / ref : err;
}

// The same against a reference computed in double.
static inline double nmse_d(const float *got, const double *want, int64_t n) {
    double err = 0.0, ref = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double e = (double)got[i] - want[i];
        err += e * e;
        ref += want[i] * want[i];
    }
    return ref > 0.0 ? err / ref : err;
}

// ---- the device ----

// The start of a test that needs a GPU: without one, prints why and returns 0 (main then
// returns CHECK_SKIP, which CTest reports as skipped); with one, prints which and returns 1.
static inline int cuda_test_start(const char *name) {
    if (cuda_device_count() == 0) {
        printf("%s: skipped: %s\n", name, cuda_unavailable_reason());
        return 0;
    }
    char desc[256];
    if (cuda_device_describe(0, desc, sizeof(desc)) == PYKV_OK) printf("device: %s\n", desc);
    return 1;
}

// 1 for PYKV_OK; otherwise prints what failed and pykv's message, counts a failed check and
// gives 0 (a test then skips what depends on it).
static inline int ok(pykv_status st, const char *what) {
    if (st == PYKV_OK) return 1;
    fprintf(stderr, "%s: %s\n", what, pykv_last_error());
    check_failures++;
    return 0;
}

// Waits for the queued kernels and downloads; 0 (a failed check) on an error, theirs included.
static inline int fetch(void *dst, const void *d_src, size_t bytes, const char *what) {
    return ok(cuda_check(what), what) && ok(cuda_stream_sync(NULL), what) && ok(cuda_download(dst, d_src, bytes), what);
}

// A device buffer, NULL (and a failed check) when there is none.
static inline void *dev_alloc(size_t bytes) {
    void *d = NULL;
    if (!ok(cuda_alloc(&d, bytes, "a test buffer"), "alloc")) return NULL;
    return d;
}

// A device buffer of bytes (at least 1, so that an empty one is still a pointer), holding src
// unless src is NULL. Each step is a check; a test goes on with NULL after a failure.
static inline void *dev_upload(const void *src, size_t bytes) {
    void *d = NULL;
    CHECK(cuda_alloc(&d, bytes ? bytes : 1, "a test buffer") == PYKV_OK);
    if (d && src && bytes) CHECK(cuda_upload(d, src, bytes) == PYKV_OK);
    return d;
}

// Waits for the queued kernels, checks that none failed, and downloads bytes (each a check).
static inline void dev_download(void *dst, const void *d_src, size_t bytes) {
    CHECK(cuda_stream_sync(NULL) == PYKV_OK);
    CHECK(cuda_check("the kernels") == PYKV_OK);
    if (bytes) CHECK(cuda_download(dst, d_src, bytes) == PYKV_OK);
}

// ---- random numbers ----

#ifdef CUDA_CHECK_SEED
// The bits of the state that make uniform's 24-bit fraction: 16..39 (next_u32's low 24)
// unless the test picks others.
#ifndef CUDA_CHECK_UNIFORM_SHIFT
#define CUDA_CHECK_UNIFORM_SHIFT 16
#endif

static uint64_t rng = CUDA_CHECK_SEED;

// xorshift64 (13, 7, 17): one step, the new state.
static inline uint64_t next_state(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return rng;
}
static inline uint32_t next_u32(void) { return (uint32_t)(next_state() >> 16); }
// [lo, hi) in steps of (hi - lo) / 2^24.
static inline float uniform(float lo, float hi) {
    return lo + (hi - lo) * (float)((next_state() >> CUDA_CHECK_UNIFORM_SHIFT) & 0xFFFFFF) / 16777216.0f;
}

static inline float    u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
#endif

#if defined(CUDA_CHECK_SEED) || defined(CUDA_CHECK_RANDOM_ROWS)
// 0 .. n - 1 (n > 0).
static inline int next_int(int n) { return (int)(next_u32() % (uint32_t)n); }

static inline void fill(float *x, size_t n, float lo, float hi) {
    for (size_t i = 0; i < n; i++) x[i] = uniform(lo, hi);
}

// Activations for a matrix product, T rows of cols: values of about normal shape (a sum of
// four uniforms) times a per-row scale from 0.1 to 4, and on every third row (row 1, 4, ...)
// an outlier of 20 times the scale.
static inline void random_x(float *x, int64_t cols, int T) {
    for (int t = 0; t < T; t++) {
        const float scale = uniform(0.1f, 4.0f);
        for (int64_t c = 0; c < cols; c++) {
            float s = 0.0f;
            for (int i = 0; i < 4; i++) s += uniform(-1.0f, 1.0f);
            x[t * cols + c] = scale * 0.866f * s;
        }
        if (t % 3 == 1) x[t * cols + (int64_t)(next_u32() % (uint32_t)cols)] = 20.0f * scale;
    }
}

// Scores for the top-k tests, n of kind: 0 uniform, 1 a few values (ties), 2 a few values with
// NaN, inf, zeros of both signs and subnormals, 3 all equal.
static inline void fill_scores(float *s, int32_t n, int kind) {
    const float odd[] = { NAN, -INFINITY, INFINITY, 0.0f, -0.0f, 1e-40f, -1e-40f, 1.0f };
    for (int32_t j = 0; j < n; j++) {
        switch (kind) {
        case 0: s[j] = uniform(-1.0f, 1.0f); break;
        case 1: s[j] = (float)next_int(5) * 0.25f; break;
        case 2: s[j] = next_int(3) == 0 ? odd[next_int(8)] : (float)next_int(4) - 1.5f; break;
        default: s[j] = 0.125f; break;
        }
    }
}
#endif
