// test_softmax.c - the dispatched softmax (AVX2 exponential where the CPU has it) against a
// double-precision softmax: every weight within 4e-6 relative, plus what float32 rounding
// of x - max allows, and the row summing to 1. Rows cover the lengths around the 8-wide tail, wide logit ranges (weights that
// underflow to 0), equal logits and large positive logits.
#include <math.h>
#include <stdlib.h>

#include "check.h"
#include "cpu/ops.h"

static uint64_t rng = 0x243F6A8885A308D3ull;
static double uniform(double lo, double hi) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return lo + (hi - lo) * (double)(rng >> 11) / 9007199254740992.0;
}

static void check_row(const float *logits, int n) {
    float *x = malloc((size_t)n * sizeof(float)), *s = malloc((size_t)n * sizeof(float));
    double *ref = malloc((size_t)n * sizeof(double));
    double max = -INFINITY, sum = 0.0;
    for (int i = 0; i < n; i++) { x[i] = s[i] = logits[i]; if (logits[i] > max) max = logits[i]; }
    for (int i = 0; i < n; i++) sum += ref[i] = exp((double)logits[i] - max);
    softmax(x, n);
    softmax_scalar(s, n);
    double total = 0.0;
    for (int i = 0; i < n; i++) {
        const double want = ref[i] / sum;
        // float32 rounds x - max to within 2^-24 |x - max|, which moves exp(x - max) by as much
        const double tol = want * (4e-6 + 1.2e-7 * (max - logits[i])) + 1e-30;
        CHECK_NEAR(x[i], want, tol);
        CHECK_NEAR(s[i], want, tol);
        total += x[i];
    }
    CHECK_NEAR(total, 1.0, 1e-5);
    free(x); free(s); free(ref);
}

int main(void) {
    const int lengths[] = { 1, 2, 7, 8, 9, 15, 16, 17, 100, 1000, 8192 };
    const double ranges[] = { 1.0, 10.0, 60.0, 200.0 };   // 200: most weights underflow
    float *row = malloc(8192 * sizeof(float));
    for (size_t a = 0; a < sizeof(lengths) / sizeof(lengths[0]); a++)
        for (size_t b = 0; b < sizeof(ranges) / sizeof(ranges[0]); b++) {
            for (int i = 0; i < lengths[a]; i++) row[i] = (float)uniform(-ranges[b], ranges[b]);
            check_row(row, lengths[a]);
        }
    for (int i = 0; i < 64; i++) row[i] = 3.5f;   // equal logits: uniform weights
    check_row(row, 64);
    for (int i = 0; i < 64; i++) row[i] = 80.0f + (float)i;   // large positive logits
    check_row(row, 64);
    // Every exponent the kernel sees, on a fine grid of x - max in [-90, 0].
    for (int i = 0; i < 4096; i++) row[i] = (float)(-90.0 * i / 4095.0);
    check_row(row, 4096);
    free(row);
    return check_report("test_softmax");
}
