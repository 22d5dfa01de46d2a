// test_ems_step.c - EMS's per-list scans of a decode step (ems-step.c) against the rules
// written out here: the step's GQA-mean attention into s_Glo and s_Loc_cur (s_Loc_cur rolled
// into s_Loc_past when asked), the sums over the list with four double partials (entry j
// into partial j % 4), the weakest centre (smallest max(a s_Glo, s_Loc), ties -> lower
// position) and the most similar centre (largest redundancy other than the weakest, ties ->
// lower position). Both the SIMD path and the scalar path must give the rules' results bit
// for bit, on lists of every length around the vector width, with ties, signed zeros,
// infinities and NaNs.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kv/policies/ems/ems.h"

enum { NMAX = 300, GMAX = 5 };

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static uint32_t next_u32(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}
static float next_unit(void) { return (float)(next_u32() % 1000000) / 1e6f; }

// A score drawn from few values, so that ties occur, now and then a signed zero.
static float score(int coarse) {
    if (next_u32() % 17 == 0) return next_u32() % 2 ? 0.0f : -0.0f;
    return coarse ? (float)(next_u32() % 5) * 0.125f : next_unit();
}

static void fill_list(struct ems_list *s, int32_t n, int coarse) {
    s->n = 0;
    CHECK(ems_list_track(s, n) == PYKV_OK);
    for (int32_t j = 0; j < n; j++) {
        s->glo[j] = score(coarse);
        s->lp[j] = score(coarse);
        s->lc[j] = score(coarse);
    }
}

static int same_bits_f(const float *a, const float *b, int32_t n) { return memcmp(a, b, (size_t)n * sizeof(float)) == 0; }
static int same_bits_d(double a, double b) { return memcmp(&a, &b, sizeof(double)) == 0; }

// The rule, scalar, in this file's own words.
static void rule_scores(struct ems_list *s, const float *rows, size_t stride, int G, int roll, double *sum_glo,
                        double *sum_loc) {
    double sg[4] = { 0 }, sl[4] = { 0 };
    for (int32_t j = 0; j < s->n; j++) {
        float a = 0.0f;
        for (int r = 0; r < G; r++) a += rows[r * stride + j];
        a /= (float)G;
        s->glo[j] += a;
        s->lc[j] += a;
        if (roll) {
            s->lp[j] = s->lc[j];
            s->lc[j] = 0.0f;
        }
        sg[j % 4] += s->glo[j];
        sl[j % 4] += s->lp[j] + s->lc[j];
    }
    *sum_glo = (sg[0] + sg[1]) + (sg[2] + sg[3]);
    *sum_loc = (sl[0] + sl[1]) + (sl[2] + sl[3]);
}

static int32_t rule_weakest(const struct ems_list *s, const int32_t *pos, int32_t nc, float a) {
    int32_t weak = 0;
    float best = 0.0f;
    for (int32_t j = 0; j < nc; j++) {
        const float x = a * s->glo[j], loc = s->lp[j] + s->lc[j], gl = x > loc ? x : loc;
        if (j == 0 || gl < best || (gl == best && pos[j] < pos[weak])) {
            weak = j;
            best = gl;
        }
    }
    return weak;
}

static void check_scores(int32_t n, int G, int roll) {
    static float rows[GMAX * NMAX];
    const size_t stride = NMAX;
    for (int i = 0; i < G * NMAX; i++) rows[i] = next_unit() * next_unit();
    struct ems_list want = { 0 }, got = { 0 };
    fill_list(&want, n, 0);
    CHECK(ems_list_track(&got, n) == PYKV_OK);
    for (int scalar = 0; scalar < 2; scalar++) {
        memcpy(got.glo, want.glo, (size_t)n * sizeof(float));
        memcpy(got.lp, want.lp, (size_t)n * sizeof(float));
        memcpy(got.lc, want.lc, (size_t)n * sizeof(float));
        struct ems_list ref = want;   // the rule works on copies of the same arrays
        float glo[NMAX], lp[NMAX], lc[NMAX];
        memcpy(glo, want.glo, (size_t)n * sizeof(float));
        memcpy(lp, want.lp, (size_t)n * sizeof(float));
        memcpy(lc, want.lc, (size_t)n * sizeof(float));
        ref.glo = glo; ref.lp = lp; ref.lc = lc;
        double rg, rl, gg, gl;
        rule_scores(&ref, rows, stride, G, roll, &rg, &rl);
        ems_step_force_scalar(scalar);
        ems_step_scores(&got, rows, stride, G, roll, &gg, &gl);
        CHECK(same_bits_f(got.glo, glo, n) && same_bits_f(got.lp, lp, n) && same_bits_f(got.lc, lc, n));
        CHECK(same_bits_d(gg, rg) && same_bits_d(gl, rl));
    }
    ems_step_force_scalar(0);
    ems_list_free(&want);
    ems_list_free(&got);
}

