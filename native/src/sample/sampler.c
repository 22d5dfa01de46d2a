// sampler.c - the public sampling API: llama.cpp's default chain
//   logit bias -> penalties (repeat, frequency, presence)
//   -> (temperature <= 0: greedy) | top-k -> typical -> top-p -> min-p -> temperature -> softmax -> a seeded draw
//      | (mirostat 1 or 2) temperature -> Mirostat's truncation and draw (sampler-mirostat.c).
// Filters see the logits before temperature, as in llama.cpp's default sampler order. A
// grammar, when set, allows only its tokens before the penalties (grammar.c).
#include "sample/sampler.h"

#include "core/error.h"
#include "sample/grammar.h"
#include "pykv.h"
#include "core/rng.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct pykv_sampler {
    struct pykv_sampler_params params;
    struct pykv_rng rng;
    float mu;   // Mirostat's threshold (2 tau at the start)

    // Accepted tokens the repeat penalty looks at: a ring of the last repeat_last_n
    // (repeat_last_n == -1: every accepted token, in a growing array).
    pykv_token *history;
    int32_t     history_cap;
    int32_t     history_len;   // valid entries
    int32_t     history_head;  // next write position when used as a ring

    // Logit bias: n_bias (token, bias) pairs added before everything else.
    pykv_token *bias_tokens;
    float      *bias_values;
    int32_t     n_bias;

    pykv_grammar *grammar;   // borrowed; NULL: no grammar
    uint8_t      *allowed;   // its mask, n_scratch entries

    // Scratch sized to the vocabulary of the last call.
    struct sampler_cand *cand;
    struct sampler_cand *typical;   // typical_p's scratch (only when it is on)
    uint32_t            *mark;      // per-token stamp: count, then penalise, each distinct token once
    int32_t             *count;     // occurrences in the history (valid where mark is this call's)
    uint32_t             mark_epoch;
    int32_t              n_scratch;
};

void pykv_sampler_default_params(struct pykv_sampler_params *params) {
    if (!params) return;
    memset(params, 0, sizeof(*params));
    params->struct_size    = sizeof(*params);
    params->temperature    = 0.8f;
    params->top_k          = 40;
    params->top_p          = 0.95f;
    params->min_p          = 0.05f;
    params->repeat_penalty = 1.0f;
    params->repeat_last_n  = 64;
    params->frequency_penalty = 0.0f;
    params->presence_penalty  = 0.0f;
    params->seed           = (uint32_t)PYKV_DEFAULT_SEED;
    params->mirostat       = 0;
    params->mirostat_tau   = 5.0f;
    params->mirostat_eta   = 0.1f;
    params->typical_p      = 1.0f;
}

