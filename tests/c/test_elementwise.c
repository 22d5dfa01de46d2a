// test_elementwise.c - RMSNorm and SwiGLU, dispatched (AVX2 where the CPU has it) and scalar,
// against double precision: RMSNorm within 1e-6 relative (three float roundings), SwiGLU within
// 2e-6 relative plus 1e-30 (gates past -87 give an exponential out of float range: the
// kernels return a zero or a denormal-sized value where the exact one is smaller still).
// Lengths around the 8-wide tail; gates from small to far past the exponential's range.
#include <math.h>
#include <stdlib.h>

#include "check.h"
#include "cpu/ops.h"

static uint64_t rng = 0x13198A2E03707344ull;
static double uniform(double lo, double hi) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return lo + (hi - lo) * (double)(rng >> 11) / 9007199254740992.0;
}

static void check_rmsnorm(const float *x, const float *w, int n, float eps) {
    float *a = malloc((size_t)n * sizeof(float)), *b = malloc((size_t)n * sizeof(float));
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const double scale = 1.0 / sqrt(ss / n + eps);
    rmsnorm(a, x, w, n, eps);
    rmsnorm_scalar(b, x, w, n, eps);
    for (int i = 0; i < n; i++) {
        const double want = x[i] * scale * w[i];
        CHECK_NEAR(a[i], want, 1e-6 * fabs(want) + 1e-30);
        CHECK_NEAR(b[i], want, 1e-6 * fabs(want) + 1e-30);
    }
    free(a); free(b);
}

static void check_swiglu(const float *g, const float *u, int n) {
    float *a = malloc((size_t)n * sizeof(float)), *b = malloc((size_t)n * sizeof(float));
    swiglu(a, g, u, n);
    swiglu_scalar(b, g, u, n);
    for (int i = 0; i < n; i++) {
        const double want = (double)g[i] / (1.0 + exp(-(double)g[i])) * u[i];
        CHECK_NEAR(a[i], want, 2e-6 * fabs(want) + 1e-30);
        CHECK_NEAR(b[i], want, 2e-6 * fabs(want) + 1e-30);
    }
    free(a); free(b);
}

int main(void) {
    const int lengths[] = { 1, 7, 8, 9, 15, 16, 17, 576, 1536, 4099 };
    const double ranges[] = { 0.01, 1.0, 20.0, 120.0 };   // 120: exponentials out of float range
    float *x = malloc(4099 * sizeof(float)), *w = malloc(4099 * sizeof(float));
    for (size_t a = 0; a < sizeof(lengths) / sizeof(lengths[0]); a++)
        for (size_t b = 0; b < sizeof(ranges) / sizeof(ranges[0]); b++) {
            const int n = lengths[a];
            for (int i = 0; i < n; i++) {
                x[i] = (float)uniform(-ranges[b], ranges[b]);
                w[i] = (float)uniform(-2.0, 2.0);
            }
            check_rmsnorm(x, w, n, 1e-5f);
            check_swiglu(x, w, n);
        }
    for (int i = 0; i < 64; i++) x[i] = 0.0f;   // an all-zero row: eps keeps the scale finite
    check_rmsnorm(x, w, 64, 1e-5f);
    for (int i = 0; i < 4096; i++) x[i] = (float)(-100.0 + 200.0 * i / 4095.0);   // every exponent
    for (int i = 0; i < 4096; i++) w[i] = 1.0f;
    check_swiglu(x, w, 4096);
    free(x); free(w);
    return check_report("test_elementwise");
}
