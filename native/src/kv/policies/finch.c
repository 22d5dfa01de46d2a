// finch.c - FINCH (docs/policies.md#finch): question-aware chunked prefill. The question's
// attention compresses the cache after every prefill chunk, so the prompt is read in
// memory bounded by the budget plus one chunk.
//
// Paper: Corallo and Papotti, "FINCH: Prompt-guided Key-Value Cache Compression for Large
// Language Models" (TACL 2024, doi:10.1162/tacl_a_00716). Reference: kvpress 0.5.5
// FinchPress.
//
// The question is TAKE's probe (take-score.h, docs/policies.md#take): pykv_set_probe's
// tokens, or else the call's last `window` tokens, run after every chunk but the last at
// the positions just after it; the last chunk holds the question itself at its end. After
// every chunk, per layer and KV head:
//  * each question row attends, as in the forward pass, over everything it sees: the
//    entries kept so far, the chunk and the question rows up to its own (causal, fp32
//    softmax); with normalize=1 each row's attention is multiplied by the number of
//    entries it sees (the paper's normalisation: a row spread over a long context counts
//    as much as one over a short context); scores are the mean over the rows, then the mean
//    over the KV head's query heads (no pooling);
//  * on a chunk followed by the probe the B best of the chunk and the earlier entries are
//    kept (the probe's entries are dropped by the forward pass); on the call's last chunk
//    the question, its last W tokens, is kept and the B - W best of the rest beside it.
//
// Options: window (W, 32: the question's length when it ends the call; also the
// constructor's window=), normalize (1).
//
// Choices ([decide] / [ours]), and how they differ from kvpress's FinchPress:
//  * Chunked prefill as the paper describes it: each chunk is read over the cache the earlier
//    chunks left, so later chunks' keys and values come from a compressed context. kvpress
//    prefills the whole prompt at once and selects once (chunk_length only splits that one
//    selection into equal shares); with a single chunk (n_batch at least the prompt) pykv's
//    selection is kvpress's.
//  * Keys keep their original positions. kvpress (rerotate_keys=True) rotates the kept keys
//    to positions 0 .. n-1, so the question and the answer sit right after the compressed
//    context; pykv keeps the distances the model saw. The kept entries are the same: the
//    rotation comes after the selection.
//  * normalize multiplies a row by the number of entries it sees (its non-zero weights);
//    kvpress multiplies by the row's position, one less in an uncompressed cache (a
//    relative difference of 1 / (position + 1) between rows' weights).
//  * The question's length: kvpress finds it from a delimiter token it adds to the
//    vocabulary; pykv takes the call's last W tokens, or the probe's length when a probe
//    longer than W was appended.
//  * The probe's default is the call's last min(W, n_batch / 4) tokens (the context's rule
//    for a default probe); B must exceed W. Decode steps append (the cache grows); a later
//    multi-token call is a new FINCH prefill.
#include "kv/policies/common/policy-make.h"
#include "kv/policies/common/window-scores.h"
#include "kv/policies/take/take-score.h"
#include "core/error.h"
#include "model/model.h"

#include <stddef.h>
#include <stdlib.h>

extern const struct policy_ops policy_finch;

#define FINCH_ARGS "window, normalize (0|1)"

struct finch {
    struct kv_policy base;
    int32_t          window;       // W: the question at the end of a call
    int32_t          normalize;    // 0|1
    int32_t          probe_rows;   // the probe appended to this call's chunks; 0: none yet
};

static const struct policy_opt finch_opts[] = {
    { .key = "window", .type = POLICY_OPT_INT, .offset = offsetof(struct finch, window), .lo = 1, .hi = 1 << 24 },
    { .key = "normalize", .type = POLICY_OPT_CHOICE, .offset = offsetof(struct finch, normalize), .choices = "0|1" },
};

static void finch_defaults(struct kv_policy *base) {
    struct finch *p = (struct finch *)base;
    p->window = -1;
    p->normalize = 1;
}

// window= given to the constructor and as an argument is one setting; no sinks.
static pykv_status finch_finish(struct kv_policy *base, const struct policy_config *cfg) {
    struct finch *p = (struct finch *)base;
    if (cfg->window >= 0) {
        if (p->window >= 0 && p->window != cfg->window)
            return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'finch': window=%d and the policy argument window=%d "
                              "disagree", cfg->window, p->window);
        if (cfg->window < 1)
            return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'finch': the window (the question's tokens) must be at "
                              "least 1, got %d", cfg->window);
        p->window = cfg->window;
    }
    if (p->window < 0) p->window = 32;
    if (cfg->sink > 0)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'finch' has no sink tokens (sink=%d)", cfg->sink);
    return cfg->budget > 0 ? ws_check_budget("finch", cfg->budget, p->window) : PYKV_OK;
}

static const struct policy_maker finch_maker = {
    .ops = &policy_finch,
    .size = sizeof(struct finch),
    .accepted = FINCH_ARGS,
    .opts = finch_opts,
    .n_opts = (int)(sizeof(finch_opts) / sizeof(finch_opts[0])),
    .defaults = finch_defaults,
    .finish = finch_finish,
};

static pykv_status finch_init(const struct policy_config *cfg, struct kv_policy **out) {
    return policy_make(&finch_maker, cfg, out);
}

static void finch_reset(struct kv_policy *base) { ((struct finch *)base)->probe_rows = 0; }

// The question rows of this chunk, its last `rows` queries: the appended probe, or the last
// chunk's own tail.
struct question {
    int32_t rows;
    int32_t pos0;   // position of row 0
    int32_t kept;   // entries at the end of every list that are not candidates
};