static pykv_status validate_params(const struct pykv_sampler_params *p) {
    if (p->struct_size != sizeof(*p)) {
        return pykv_error(PYKV_ERR_INVALID_ARG,
                          "sampler params: struct_size is %zu, expected %zu "
                          "(fill the struct with pykv_sampler_default_params first)",
                          p->struct_size, sizeof(*p));
    }
    // temperature <= 0 means greedy (llama.cpp treats a negative temperature the same way).
    if (isnan(p->temperature) || isinf(p->temperature)) {
        return pykv_error(PYKV_ERR_INVALID_ARG, "sampler params: temperature must be a finite number, got %g",
                          (double)p->temperature);
    }
    if (p->top_k < 0) {
        return pykv_error(PYKV_ERR_INVALID_ARG, "sampler params: top_k must be >= 0 (0 = off), got %d",
                          (int)p->top_k);
    }
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f)) {
        return pykv_error(PYKV_ERR_INVALID_ARG, "sampler params: top_p must be in (0, 1] (1 = off), got %g",
                          (double)p->top_p);
    }
    if (!(p->typical_p > 0.0f && p->typical_p <= 1.0f)) {
        return pykv_error(PYKV_ERR_INVALID_ARG, "sampler params: typical_p must be in (0, 1] (1 = off), got %g",
                          (double)p->typical_p);
    }
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f)) {
        return pykv_error(PYKV_ERR_INVALID_ARG, "sampler params: min_p must be in [0, 1] (0 = off), got %g",
                          (double)p->min_p);
    }
    if (!(p->repeat_penalty > 0.0f) || isinf(p->repeat_penalty)) {
        return pykv_error(PYKV_ERR_INVALID_ARG,
                          "sampler params: repeat_penalty must be a finite number > 0 (1 = off), got %g",
                          (double)p->repeat_penalty);
    }
    if (!isfinite(p->frequency_penalty) || !isfinite(p->presence_penalty)) {
        return pykv_error(PYKV_ERR_INVALID_ARG,
                          "sampler params: frequency_penalty and presence_penalty must be finite numbers "
                          "(0 = off), got %g and %g", (double)p->frequency_penalty, (double)p->presence_penalty);
    }
    if (p->repeat_last_n < -1) {
        return pykv_error(PYKV_ERR_INVALID_ARG,
                          "sampler params: repeat_last_n must be >= -1 (0 = off, -1 = all tokens), got %d",
                          (int)p->repeat_last_n);
    }
    if (p->mirostat < 0 || p->mirostat > 2) {
        return pykv_error(PYKV_ERR_INVALID_ARG, "sampler params: mirostat must be 0 (off), 1 or 2, got %d",
                          (int)p->mirostat);
    }
    if (!(p->mirostat_tau > 0.0f) || isinf(p->mirostat_tau) || !(p->mirostat_eta >= 0.0f) ||
        isinf(p->mirostat_eta)) {
        return pykv_error(PYKV_ERR_INVALID_ARG, "sampler params: mirostat_tau must be a finite number > 0 and "
                          "mirostat_eta one >= 0, got %g and %g", (double)p->mirostat_tau, (double)p->mirostat_eta);
    }
    return PYKV_OK;
}

pykv_status pykv_sampler_init(const struct pykv_sampler_params *params, pykv_sampler **out) {
    if (!out) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_sampler_init: out is NULL");
    *out = NULL;
    if (!params) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_sampler_init: params is NULL");
    PYKV_TRY(validate_params(params));

    pykv_sampler *s = calloc(1, sizeof(*s));
    if (!s) return pykv_error(PYKV_ERR_NOMEM, "pykv_sampler_init: out of memory");
    s->params = *params;
    if (params->repeat_last_n > 0) {
        s->history_cap = params->repeat_last_n;
        s->history = malloc((size_t)s->history_cap * sizeof(*s->history));
        if (!s->history) {
            free(s);
            return pykv_error(PYKV_ERR_NOMEM, "pykv_sampler_init: out of memory for %d history tokens",
                              (int)params->repeat_last_n);
        }
    }
    pykv_sampler_reset(s);
    *out = s;
    return PYKV_OK;
}

void pykv_sampler_free(pykv_sampler *smpl) {
    if (!smpl) return;
    free(smpl->history);
    free(smpl->bias_tokens);
    free(smpl->bias_values);
    free(smpl->cand);
    free(smpl->typical);
    free(smpl->mark);
    free(smpl->count);
    free(smpl->allowed);
    free(smpl);
}

void pykv_sampler_reset(pykv_sampler *smpl) {
    if (!smpl) return;
    smpl->history_len = 0;
    smpl->history_head = 0;
    smpl->mu = 2.0f * smpl->params.mirostat_tau;
    uint64_t seed = smpl->params.seed == (uint32_t)PYKV_DEFAULT_SEED ? rng_entropy_seed()
                                                                     : (uint64_t)smpl->params.seed;
    rng_seed(&smpl->rng, seed);
}

