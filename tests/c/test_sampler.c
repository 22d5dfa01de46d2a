// test_sampler.c - the sampling chain: parameter checks, greedy, partial selection, repeat,
// frequency and presence penalties, logit bias, filters and seeded reproducibility. (Distributions are checked in Python.)
#include "check.h"
#include "pykv.h"
#include "sample/sampler.h"

#include <stdlib.h>
#include <string.h>

static pykv_sampler *make(float temp, int32_t top_k, float top_p, float min_p, float pen, int32_t last_n,
                          uint32_t seed) {
    struct pykv_sampler_params p;
    pykv_sampler_default_params(&p);
    p.temperature = temp;
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    p.repeat_penalty = pen;
    p.repeat_last_n = last_n;
    p.seed = seed;
    pykv_sampler *s = NULL;
    CHECK(pykv_sampler_init(&p, &s) == PYKV_OK);
    return s;
}

static void test_defaults(void) {
    struct pykv_sampler_params p;
    pykv_sampler_default_params(&p);
    CHECK(p.struct_size == sizeof(p));
    CHECK_NEAR(p.temperature, 0.8, 1e-7);
    CHECK(p.top_k == 40);
    CHECK_NEAR(p.top_p, 0.95, 1e-7);
    CHECK_NEAR(p.min_p, 0.05, 1e-7);
    CHECK_NEAR(p.repeat_penalty, 1.0, 0);
    CHECK(p.repeat_last_n == 64);
    CHECK(p.frequency_penalty == 0.0f && p.presence_penalty == 0.0f);
    CHECK(p.seed == (uint32_t)PYKV_DEFAULT_SEED);
    CHECK(p.mirostat == 0);
    CHECK_NEAR(p.mirostat_tau, 5.0, 0);
    CHECK_NEAR(p.mirostat_eta, 0.1, 1e-7);
}

static void expect_bad_params(struct pykv_sampler_params p, const char *needle) {
    pykv_sampler *s = (pykv_sampler *)0x1;
    CHECK(pykv_sampler_init(&p, &s) == PYKV_ERR_INVALID_ARG);
    CHECK(s == NULL);
    CHECK(strstr(pykv_last_error(), needle) != NULL);
}

static void test_invalid_params(void) {
    struct pykv_sampler_params d, p;
    pykv_sampler_default_params(&d);
    p = d; p.top_p = 0.0f;          expect_bad_params(p, "top_p");
    p = d; p.top_p = 1.5f;          expect_bad_params(p, "top_p");
    p = d; p.top_p = NAN;           expect_bad_params(p, "top_p");
    p = d; p.min_p = -0.1f;         expect_bad_params(p, "min_p");
    p = d; p.min_p = 1.01f;         expect_bad_params(p, "min_p");
    p = d; p.temperature = NAN;     expect_bad_params(p, "temperature");
    p = d; p.temperature = INFINITY; expect_bad_params(p, "temperature");
    p = d; p.top_k = -1;            expect_bad_params(p, "top_k");
    p = d; p.repeat_penalty = 0.0f; expect_bad_params(p, "repeat_penalty");
    p = d; p.repeat_penalty = NAN;  expect_bad_params(p, "repeat_penalty");
    p = d; p.repeat_last_n = -2;    expect_bad_params(p, "repeat_last_n");
    p = d; p.frequency_penalty = NAN;      expect_bad_params(p, "frequency_penalty");
    p = d; p.presence_penalty = -INFINITY; expect_bad_params(p, "presence_penalty");
    p = d; p.struct_size = 8;       expect_bad_params(p, "struct_size");
    CHECK(pykv_sampler_init(NULL, NULL) == PYKV_ERR_INVALID_ARG);
    pykv_sampler *s = NULL;
    CHECK(pykv_sampler_init(NULL, &s) == PYKV_ERR_INVALID_ARG);

    // Negative temperature is greedy, as in llama.cpp; it is accepted.
    s = make(-1.0f, 40, 0.95f, 0.05f, 1.0f, 64, 1);
    float logits[4] = { 0.0f, 3.0f, 1.0f, 2.0f };
    pykv_token t = -1;
    CHECK(pykv_sampler_sample(s, logits, 4, &t) == PYKV_OK && t == 1);

    // Bad sample arguments.
    CHECK(pykv_sampler_sample(s, NULL, 4, &t) == PYKV_ERR_INVALID_ARG);
    CHECK(strstr(pykv_last_error(), "logits") != NULL);
    CHECK(pykv_sampler_sample(s, logits, 0, &t) == PYKV_ERR_INVALID_ARG);
    CHECK(strstr(pykv_last_error(), "n_vocab") != NULL);
    CHECK(pykv_sampler_sample(s, logits, 4, NULL) == PYKV_ERR_INVALID_ARG);
    CHECK(pykv_sampler_sample(NULL, logits, 4, &t) == PYKV_ERR_INVALID_ARG);
    float bad[3] = { 0.0f, NAN, 1.0f };
    CHECK(pykv_sampler_sample(s, bad, 3, &t) == PYKV_ERR_INVALID_ARG);
    CHECK(strstr(pykv_last_error(), "token 1") != NULL);
    float all_masked[2] = { -INFINITY, -INFINITY };
    CHECK(pykv_sampler_sample(s, all_masked, 2, &t) == PYKV_ERR_INVALID_ARG);
    pykv_sampler_free(s);
    pykv_sampler_free(NULL);       // no-op
    pykv_sampler_accept(NULL, 3);  // no-op
    pykv_sampler_reset(NULL);      // no-op
}