static void check_weakest(int32_t nc, int coarse, int with_nan) {
    struct ems_list s = { 0 };
    fill_list(&s, nc, coarse);
    int32_t pos[NMAX];
    for (int32_t j = 0; j < nc; j++) pos[j] = (int32_t)(next_u32() % 100000);   // any order, as after decode drops
    if (with_nan && nc > 0) s.lc[next_u32() % (uint32_t)nc] = NAN;
    const float a = coarse ? 0.5f : 0.25f + next_unit();
    const int32_t want = rule_weakest(&s, pos, nc, a);
    for (int scalar = 0; scalar < 2; scalar++) {
        ems_step_force_scalar(scalar);
        CHECK(ems_weakest_centre(&s, pos, nc, a) == want);
    }
    ems_step_force_scalar(0);
    ems_list_free(&s);
}

static int32_t rule_most_similar(const float *r, const int32_t *pos, int32_t nc, int32_t weak) {
    int32_t best = -1;
    for (int32_t c = 0; c < nc; c++)
        if (c != weak && (best < 0 || r[c] > r[best] || (r[c] == r[best] && pos[c] < pos[best]))) best = c;
    return best;
}

// Redundancies as ems_redundancy_all leaves them: coarse values for ties, -inf now and then,
// the weakest centre's own (often the largest) among them, and a NaN when asked.
static void check_most_similar(int32_t nc, int with_nan) {
    float r[NMAX];
    int32_t pos[NMAX];
    for (int32_t c = 0; c < nc; c++) {
        const uint32_t k = next_u32() % 11;
        r[c] = k == 0 ? -INFINITY : k == 1 ? -0.0f : (float)(int)(next_u32() % 9) * 0.125f - 0.5f;
        pos[c] = (int32_t)(next_u32() % 100000);
    }
    const int32_t weak = (int32_t)(next_u32() % (uint32_t)nc);
    if (next_u32() % 2) r[weak] = 2.0f;   // the entry itself is never its own most similar
    if (with_nan) r[next_u32() % (uint32_t)nc] = NAN;
    const int32_t want = rule_most_similar(r, pos, nc, weak);
    for (int scalar = 0; scalar < 2; scalar++) {
        ems_step_force_scalar(scalar);
        CHECK(ems_most_similar_pick(r, pos, nc, weak) == want);
    }
    ems_step_force_scalar(0);
}

int main(void) {
    for (int32_t n = 1; n <= 70; n++)
        for (int G = 1; G <= GMAX; G += 2)
            for (int roll = 0; roll < 2; roll++) check_scores(n, G, roll);
    for (int trial = 0; trial < 20; trial++) check_scores(200 + (int32_t)(next_u32() % 100), 3, trial % 2);
    for (int32_t nc = 1; nc <= 70; nc++)
        for (int trial = 0; trial < 6; trial++) check_weakest(nc, trial % 2, trial == 5);
    for (int trial = 0; trial < 200; trial++) check_weakest(1 + (int32_t)(next_u32() % (NMAX - 1)), trial % 2, trial % 9 == 0);
    for (int32_t nc = 1; nc <= 70; nc++)
        for (int trial = 0; trial < 6; trial++) check_most_similar(nc, trial == 5);
    for (int trial = 0; trial < 200; trial++) check_most_similar(1 + (int32_t)(next_u32() % (NMAX - 1)), trial % 9 == 0);
    return check_report("test_ems_step");
}