void pykv_sampler_accept(pykv_sampler *smpl, pykv_token token) {
    if (!smpl || token < 0) return;
    int32_t last_n = smpl->params.repeat_last_n;
    if (last_n == 0) return;
    if (last_n > 0) {
        smpl->history[smpl->history_head] = token;
        smpl->history_head = (smpl->history_head + 1) % smpl->history_cap;
        if (smpl->history_len < smpl->history_cap) smpl->history_len++;
        return;
    }
    // -1: keep everything; grow by doubling. Out of memory just stops recording.
    if (smpl->history_len == smpl->history_cap) {
        int32_t cap = smpl->history_cap ? smpl->history_cap * 2 : 256;
        pykv_token *h = realloc(smpl->history, (size_t)cap * sizeof(*h));
        if (!h) return;
        smpl->history = h;
        smpl->history_cap = cap;
    }
    smpl->history[smpl->history_len++] = token;
}

pykv_status pykv_sampler_set_logit_bias(pykv_sampler *smpl, int32_t n, const pykv_token *tokens,
                                        const float *bias) {
    if (!smpl) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_sampler_set_logit_bias: sampler is NULL");
    if (n < 0 || (n > 0 && (!tokens || !bias))) {
        return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_sampler_set_logit_bias: %d entries with %s arrays",
                          (int)n, n < 0 ? "a negative count of" : "NULL");
    }
    for (int32_t i = 0; i < n; i++) {
        if (tokens[i] < 0) {
            return pykv_error(PYKV_ERR_INVALID_ARG, "logit bias: token id %d is negative", (int)tokens[i]);
        }
        if (isnan(bias[i]) || (isinf(bias[i]) && bias[i] > 0)) {
            return pykv_error(PYKV_ERR_INVALID_ARG,
                              "logit bias of token %d is %g: it must be a finite number or -inf",
                              (int)tokens[i], (double)bias[i]);
        }
    }
    pykv_token *t = n ? malloc((size_t)n * sizeof(*t)) : NULL;
    float      *b = n ? malloc((size_t)n * sizeof(*b)) : NULL;
    if (n && (!t || !b)) {
        free(t);
        free(b);
        return pykv_error(PYKV_ERR_NOMEM, "pykv_sampler_set_logit_bias: out of memory for %d entries", (int)n);
    }
    if (n) {
        memcpy(t, tokens, (size_t)n * sizeof(*t));
        memcpy(b, bias, (size_t)n * sizeof(*b));
    }
    free(smpl->bias_tokens);
    free(smpl->bias_values);
    smpl->bias_tokens = t;
    smpl->bias_values = b;
    smpl->n_bias = n;
    return PYKV_OK;
}

static pykv_status ensure_scratch(pykv_sampler *s, int32_t n_vocab) {
    if (s->n_scratch == n_vocab) return PYKV_OK;
    free(s->allowed);
    s->allowed = NULL;
    free(s->cand);
    free(s->typical);
    free(s->mark);
    free(s->count);
    int typical = s->params.typical_p < 1.0f;
    s->cand = malloc((size_t)n_vocab * sizeof(*s->cand));
    s->typical = typical ? malloc((size_t)n_vocab * sizeof(*s->typical)) : NULL;
    s->mark = calloc((size_t)n_vocab, sizeof(*s->mark));
    s->count = malloc((size_t)n_vocab * sizeof(*s->count));
    s->mark_epoch = 0;
    if (!s->cand || (typical && !s->typical) || !s->mark || !s->count) {
        free(s->cand);
        free(s->typical);
        free(s->mark);
        free(s->count);
        s->cand = NULL;
        s->typical = NULL;
        s->mark = NULL;
        s->count = NULL;
        s->n_scratch = 0;
        return pykv_error(PYKV_ERR_NOMEM, "pykv_sampler_sample: out of memory for %d candidates", (int)n_vocab);
    }
    s->n_scratch = n_vocab;
    return PYKV_OK;
}

