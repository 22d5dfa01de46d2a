// check.h - the few assertion macros the C unit tests share.
#pragma once
#include <math.h>
#include <stdio.h>

static int check_failures = 0;
static int check_count = 0;

#define CHECK(cond) do { check_count++; if (!(cond)) { check_failures++; \
    fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); } } while (0)

#define CHECK_NEAR(a, b, tol) do { double a_ = (a), b_ = (b); check_count++; \
    if (!(fabs(a_ - b_) <= (tol))) { check_failures++; \
    fprintf(stderr, "%s:%d: CHECK_NEAR failed: %s=%g %s=%g tol=%g\n", __FILE__, __LINE__, #a, a_, #b, b_, (double)(tol)); } } while (0)

// Print a summary and return the exit code for main().
static inline int check_report(const char *name) {
    printf("%s: %d checks, %d failed\n", name, check_count, check_failures);
    return check_failures ? 1 : 0;
}

// Exit code of a test that cannot run here (a CUDA test without a GPU): CTest reports it as
// skipped (SKIP_RETURN_CODE in tests/c/CMakeLists.txt).
#define CHECK_SKIP 77
