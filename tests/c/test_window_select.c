// test_window_select.c - ws_select_top against a brute-force rank: entry j is kept when fewer
// than k entries outrank it (higher score, or an equal score at a lower index; NaN lowest).
// Covers the few-drops path decode steps take (n - k <= 4) and the sorting path, with ties
// and NaNs, and checks the kept indices come out ascending.
#include <math.h>
#include <stdlib.h>

#include "check.h"
#include "kv/policies/common/window-scores.h"

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static int next_int(int n) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (int)(rng % (uint64_t)n);
}

static int outranks(float a, int ia, float b, int ib) {
    if (isnan(a)) a = -INFINITY;
    if (isnan(b)) b = -INFINITY;
    return a > b || (a == b && ia < ib);
}

static void check_case(const float *s, int n, int k) {
    int64_t idx[64], got = -1;
    CHECK(ws_select_top(s, n, k, idx, &got) == PYKV_OK);
    CHECK(got == k);
    int m = 0;
    for (int j = 0; j < n; j++) {
        int above = 0;
        for (int i = 0; i < n; i++) above += i != j && outranks(s[i], i, s[j], j);
        if (above < k) {
            CHECK(m < got && idx[m] == j);
            m++;
        }
    }
    CHECK(m == k);
}

int main(void) {
    float s[64];
    for (int trial = 0; trial < 400; trial++) {
        const int n = 1 + next_int(64);
        for (int j = 0; j < n; j++) {
            const int r = next_int(20);
            s[j] = r == 0 ? NAN : r == 1 ? -INFINITY : (float)next_int(6);   // many ties
        }
        for (int drop = 0; drop <= 6 && drop <= n; drop++) check_case(s, n, n - drop);
        check_case(s, n, next_int(n + 1));
    }
    return check_report("test_window_select");
}