static pykv_status apply_logit_bias(pykv_sampler *s, int32_t n_vocab) {
    for (int32_t i = 0; i < s->n_bias; i++) {
        pykv_token t = s->bias_tokens[i];
        if (t >= n_vocab) {
            return pykv_error(PYKV_ERR_INVALID_ARG, "logit bias: token id %d is outside the vocabulary (%d tokens)",
                              (int)t, (int)n_vocab);
        }
        s->cand[t].logit += s->bias_values[i];
    }
    return PYKV_OK;
}

pykv_status pykv_sampler_set_grammar(pykv_sampler *smpl, pykv_grammar *grammar) {
    if (!smpl) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_sampler_set_grammar: sampler is NULL");
    smpl->grammar = grammar;
    return PYKV_OK;
}

// s->allowed[t] = 1 for each of the n_vocab tokens the grammar allows now.
static pykv_status grammar_mask(pykv_sampler *s, int32_t n_vocab) {
    if (!s->allowed) {
        s->allowed = malloc((size_t)n_vocab);
        if (!s->allowed) return pykv_error(PYKV_ERR_NOMEM, "pykv_sampler_sample: out of memory for the grammar mask");
    }
    return pykv_grammar_allowed(s->grammar, s->allowed, n_vocab);
}

// Tokens the grammar does not allow get -inf, so no later step can bring them back.
static pykv_status apply_grammar(pykv_sampler *s, int32_t n_vocab) {
    if (!s->grammar) return PYKV_OK;
    PYKV_TRY(grammar_mask(s, n_vocab));
    for (int32_t i = 0; i < n_vocab; i++) {
        if (!s->allowed[i]) s->cand[i].logit = -INFINITY;
    }
    return PYKV_OK;
}

#define GRAMMAR_REFUSALS_BEFORE_MASK 256

// The k best candidates the grammar allows, in rank order, to c[0..*n_out) (-inf ones left
// out: they cannot be drawn). They are checked one at a time from the best down, which costs a
// few checks when the model follows the grammar, instead of a pass over the vocabulary; after
// GRAMMAR_REFUSALS_BEFORE_MASK refusals the rest is masked at once. The same tokens in the
// same order as masking first, then top-k.
static pykv_status grammar_best(pykv_sampler *s, int32_t n_vocab, int32_t k, int32_t *n_out) {
    struct sampler_cand *c = s->cand;
    int32_t kept = 0, i = 0, n_sorted = 0, refused = 0;
    if (k > n_vocab) k = n_vocab;
    // c[0..kept): allowed, best first; c[kept..i): refused leftovers; c[i..): unchecked, all below.
    for (; kept < k && i < n_vocab && refused < GRAMMAR_REFUSALS_BEFORE_MASK; i++) {
        if (i == n_sorted) sampler_sort_more(c, n_vocab, &n_sorted);
        if (isinf(c[i].logit)) {   // the rest are -inf too
            *n_out = kept;
            return PYKV_OK;
        }
        int ok = 0;
        PYKV_TRY(grammar_token_allowed(s->grammar, c[i].id, &ok));
        if (ok) c[kept++] = c[i];
        else refused++;
    }
    if (kept < k && i < n_vocab) {   // many refused: mask the unchecked rest, take its best
        PYKV_TRY(grammar_mask(s, n_vocab));
        int32_t m = kept;
        for (int32_t j = i; j < n_vocab; j++) {
            if (s->allowed[c[j].id] && !isinf(c[j].logit)) c[m++] = c[j];
        }
        int32_t take = m - kept < k - kept ? m - kept : k - kept;
        sampler_select_top(c + kept, m - kept, take);
        kept += take;
    }
    *n_out = kept;
    return PYKV_OK;
}

