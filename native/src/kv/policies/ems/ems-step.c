// ems-step.c - the scans of every list at every EMS decode step (ems-decode.c): the step's
// attention into the scores with the sums the mean alignment needs, the weakest centre, and
// the centre most similar to it.
// At depth they run over every list of every layer each step, so they have an AVX2 path; it
// gives the scalar path's results bit for bit (the same operations in the same order per
// entry, the same four double partial sums), which the C test checks.
#include "kv/policies/ems/ems.h"
#include "cpu/simd-avx2.h"

#include <math.h>

static int scalar_only;   // tests: the reference path on any CPU

void ems_step_force_scalar(int on) { scalar_only = on; }

void ems_rows_mean(const float *rows, size_t stride, int G, int32_t j, int32_t m, float *a) {
    for (int32_t i = 0; i < m; i++) a[i] = 0.0f;
    for (int r = 0; r < G; r++)
        for (int32_t i = 0; i < m; i++) a[i] += rows[r * stride + j + i];
    for (int32_t i = 0; i < m; i++) a[i] /= (float)G;
}

// Entries [j, n) the scalar way: partial sum j % 4 takes entry j.
static void step_scores_tail(struct ems_list *s, const float *rows, size_t stride, int G, int roll, int32_t j,
                             double *sg, double *sl) {
    enum { BLOCK = 64 };
    for (; j < s->n; j += BLOCK) {
        const int32_t m = s->n - j < BLOCK ? s->n - j : BLOCK;
        float a[BLOCK];
        ems_rows_mean(rows, stride, G, j, m, a);
        for (int32_t i = 0; i < m; i++) {
            const int32_t e = j + i;
            s->glo[e] += a[i];
            s->lc[e] += a[i];
            if (roll) {
                s->lp[e] = s->lc[e];
                s->lc[e] = 0.0f;
            }
            sg[e & 3] += s->glo[e];
            sl[e & 3] += s->lp[e] + s->lc[e];
        }
    }
}

static int32_t weakest_from(const struct ems_list *s, const int32_t *pos, int32_t j, int32_t nc, float a,
                            int32_t weak, float best) {
    for (; j < nc; j++) {
        const float x = a * s->glo[j], loc = s->lp[j] + s->lc[j], gl = x > loc ? x : loc;
        if (weak < 0 || gl < best || (gl == best && pos[j] < pos[weak])) {
            weak = j;
            best = gl;
        }
    }
    return weak;
}

static int32_t most_similar_from(const float *r, const int32_t *pos, int32_t j, int32_t nc, int32_t weak,
                                 int32_t best) {
    for (; j < nc; j++)
        if (j != weak && (best < 0 || r[j] > r[best] || (r[j] == r[best] && pos[j] < pos[best]))) best = j;
    return best;
}

#if defined(__x86_64__) || defined(__i386__)
// Eight entries at a time; the partial sums are the four double lanes of two vectors (lane k
// of the pair takes the entries j with j % 4 == k, as the scalar path's sg[j & 3]).
static AVX2_TGT int32_t step_scores_avx2(struct ems_list *s, const float *rows, size_t stride, int G, int roll,
                                         double *sg, double *sl) {
    const __m256 g = _mm256_set1_ps((float)G);
    __m256d g4 = _mm256_setzero_pd(), l4 = _mm256_setzero_pd();
    int32_t j = 0;
    for (; j + 8 <= s->n; j += 8) {
        __m256 a = _mm256_setzero_ps();
        for (int r = 0; r < G; r++) a = _mm256_add_ps(a, _mm256_loadu_ps(rows + r * stride + j));
        a = _mm256_div_ps(a, g);
        const __m256 glo = _mm256_add_ps(_mm256_loadu_ps(s->glo + j), a);
        __m256 lc = _mm256_add_ps(_mm256_loadu_ps(s->lc + j), a), lp;
        if (roll) {
            lp = lc;
            lc = _mm256_setzero_ps();
        } else {
            lp = _mm256_loadu_ps(s->lp + j);
        }
        _mm256_storeu_ps(s->glo + j, glo);
        _mm256_storeu_ps(s->lc + j, lc);
        _mm256_storeu_ps(s->lp + j, lp);
        const __m256 loc = _mm256_add_ps(lp, lc);
        g4 = _mm256_add_pd(g4, _mm256_cvtps_pd(_mm256_castps256_ps128(glo)));
        g4 = _mm256_add_pd(g4, _mm256_cvtps_pd(_mm256_extractf128_ps(glo, 1)));
        l4 = _mm256_add_pd(l4, _mm256_cvtps_pd(_mm256_castps256_ps128(loc)));
        l4 = _mm256_add_pd(l4, _mm256_cvtps_pd(_mm256_extractf128_ps(loc, 1)));
    }
    _mm256_storeu_pd(sg, g4);
    _mm256_storeu_pd(sl, l4);
    return j;
}