static void test_greedy(void) {
    pykv_sampler *s = make(0.0f, 40, 0.95f, 0.05f, 1.0f, 64, 1);
    float logits[6] = { 1.0f, 5.0f, -2.0f, 5.0f, 4.0f, -INFINITY };
    pykv_token t = -1;
    CHECK(pykv_sampler_sample(s, logits, 6, &t) == PYKV_OK);
    CHECK(t == 1);  // tie between 1 and 3: the lower id
    CHECK(logits[1] == 5.0f && logits[3] == 5.0f);  // input untouched
    pykv_sampler_free(s);
}

static int cmp_desc(const void *pa, const void *pb) {
    const struct sampler_cand *a = pa, *b = pb;
    return sampler_cand_before(a, b) ? -1 : sampler_cand_before(b, a) ? 1 : 0;
}

static void test_select_top(void) {
    enum { N = 5000 };
    struct sampler_cand *c = malloc(N * sizeof(*c));
    struct sampler_cand *ref = malloc(N * sizeof(*ref));
    srand(7);
    const int32_t ks[] = { 1, 2, 40, 999, N - 1, N };
    for (int round = 0; round < 3; round++) {
        for (size_t j = 0; j < sizeof(ks) / sizeof(ks[0]); j++) {
            for (int32_t i = 0; i < N; i++) {
                // round 1: many ties; round 2: already sorted ascending (bad for naive pivots)
                float v = round == 0 ? (float)rand() / (float)RAND_MAX
                        : round == 1 ? (float)(rand() % 7) : (float)i;
                c[i].logit = ref[i].logit = v;
                c[i].id = ref[i].id = i;
            }
            qsort(ref, N, sizeof(*ref), cmp_desc);
            sampler_select_top(c, N, ks[j]);
            int ok = 1;
            for (int32_t i = 0; i < ks[j]; i++) ok &= c[i].id == ref[i].id;
            CHECK(ok);
        }
    }
    free(c);
    free(ref);
}

static void test_top_k_one_is_greedy(void) {
    pykv_sampler *s = make(1.5f, 1, 1.0f, 0.0f, 1.0f, 64, 42);
    float logits[5] = { 0.1f, 0.3f, 0.2f, 0.29f, -1.0f };
    for (int i = 0; i < 50; i++) {
        pykv_token t = -1;
        CHECK(pykv_sampler_sample(s, logits, 5, &t) == PYKV_OK && t == 1);
    }
    pykv_sampler_free(s);
}