static struct question question_of(const struct finch *p, const struct policy_event *ev) {
    struct question qn;
    if (ev->probe.n > 0) {
        qn.rows = qn.kept = ev->probe.n;
        qn.pos0 = ev->n_past;
        return qn;
    }
    int32_t W = p->probe_rows > p->window ? p->probe_rows : p->window;
    if (W > ev->T) W = ev->T;
    if (W > ev->n_prompt) W = ev->n_prompt;
    qn.rows = qn.kept = W;
    qn.pos0 = ev->n_past - W;
    return qn;
}

// Score every list of the layer by the question (its rows q: (qn->rows, n_head, head_dim),
// post-RoPE) and keep each one's top k candidates plus its last qn->kept entries.
static pykv_status keep_best(const struct finch *p, const struct policy_event *ev, const struct question *qn,
                             const float *q, int64_t k) {
    const int32_t Hkv = ev->hp->n_head_kv;
    int32_t *n_cols = malloc((size_t)Hkv * sizeof(int32_t));
    int64_t *offset = malloc((size_t)Hkv * sizeof(int64_t));
    if (!n_cols || !offset) {
        free(n_cols); free(offset);
        return pykv_error(PYKV_ERR_NOMEM, "out of memory in FINCH eviction");
    }
    int64_t total = 0;
    for (int32_t g = 0; g < Hkv; g++) {
        n_cols[g] = kv_cache_list(ev->cache, ev->layer, g)->n;   // the question's own keys are seen too
        offset[g] = total;
        total += n_cols[g];
    }
    float *scores = malloc((size_t)(total + 1) * sizeof(float));
    pykv_status st = scores ? PYKV_OK
                   : pykv_error(PYKV_ERR_NOMEM, "out of memory in FINCH eviction (%lld entries)", (long long)total);
    const enum take_row_weight weight = p->normalize ? TAKE_ROWS_BY_SEEN : TAKE_ROWS_EQUAL;
    if (st == PYKV_OK) st = take_layer_scores(ev, q, 0, qn->rows, qn->pos0, n_cols, offset, 1, weight, scores);
    for (int32_t g = 0; g < Hkv && st == PYKV_OK; g++) {
        const int32_t n_cand = n_cols[g] - qn->kept;
        if (n_cand > k) st = ws_keep_top(ev, g, scores + offset[g], n_cand, k);
    }
    free(n_cols); free(offset); free(scores);
    return st;
}

static pykv_status finch_after_layer(struct kv_policy *base, const struct policy_event *ev) {
    struct finch *p = (struct finch *)base;
    if (ev->n_prompt <= 1 || ev->T <= 0) return PYKV_OK;   // decode step: the cache grows
    if (ev->layer == 0 && ev->is_first_chunk) p->probe_rows = 0;
    if (ev->probe.n > 0) p->probe_rows = ev->probe.n;
    else if (!ev->is_last_chunk) return PYKV_OK;
    const int32_t B = ws_budget(&base->cfg, ev);
    PYKV_TRY(ws_check_budget("finch", B, p->window));
    const struct question qn = question_of(p, ev);
    if (ev->probe.n == 0 && qn.kept > p->window)   // a probe longer than W: the question kept is longer
        PYKV_TRY(ws_check_budget("finch", B, qn.kept));
    const int64_t k = ev->probe.n > 0 ? B : (int64_t)B - qn.kept;
    int any = 0;
    for (int32_t g = 0; g < ev->hp->n_head_kv; g++) any |= kv_cache_list(ev->cache, ev->layer, g)->n - qn.kept > k;
    if (!any) return PYKV_OK;
    // the question's rows (a layer on the GPU sends them down, for the scoring to take back up
    // with their causal limits)
    float *q = malloc((size_t)qn.rows * ev->hp->n_head * ev->hp->head_dim * sizeof(float));
    if (!q) return pykv_error(PYKV_ERR_NOMEM, "out of memory for FINCH's question");
    pykv_status st = ws_query_rows(ev, ev->T - qn.rows, qn.rows, q);
    if (st == PYKV_OK) st = keep_best(p, ev, &qn, q, k);
    free(q);
    return st;
}

static int32_t finch_last_chunk_min(const struct kv_policy *base) { return ((const struct finch *)base)->window; }

static int32_t finch_probe_len(const struct kv_policy *base, int32_t n_tokens) {
    const struct finch *p = (const struct finch *)base;
    return p->window < n_tokens ? p->window : n_tokens;
}

const struct policy_ops policy_finch = {
    .name = "finch",
    .description = "FINCH: the question's attention compresses the cache after every prefill chunk (the question "
                   "is the call's last tokens or the probe), so the prompt is read in bounded memory",
    .init = finch_init,
    .free = policy_free_state,
    .after_layer = finch_after_layer,
    .last_chunk_min = finch_last_chunk_min,
    .probe_len = finch_probe_len,
    .reset = finch_reset,
    .min_budget = ws_min_budget,
    .options = "window=32, normalize=1",
    .choose = "a long prompt with a known question (at the prompt's end, or set_probe): the question picks "
              "what to keep as each chunk is read, in memory bounded by the budget",
    .default_budget_frac = POLICY_DEFAULT_BUDGET_FRAC,
    .default_budget_min = POLICY_DEFAULT_BUDGET_MIN,
    .budget_floor = POLICY_BUDGET_FLOOR,
    .evicts_while_reading = 1,
    .device_lists = 1,
};