// llama.cpp's penalties over the recent tokens, each distinct token once: the repeat penalty
// divides a positive logit and multiplies a negative (or zero) one, so the token always
// becomes less likely; then count * frequency_penalty + presence_penalty is subtracted.
static void apply_penalties(pykv_sampler *s, int32_t n_vocab) {
    const struct pykv_sampler_params *p = &s->params;
    if ((p->repeat_penalty == 1.0f && p->frequency_penalty == 0.0f && p->presence_penalty == 0.0f) ||
        s->history_len == 0) {
        return;
    }
    // Two stamps per call: `counted` while counting, `done` once a token is penalised.
    if (s->mark_epoch >= UINT32_MAX - 2) {  // stamps about to wrap: clear and start over
        memset(s->mark, 0, (size_t)n_vocab * sizeof(*s->mark));
        s->mark_epoch = 0;
    }
    uint32_t counted = ++s->mark_epoch, done = ++s->mark_epoch;
    for (int32_t i = 0; i < s->history_len; i++) {
        pykv_token t = s->history[i];
        if (t < 0 || t >= n_vocab) continue;
        if (s->mark[t] != counted) {
            s->mark[t] = counted;
            s->count[t] = 0;
        }
        s->count[t]++;
    }
    for (int32_t i = 0; i < s->history_len; i++) {
        pykv_token t = s->history[i];
        if (t < 0 || t >= n_vocab || s->mark[t] != counted) continue;
        s->mark[t] = done;
        float l = s->cand[t].logit;
        l = l <= 0.0f ? l * p->repeat_penalty : l / p->repeat_penalty;
        s->cand[t].logit = l - (float)s->count[t] * p->frequency_penalty - p->presence_penalty;
    }
}

static pykv_token argmax(const struct sampler_cand *c, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++) {
        if (sampler_cand_before(&c[i], &c[best])) best = i;
    }
    return c[best].id;
}

// Keep the smallest rank-ordered prefix whose probability mass reaches top_p. Sorts only as
// much of the candidates as needed, growing the sorted prefix geometrically.
static int32_t apply_top_p(struct sampler_cand *c, int32_t n, int32_t n_sorted, float top_p) {
    float max_logit = c[0].logit;  // the maximum when sorted; otherwise scan
    if (n_sorted == 0) {
        for (int32_t i = 1; i < n; i++) if (c[i].logit > max_logit) max_logit = c[i].logit;
    }
    double total = 0.0;
    for (int32_t i = 0; i < n; i++) total += exp((double)c[i].logit - (double)max_logit);
    double target = (double)top_p * total;

    double cum = 0.0;
    int32_t i = 0;
    while (i < n) {
        if (i == n_sorted) sampler_sort_more(c, n, &n_sorted);
        cum += exp((double)c[i].logit - (double)max_logit);
        i++;
        if (cum >= target) break;
    }
    return i;
}

// Keep candidates with p >= min_p * p_max, i.e. logit >= max_logit + log(min_p); order kept.
static int32_t apply_min_p(struct sampler_cand *c, int32_t n, float min_p) {
    float max_logit = c[0].logit;
    for (int32_t i = 1; i < n; i++) if (c[i].logit > max_logit) max_logit = c[i].logit;
    float threshold = max_logit + logf(min_p);
    int32_t kept = 0;
    for (int32_t i = 0; i < n; i++) {
        if (c[i].logit >= threshold) c[kept++] = c[i];
    }
    return kept;  // >= 1: the maximum always passes
}

// Softmax of logit / temperature over c[0..n), then one draw.
static pykv_token draw(pykv_sampler *s, const struct sampler_cand *c, int32_t n) {
    double inv_t = 1.0 / (double)s->params.temperature;
    double max_logit = c[0].logit;
    for (int32_t i = 1; i < n; i++) if (c[i].logit > max_logit) max_logit = c[i].logit;
    double total = 0.0;
    for (int32_t i = 0; i < n; i++) total += exp(((double)c[i].logit - max_logit) * inv_t);
    double u = rng_next_double(&s->rng) * total;
    double cum = 0.0;
    int32_t last_nonzero = 0;
    for (int32_t i = 0; i < n; i++) {
        double w = exp(((double)c[i].logit - max_logit) * inv_t);
        if (w > 0.0) last_nonzero = i;
        cum += w;
        if (u < cum) return c[i].id;
    }
    return c[last_nonzero].id;  // rounding put u at the very top of the range
}