static void test_filters_exclude(void) {
    // Probabilities before temperature: softmax([3, 2, 0, -5]) ~ [0.705, 0.259, 0.035, 0.0002].
    float logits[4] = { 3.0f, 2.0f, 0.0f, -5.0f };
    int seen[4];
    pykv_token t;

    // top_p = 0.9: the smallest prefix reaching 0.9 is tokens {0, 1} (0.964).
    pykv_sampler *s = make(1.0f, 0, 0.9f, 0.0f, 1.0f, 64, 3);
    memset(seen, 0, sizeof(seen));
    for (int i = 0; i < 2000; i++) { CHECK(pykv_sampler_sample(s, logits, 4, &t) == PYKV_OK); seen[t]++; }
    CHECK(seen[0] > 0 && seen[1] > 0 && seen[2] == 0 && seen[3] == 0);
    pykv_sampler_free(s);

    // min_p = 0.1: keep p >= 0.1 * p_max, i.e. logit >= 3 + ln(0.1) = 0.697: tokens {0, 1}.
    s = make(5.0f, 0, 1.0f, 0.1f, 1.0f, 64, 3);
    memset(seen, 0, sizeof(seen));
    for (int i = 0; i < 2000; i++) { CHECK(pykv_sampler_sample(s, logits, 4, &t) == PYKV_OK); seen[t]++; }
    CHECK(seen[0] > 0 && seen[1] > 0 && seen[2] == 0 && seen[3] == 0);
    pykv_sampler_free(s);

    // No filters and a high temperature: every token shows up.
    s = make(100.0f, 0, 1.0f, 0.0f, 1.0f, 64, 3);
    memset(seen, 0, sizeof(seen));
    for (int i = 0; i < 2000; i++) { CHECK(pykv_sampler_sample(s, logits, 4, &t) == PYKV_OK); seen[t]++; }
    CHECK(seen[0] > 0 && seen[1] > 0 && seen[2] > 0 && seen[3] > 0);
    pykv_sampler_free(s);
}

static void test_repeat_penalty(void) {
    // Greedy picks 0; after accepting 0 with penalty 2, logit 2 -> 1 and token 1 (1.5) wins.
    float logits[3] = { 2.0f, 1.5f, -1.0f };
    pykv_sampler *s = make(0.0f, 40, 0.95f, 0.05f, 2.0f, 2, 1);
    pykv_token t;
    CHECK(pykv_sampler_sample(s, logits, 3, &t) == PYKV_OK && t == 0);
    pykv_sampler_accept(s, 0);
    pykv_sampler_accept(s, 0);  // repeated tokens are penalised once
    CHECK(pykv_sampler_sample(s, logits, 3, &t) == PYKV_OK && t == 1);
    // Window of 2: after two more tokens, 0 falls out of it and wins again.
    pykv_sampler_accept(s, 2);
    pykv_sampler_accept(s, 2);
    CHECK(pykv_sampler_sample(s, logits, 3, &t) == PYKV_OK && t == 0);
    // A negative logit is multiplied: -0.5 * 2 = -1 loses to -0.8.
    float neg[2] = { -0.5f, -0.8f };
    pykv_sampler_accept(s, 0);
    pykv_sampler_accept(s, 0);
    CHECK(pykv_sampler_sample(s, neg, 2, &t) == PYKV_OK && t == 1);
    // reset forgets the history; out-of-range tokens are ignored.
    pykv_sampler_reset(s);
    pykv_sampler_accept(s, 100000);
    CHECK(pykv_sampler_sample(s, logits, 3, &t) == PYKV_OK && t == 0);
    pykv_sampler_free(s);

    // repeat_last_n = -1 remembers every token.
    s = make(0.0f, 40, 0.95f, 0.05f, 2.0f, -1, 1);
    pykv_sampler_accept(s, 0);
    for (int i = 0; i < 1000; i++) pykv_sampler_accept(s, 2);
    CHECK(pykv_sampler_sample(s, logits, 3, &t) == PYKV_OK && t == 1);
    pykv_sampler_free(s);

    // repeat_last_n = 0 turns the penalty off.
    s = make(0.0f, 40, 0.95f, 0.05f, 2.0f, 0, 1);
    pykv_sampler_accept(s, 0);
    CHECK(pykv_sampler_sample(s, logits, 3, &t) == PYKV_OK && t == 0);
    pykv_sampler_free(s);
}