// The index of the largest v[j] of [0, n) other than j = skip, ties -> the lowest pos[j], as
// the scalar rule of most_similar_from; -1 when there is none, -2 when one of the vector part's
// v is not a number (the callers' scalar paths decide those; the tail takes the scalar rule,
// which already gives what the whole scalar pass would).
static AVX2_TGT int32_t argmax_avx2(const float *v, const int32_t *pos, int32_t n, int32_t skip) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 hi = ninf, bad = _mm256_setzero_ps();
    const int32_t n8 = n / 8 * 8;
    for (int32_t j = 0; j < n8; j += 8) {
        const __m256 x = _mm256_loadu_ps(v + j);
        const __m256 skipped = _mm256_castsi256_ps(_mm256_cmpeq_epi32(lane, _mm256_set1_epi32(skip - j)));
        hi = _mm256_max_ps(hi, _mm256_blendv_ps(x, ninf, skipped));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(bad)) return -2;
    const __m256 vtop = _mm256_set1_ps(hmax_ps(hi));
    int32_t best = -1;
    for (int32_t j = 0; j < n8; j += 8)   // the entries holding the maximum: the lowest position
        for (unsigned hit = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + j), vtop, _CMP_EQ_OQ));
             hit; hit &= hit - 1) {
            const int32_t i = j + __builtin_ctz(hit);
            if (i != skip && (best < 0 || pos[i] < pos[best])) best = i;
        }
    return most_similar_from(v, pos, n8, n, skip, best);
}

// The weakest centre as the largest -s_GL (negation is exact, so the order and the ties are
// those of the smallest s_GL), written into the list's scratch.
static AVX2_TGT int32_t weakest_avx2(const struct ems_list *s, const int32_t *pos, int32_t nc, float a) {
    const __m256 va = _mm256_set1_ps(a), zero = _mm256_setzero_ps();
    int32_t j = 0;
    for (; j + 8 <= nc; j += 8) {   // max(a s_Glo, s_Loc) as the scalar `x > loc ? x : loc`
        const __m256 x = _mm256_mul_ps(va, _mm256_loadu_ps(s->glo + j));
        const __m256 gl = _mm256_max_ps(x, _mm256_add_ps(_mm256_loadu_ps(s->lp + j), _mm256_loadu_ps(s->lc + j)));
        _mm256_storeu_ps(s->work + j, _mm256_sub_ps(zero, gl));
    }
    for (; j < nc; j++) {
        const float x = a * s->glo[j], loc = s->lp[j] + s->lc[j];
        s->work[j] = -(x > loc ? x : loc);
    }
    return argmax_avx2(s->work, pos, nc, -1);
}
#endif

void ems_step_scores(struct ems_list *s, const float *rows, size_t stride, int G, int roll, double *sum_glo,
                     double *sum_loc) {
    double sg[4] = { 0 }, sl[4] = { 0 };
    int32_t j = 0;
#if defined(__x86_64__) || defined(__i386__)
    if (!scalar_only && cpu_has_avx2()) j = step_scores_avx2(s, rows, stride, G, roll, sg, sl);
#endif
    step_scores_tail(s, rows, stride, G, roll, j, sg, sl);
    *sum_glo = (sg[0] + sg[1]) + (sg[2] + sg[3]);
    *sum_loc = (sl[0] + sl[1]) + (sl[2] + sl[3]);
}

int32_t ems_weakest_centre(const struct ems_list *s, const int32_t *pos, int32_t nc, float a) {
#if defined(__x86_64__) || defined(__i386__)
    if (!scalar_only && cpu_has_avx2()) {
        const int32_t weak = weakest_avx2(s, pos, nc, a);
        if (weak != -2) return weak;
    }
#endif
    return weakest_from(s, pos, 0, nc, a, -1, 0.0f);
}

int32_t ems_most_similar_pick(const float *r, const int32_t *pos, int32_t nc, int32_t weak) {
#if defined(__x86_64__) || defined(__i386__)
    if (!scalar_only && cpu_has_avx2()) {
        const int32_t best = argmax_avx2(r, pos, nc, weak);
        if (best != -2) return best;
    }
#endif
    return most_similar_from(r, pos, 0, nc, weak, -1);
}