pykv_status pykv_sampler_sample(pykv_sampler *smpl, const float *logits, int32_t n_vocab, pykv_token *out) {
    if (!smpl) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_sampler_sample: sampler is NULL");
    if (!out) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_sampler_sample: out is NULL");
    *out = -1;
    if (!logits) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_sampler_sample: logits is NULL");
    if (n_vocab <= 0) {
        return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_sampler_sample: n_vocab must be > 0, got %d", (int)n_vocab);
    }
    if (smpl->grammar) PYKV_TRY(grammar_check_vocab(smpl->grammar, "pykv_sampler_sample", n_vocab));
    PYKV_TRY(ensure_scratch(smpl, n_vocab));

    struct sampler_cand *c = smpl->cand;
    int any_finite = 0;
    for (int32_t i = 0; i < n_vocab; i++) {
        float l = logits[i];
        if (isnan(l) || (isinf(l) && l > 0)) {
            return pykv_error(PYKV_ERR_INVALID_ARG,
                              "pykv_sampler_sample: logit of token %d is %g; logits must be finite or -inf "
                              "(a model whose weights are corrupt or overflow float32 gives such logits)",
                              (int)i, (double)l);
        }
        c[i].logit = l;
        c[i].id = i;
    }
    PYKV_TRY(apply_logit_bias(smpl, n_vocab));
    const struct pykv_sampler_params *p = &smpl->params;
    // With a grammar and a top-k (greedy is top-1), the best tokens are checked one by one;
    // otherwise the whole vocabulary is masked first.
    int grammar_top_k = smpl->grammar && (p->temperature <= 0.0f || (p->top_k > 0 && !p->mirostat));
    if (smpl->grammar && !grammar_top_k) PYKV_TRY(apply_grammar(smpl, n_vocab));
    for (int32_t i = 0; i < n_vocab && !any_finite; i++) any_finite = !isinf(c[i].logit);
    if (!any_finite) {
        return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_sampler_sample: every logit is -inf%s",
                          smpl->grammar ? " among the tokens the grammar allows" :
                          smpl->n_bias ? " after the logit bias" : "");
    }
    apply_penalties(smpl, n_vocab);

    int32_t n = n_vocab, n_sorted = 0;
    if (grammar_top_k) {
        PYKV_TRY(grammar_best(smpl, n_vocab, p->temperature <= 0.0f ? 1 : p->top_k, &n));
        if (n == 0) {
            return pykv_error(PYKV_ERR_INVALID_ARG,
                              "pykv_sampler_sample: every logit is -inf among the tokens the grammar allows");
        }
        n_sorted = n;
    } else if (p->temperature <= 0.0f) {
        *out = argmax(c, n_vocab);
        return PYKV_OK;
    } else if (p->mirostat) {   // in place of top-k, top-p and min-p, as in llama.cpp
        *out = sampler_mirostat(c, n_vocab, n_vocab, p->mirostat, p->temperature, p->mirostat_tau,
                                p->mirostat_eta, &smpl->mu, rng_next_double(&smpl->rng));
        return PYKV_OK;
    } else if (p->top_k > 0 && p->top_k < n) {
        sampler_select_top(c, n, p->top_k);
        n = n_sorted = p->top_k;
    }
    if (p->temperature <= 0.0f) {
        *out = c[0].id;
        return PYKV_OK;
    }
    if (p->typical_p < 1.0f) {
        int32_t kept = sampler_typical(c, n, p->typical_p, smpl->typical);
        n_sorted = n_sorted == n ? kept : 0;   // a sorted list stays sorted; a partly sorted one is re-sorted
        n = kept;
    }
    if (p->top_p < 1.0f) n = apply_top_p(c, n, n_sorted, p->top_p);
    if (p->min_p > 0.0f) n = apply_min_p(c, n, p->min_p);
    *out = draw(smpl, c, n);
    return PYKV_OK;
}