// Greedy picks show the arithmetic: logit - count * frequency - presence (after the repeat penalty).
static void test_frequency_presence(void) {
    struct pykv_sampler_params p;
    pykv_sampler_default_params(&p);
    p.temperature = 0.0f;
    p.frequency_penalty = 0.5f;
    pykv_sampler *s = NULL;
    CHECK(pykv_sampler_init(&p, &s) == PYKV_OK);
    float logits[3] = { 2.0f, 1.2f, 0.0f };
    pykv_token t = -1;
    pykv_sampler_accept(s, 0);   // 2.0 - 0.5 = 1.5 still wins over 1.2
    CHECK(pykv_sampler_sample(s, logits, 3, &t) == PYKV_OK && t == 0);
    pykv_sampler_accept(s, 0);   // 2.0 - 1.0 = 1.0 loses
    CHECK(pykv_sampler_sample(s, logits, 3, &t) == PYKV_OK && t == 1);
    pykv_sampler_free(s);

    p.frequency_penalty = 0.0f;
    p.presence_penalty = 0.7f;   // once, however often: 2.0 - 0.7 = 1.3 > 1.2
    CHECK(pykv_sampler_init(&p, &s) == PYKV_OK);
    for (int i = 0; i < 5; i++) pykv_sampler_accept(s, 0);
    CHECK(pykv_sampler_sample(s, logits, 3, &t) == PYKV_OK && t == 0);
    pykv_sampler_free(s);

    p.repeat_penalty = 2.0f;     // 2.0 / 2 - 0.7 = 0.3 < 1.2; the repeat penalty comes first
    CHECK(pykv_sampler_init(&p, &s) == PYKV_OK);
    pykv_sampler_accept(s, 0);
    CHECK(pykv_sampler_sample(s, logits, 3, &t) == PYKV_OK && t == 1);
    pykv_sampler_free(s);

    p.repeat_penalty = 1.0f;     // a negative presence penalty favours the seen token
    p.presence_penalty = -1.5f;
    CHECK(pykv_sampler_init(&p, &s) == PYKV_OK);
    pykv_sampler_accept(s, 2);
    CHECK(pykv_sampler_sample(s, logits, 3, &t) == PYKV_OK && t == 0);   // 0 - (-1.5) = 1.5 < 2.0
    pykv_sampler_accept(s, 2);
    pykv_sampler_accept(s, 2);
    CHECK(pykv_sampler_sample(s, logits, 3, &t) == PYKV_OK && t == 0);   // still once
    pykv_sampler_free(s);
}

