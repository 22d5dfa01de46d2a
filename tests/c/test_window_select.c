// test_window_select.c - ws_select_top and ws_rank against a brute-force rank: entry j is
// kept when fewer than k entries outrank it (higher score, or an equal score at a lower
// index; NaN lowest, -0 equal to +0). Covers the few-drops path decode steps take
// (n - k <= 4) and the radix path, with ties, NaNs, signed zeros, subnormals and scores that
// share their high bits, and checks the kept indices come out ascending.
#include <math.h>
#include <stdlib.h>

#include "check.h"
#include "kv/policies/common/window-scores.h"

#define MAX_N 3000

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

// above[j] = how many entries outrank j: its place in the rank.
static void brute_rank(const float *s, int n, int *above) {
    for (int j = 0; j < n; j++) {
        above[j] = 0;
        for (int i = 0; i < n; i++) above[j] += i != j && outranks(s[i], i, s[j], j);
    }
}

static void check_select(const float *s, const int *above, int n, int k) {
    static int64_t idx[MAX_N];
    int64_t got = -1;
    CHECK(ws_select_top(s, n, k, idx, &got) == PYKV_OK);
    CHECK(got == k);
    int m = 0;
    for (int j = 0; j < n; j++)
        if (above[j] < k) {
            CHECK(m < got && idx[m] == j);
            m++;
        }
    CHECK(m == k);
}

static void check_rank(const float *s, const int *above, int n) {
    static int32_t order[MAX_N];
    CHECK(ws_rank(s, n, order) == PYKV_OK);
    for (int r = 0; r < n; r++) CHECK(order[r] >= 0 && order[r] < n && above[order[r]] == r);
}

static float score(int kind) {
    const int r = next_int(20);
    switch (kind) {
    case 0:   // many ties, NaN and -inf
        return r == 0 ? NAN : r == 1 ? -INFINITY : (float)next_int(6);
    case 1:   // signed zeros, subnormals and their negatives
        return r < 4 ? 0.0f : r < 8 ? -0.0f : r < 12 ? 1e-40f * (float)next_int(4) : -1e-40f * (float)next_int(4);
    default:  // attention-like: positive, nearly equal, sharing the high bits
        return 0.001f + 1e-9f * (float)next_int(1000);
    }
}

int main(void) {
    static float s[MAX_N];
    static int above[MAX_N];
    for (int trial = 0; trial < 400; trial++) {
        const int n = 1 + next_int(64), kind = trial % 3;
        for (int j = 0; j < n; j++) s[j] = score(kind);
        brute_rank(s, n, above);
        for (int drop = 0; drop <= 6 && drop <= n; drop++) check_select(s, above, n, n - drop);
        check_select(s, above, n, next_int(n + 1));
        check_rank(s, above, n);
    }
    for (int trial = 0; trial < 6; trial++) {   // long lists: every radix pass in play
        const int n = MAX_N - next_int(700), kind = trial % 3;
        for (int j = 0; j < n; j++) s[j] = score(kind);
        brute_rank(s, n, above);
        const int ks[] = { 1, 7, n / 3, n / 2, n - 5, n - 1 };
        for (int i = 0; i < 6; i++) check_select(s, above, n, ks[i]);
        check_rank(s, above, n);
    }
    return check_report("test_window_select");
}
