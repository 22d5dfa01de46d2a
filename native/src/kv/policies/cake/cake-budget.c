// cake-budget.c - proportional, capped split of a budget over layers (see cake-budget.h).
#include "kv/policies/cake/cake-budget.h"
#include "core/error.h"

#include <math.h>
#include <stdlib.h>

// Water-filling into x[n]; w[n] are linear weights (>= 0).
static void water_fill(int n, const double *w, const int64_t *cap, int64_t total, unsigned char *capped, double *x) {
    for (int l = 0; l < n; l++) { capped[l] = 0; x[l] = 0.0; }
    for (;;) {
        double rem = (double)total, wsum = 0.0;
        int n_active = 0;
        for (int l = 0; l < n; l++) {
            if (capped[l]) rem -= (double)cap[l];
            else { wsum += w[l]; n_active++; }
        }
        if (n_active == 0) return;
        const int equal = !(wsum > 0.0);   // every remaining weight is zero: split evenly
        const double lambda = rem / (equal ? (double)n_active : wsum);
        int newly = 0;
        for (int l = 0; l < n; l++) {
            if (capped[l]) continue;
            const double xl = lambda * (equal ? 1.0 : w[l]);
            if (xl >= (double)cap[l]) { capped[l] = 1; x[l] = (double)cap[l]; newly = 1; }
        }
        if (newly) continue;
        for (int l = 0; l < n; l++)
            if (!capped[l]) x[l] = lambda * (equal ? 1.0 : w[l]);
        return;
    }
}

pykv_status cake_share(int n, const double *logw, const int64_t *cap, int64_t total,
                       enum cake_share_mode mode, int64_t *out) {
    if (n <= 0) return PYKV_OK;
    double *w = malloc((size_t)n * sizeof(double)), *x = malloc((size_t)n * sizeof(double));
    unsigned char *capped = malloc((size_t)n);
    if (!w || !x || !capped) {
        free(w); free(x); free(capped);
        return pykv_error(PYKV_ERR_NOMEM, "out of memory splitting the KV budget over layers");
    }
    double mx = -INFINITY;
    for (int l = 0; l < n; l++) if (logw[l] > mx) mx = logw[l];
    for (int l = 0; l < n; l++) w[l] = (isfinite(mx) && logw[l] > -INFINITY) ? exp(logw[l] - mx) : 0.0;
    if (total < 0) total = 0;
    water_fill(n, w, cap, total, capped, x);

    int64_t cap_sum = 0, sum = 0;
    for (int l = 0; l < n; l++) {
        cap_sum += cap[l];
        int64_t b;
        if (mode == CAKE_SHARE_BOUND) b = (int64_t)floor(x[l] * (1.0 + 1e-9)) + 1;
        else b = (int64_t)floor(x[l]);
        if (b > cap[l]) b = cap[l];
        if (b < 0) b = 0;
        out[l] = b;
        sum += b;
    }
    if (mode == CAKE_SHARE_FINAL) {
        int64_t left = (total < cap_sum ? total : cap_sum) - sum;
        while (left > 0) {   // largest remainder, one unit per layer and pass
            int best = -1;
            double best_f = -1.0;
            for (int l = 0; l < n; l++) {
                const double f = x[l] - floor(x[l]);
                if (out[l] == (int64_t)floor(x[l]) && out[l] < cap[l] && f > best_f + 1e-9) { best = l; best_f = f; }
            }
            if (best < 0) {   // rounding left units nobody can take by fraction: lowest layer with room
                for (int l = 0; l < n && best < 0; l++) if (out[l] < cap[l]) best = l;
                if (best < 0) break;
            }
            out[best]++;
            left--;
        }
    }
    free(w); free(x); free(capped);
    return PYKV_OK;
}