static void test_logit_bias(void) {
    pykv_sampler *s = make(0.0f, 40, 0.95f, 0.05f, 1.0f, 64, 1);
    float logits[4] = { 0.0f, 3.0f, 1.0f, 2.0f };
    pykv_token t = -1;
    pykv_token ban[1] = { 1 };
    float minus_inf[1] = { -INFINITY };
    CHECK(pykv_sampler_set_logit_bias(s, 1, ban, minus_inf) == PYKV_OK);
    CHECK(pykv_sampler_sample(s, logits, 4, &t) == PYKV_OK && t == 3);
    pykv_token up[2] = { 0, 1 };
    float plus[2] = { 2.5f, -0.5f };   // replaces the ban: 2.5 vs 2.5, the lower id wins the tie
    CHECK(pykv_sampler_set_logit_bias(s, 2, up, plus) == PYKV_OK);
    CHECK(pykv_sampler_sample(s, logits, 4, &t) == PYKV_OK && t == 0);
    CHECK(logits[0] == 0.0f && logits[1] == 3.0f);   // the caller's logits stay as they were
    CHECK(pykv_sampler_set_logit_bias(s, 0, NULL, NULL) == PYKV_OK);
    CHECK(pykv_sampler_sample(s, logits, 4, &t) == PYKV_OK && t == 1);

    // Bad entries are refused and leave the set as it was.
    pykv_token neg[1] = { -3 };
    float nan_bias[1] = { NAN }, inf_bias[1] = { INFINITY };
    CHECK(pykv_sampler_set_logit_bias(s, 1, neg, plus) == PYKV_ERR_INVALID_ARG);
    CHECK(strstr(pykv_last_error(), "-3") != NULL);
    CHECK(pykv_sampler_set_logit_bias(s, 1, up, nan_bias) == PYKV_ERR_INVALID_ARG);
    CHECK(pykv_sampler_set_logit_bias(s, 1, up, inf_bias) == PYKV_ERR_INVALID_ARG);
    CHECK(pykv_sampler_set_logit_bias(s, 1, NULL, plus) == PYKV_ERR_INVALID_ARG);
    CHECK(pykv_sampler_set_logit_bias(s, -1, up, plus) == PYKV_ERR_INVALID_ARG);
    CHECK(pykv_sampler_set_logit_bias(NULL, 0, NULL, NULL) == PYKV_ERR_INVALID_ARG);
    CHECK(pykv_sampler_sample(s, logits, 4, &t) == PYKV_OK && t == 1);

    // A token past the vocabulary is reported when sampling.
    pykv_token far[1] = { 4 };
    CHECK(pykv_sampler_set_logit_bias(s, 1, far, plus) == PYKV_OK);
    CHECK(pykv_sampler_sample(s, logits, 4, &t) == PYKV_ERR_INVALID_ARG && t == -1);
    CHECK(strstr(pykv_last_error(), "outside the vocabulary") != NULL);

    // Banning every token is an error, not a pick.
    pykv_token all[4] = { 0, 1, 2, 3 };
    float bans[4] = { -INFINITY, -INFINITY, -INFINITY, -INFINITY };
    CHECK(pykv_sampler_set_logit_bias(s, 4, all, bans) == PYKV_OK);
    CHECK(pykv_sampler_sample(s, logits, 4, &t) == PYKV_ERR_INVALID_ARG);
    CHECK(strstr(pykv_last_error(), "logit bias") != NULL);
    pykv_sampler_free(s);
}

static void test_seed_reproducible(void) {
    enum { V = 49152, STEPS = 64 };
    float *logits = malloc(V * sizeof(float));
    srand(11);
    for (int i = 0; i < V; i++) logits[i] = 4.0f * (float)rand() / (float)RAND_MAX;
    pykv_token a[STEPS], b[STEPS], c[STEPS];
    pykv_sampler *s1 = make(1.0f, 40, 0.95f, 0.05f, 1.1f, 64, 1234);
    pykv_sampler *s2 = make(1.0f, 40, 0.95f, 0.05f, 1.1f, 64, 1234);
    pykv_sampler *s3 = make(1.0f, 40, 0.95f, 0.05f, 1.1f, 64, 1235);
    for (int i = 0; i < STEPS; i++) {
        CHECK(pykv_sampler_sample(s1, logits, V, &a[i]) == PYKV_OK);
        CHECK(pykv_sampler_sample(s2, logits, V, &b[i]) == PYKV_OK);
        CHECK(pykv_sampler_sample(s3, logits, V, &c[i]) == PYKV_OK);
        pykv_sampler_accept(s1, a[i]);
        pykv_sampler_accept(s2, b[i]);
        pykv_sampler_accept(s3, c[i]);
    }
    CHECK(memcmp(a, b, sizeof(a)) == 0);
    CHECK(memcmp(a, c, sizeof(a)) != 0);
    // reset restarts the same stream.
    pykv_sampler_reset(s1);
    for (int i = 0; i < STEPS; i++) {
        CHECK(pykv_sampler_sample(s1, logits, V, &b[i]) == PYKV_OK);
        pykv_sampler_accept(s1, b[i]);
    }
    CHECK(memcmp(a, b, sizeof(a)) == 0);
    // A sampler follows a change of vocabulary size.
    pykv_token t;
    CHECK(pykv_sampler_sample(s1, logits, 10, &t) == PYKV_OK && t >= 0 && t < 10);
    pykv_sampler_free(s1);
    pykv_sampler_free(s2);
    pykv_sampler_free(s3);
    free(logits);
}

int main(void) {
    test_defaults();
    test_invalid_params();
    test_greedy();
    test_select_top();
    test_top_k_one_is_greedy();
    test_filters_exclude();
    test_repeat_penalty();
    test_frequency_presence();
    test_logit_bias();
    test_seed_reproducible();
    return check_report("test_sampler");
}
