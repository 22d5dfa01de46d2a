// kvzip.c - KVzip (docs/policies.md#kvzip): an entry is worth what the model needs of it to
// repeat the context. "KVzip: Query-Agnostic KV Cache Compression with Context
// Reconstruction" (Kim et al., arXiv 2505.23416).
//
// Score: after a prefill, the model is asked to repeat what it read. The tokens read since
// the cache was last compressed are cut into chunks of C tokens; for each chunk a scoring
// pass (policy.h scoring_pass) runs
//     "\n\nRepeat the previous context exactly." "\n" <the chunk's tokens>              (first)
//     "\n\nRepeat the part of the previous context exactly, starting with" <the last 8
//     tokens of the chunk before> "\n" <the chunk's tokens>                              (others)
// at the positions after the sequence, attending the whole cache; its K/V are dropped. In
// every layer, each query of the pass attends with a softmax restricted to the first n_sink
// entries of the list (none for a chunk that starts there), the chunk's entries, and the
// pass's own entries up to itself (causal); an entry's score is the largest weight it gets
// from any query of the pass and any query head of its KV head's group.
//
// Selection: at the end of a prefill call the entries of the first n_sink positions are
// always kept; of the others, the cache keeps the B * n_layer * n_head_kv best scored
// entries of all layers and heads together (B, the budget, is the average per list), so
// layers and heads get unequal shares; layerwise=1 gives every layer B * n_head_kv entries,
// shared by its heads. Ties go to the lower layer, head and position.
//
// Options: n_sink=4, chunk_size=2048 (C), layerwise=0, evict_every_chunk=0 (1: every
// prefill chunk is reconstructed and the cache compressed after it). The passes read the
// prompt once more, each over the whole cache: a prefill under kvzip takes two to three
// times as long.
//
// Choices where pykv departs from kvpress (KVzipPress):
//  * The repeat prompt is plain text tokenized by the model's tokenizer. For a model with a
//    chat template kvpress takes the context to be a user turn of it: it leaves the
//    template's opening tokens out of the reconstruction and ends the repeat prompt with the
//    assistant's header (pykv renders no template in C). Without one the two are the same.
//  * A pass must fit in one prefill chunk: C is at most n_ubatch less the prompt's tokens
//    (and the room the lists have left), so with the default n_ubatch (512) chunks are
//    shorter than kvpress's 2048, and the restricted softmax sees fewer entries.
//  * Entries of earlier calls keep the score their own call gave them; entries appended by
//    decode steps were never reconstructed and are always kept. With evict_every_chunk
//    (a cache bounded by n_ctx) each list keeps its own top B, so that no list outgrows the
//    room the next chunk and its pass need.
//  * KVzip+ normalization (kvpress's kvzip_plus_normalization) is not offered.
// A saved state (pykv_state_save) keeps every entry's score.
#include "core/error.h"
#include "core/threadpool.h"
#include "cpu/attention.h"
#include "cpu/ops.h"
#include "model/model.h"
#include "kv/policy.h"
#include "kv/policies/common/policy-make.h"
#include "kv/policies/common/policy-state.h"
#include "kv/policies/common/window-scores.h"
#include "kv/policies/kvzip/kvzip.h"

#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

extern const struct policy_ops policy_kvzip;

#define KVZIP_ARGS "n_sink, chunk_size, layerwise (0|1)"
#define KVZIP_PREV_TAIL 8          // tokens of the chunk before that a later pass repeats
#define KVZIP_PROMPT_MAX 256       // room for each tokenized prompt (a byte per token at worst)
#define KVZIP_UNSCORED FLT_MAX     // an entry no pass reconstructed (a decode step's): kept

static const char *const kvzip_first_text = "\n\nRepeat the previous context exactly.";
static const char *const kvzip_next_text = "\n\nRepeat the part of the previous context exactly, starting with";
static const char *const kvzip_suffix_text = "\n";

struct kvzip_prompt {
    pykv_token tokens[KVZIP_PROMPT_MAX];
    int32_t    n;
};

struct kvzip {
    struct kv_policy    base;
    int32_t             n_sink;
    int32_t             chunk_size;
    int32_t             layerwise;
    struct kvzip_prompt first, next, suffix;   // tokenized at the first pass
    int                 tokenized;
    // the pass running now: chunk [a, b) of the n_replay tokens replayed
    int32_t             a, b, n_replay;
    int32_t             n_lists;
    float             **scores;     // per (layer, KV head): one score per list entry
    int32_t            *n_scored;   // entries of the list that have a score
    int32_t            *cap;
};

static const struct policy_opt kvzip_opts[] = {
    { .key = "n_sink", .type = POLICY_OPT_INT, .offset = offsetof(struct kvzip, n_sink), .lo = 0, .hi = 1 << 20 },
    { .key = "chunk_size", .type = POLICY_OPT_INT, .offset = offsetof(struct kvzip, chunk_size), .lo = 1, .hi = INT32_MAX },
    { .key = "layerwise", .type = POLICY_OPT_INT, .offset = offsetof(struct kvzip, layerwise), .lo = 0, .hi = 1 },
};

static void kvzip_defaults(struct kv_policy *base) {
    struct kvzip *p = (struct kvzip *)base;
    p->n_sink = 4;
    p->chunk_size = 2048;
}

static pykv_status kvzip_finish(struct kv_policy *base, const struct policy_config *cfg) {
    const struct kvzip *p = (const struct kvzip *)base;
    if (cfg->budget > 0 && cfg->budget <= p->n_sink)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'kvzip': the budget %d must be larger than n_sink=%d",
                          cfg->budget, p->n_sink);
    return PYKV_OK;
}

static const struct policy_maker kvzip_maker = {
    .ops = &policy_kvzip,
    .size = sizeof(struct kvzip),
    .accepted = KVZIP_ARGS,
    .opts = kvzip_opts,
    .n_opts = (int)(sizeof(kvzip_opts) / sizeof(kvzip_opts[0])),
    .defaults = kvzip_defaults,
    .finish = kvzip_finish,
};

static pykv_status kvzip_init(const struct policy_config *cfg, struct kv_policy **out) {
    return policy_make(&kvzip_maker, cfg, out);
}

static void kvzip_free(struct kv_policy *base) {
    struct kvzip *p = (struct kvzip *)base;
    if (p->scores)
        for (int32_t i = 0; i < p->n_lists; i++) free(p->scores[i]);
    free(p->scores);
    free(p->n_scored);
    free(p->cap);
    free(p);
}

static void kvzip_reset(struct kv_policy *base) {
    struct kvzip *p = (struct kvzip *)base;
    if (p->n_scored) memset(p->n_scored, 0, (size_t)p->n_lists * sizeof(int32_t));
    p->n_replay = 0;
}

static int32_t kvzip_min_budget(const struct kv_policy *base) { return ((const struct kvzip *)base)->n_sink + 1; }

// ---- per-entry scores ----

static pykv_status kvzip_lists(struct kvzip *p, int32_t n_lists) {
    if (p->scores) return PYKV_OK;
    p->n_lists = n_lists;
    p->scores = calloc((size_t)n_lists, sizeof(float *));
    p->n_scored = calloc((size_t)n_lists, sizeof(int32_t));
    p->cap = calloc((size_t)n_lists, sizeof(int32_t));
    return p->scores && p->n_scored && p->cap ? PYKV_OK : pykv_error(PYKV_ERR_NOMEM, "out of memory for KVzip scores");
}

// List i now holds n entries: the new ones are unscored until a pass scores them. A list
// shorter than before was rolled back after a failed chunk: its surviving entries keep theirs.
static pykv_status track_entries(struct kvzip *p, int32_t i, int32_t n) {
    if (n < p->n_scored[i]) p->n_scored[i] = n;
    if (n > p->cap[i]) {
        int32_t cap = n + n / 4 + 16;
        float *s = realloc(p->scores[i], (size_t)cap * sizeof(float));
        if (!s) return pykv_error(PYKV_ERR_NOMEM, "out of memory for KVzip scores");
        p->scores[i] = s;
        p->cap[i] = cap;
    }
    for (int32_t j = p->n_scored[i]; j < n; j++) p->scores[i][j] = KVZIP_UNSCORED;
    p->n_scored[i] = n;
    return PYKV_OK;
}

// ---- the scoring passes ----

static pykv_status tokenize_prompt(const struct pykv_model *m, const char *text, struct kvzip_prompt *out) {
    pykv_status st = pykv_tokenize(m, text, (int32_t)strlen(text), 0, 0, out->tokens, KVZIP_PROMPT_MAX, &out->n);
    if (st != PYKV_OK) return pykv_error(st, "policy 'kvzip': tokenizing its repeat prompt failed");
    return PYKV_OK;
}

// The context tokens one pass reconstructs: C, the option, less what the pass's own text
// takes of its room.
static int32_t pass_chunk_len(const struct kvzip *p, int32_t cap) {
    int32_t own = p->first.n + p->suffix.n;
    const int32_t own_next = p->next.n + KVZIP_PREV_TAIL + p->suffix.n;
    if (own_next > own) own = own_next;
    const int32_t room = cap - own;
    return room < p->chunk_size ? room : p->chunk_size;
}

static void put(pykv_token *out, int32_t *n, const pykv_token *tokens, int32_t count) {
    memcpy(out + *n, tokens, (size_t)count * sizeof(pykv_token));
    *n += count;
}

static pykv_status kvzip_scoring_pass(struct kv_policy *base, const struct policy_replay *in, int32_t i,
                                      pykv_token *out, int32_t *n) {
    struct kvzip *p = (struct kvzip *)base;
    *n = 0;
    if (!p->tokenized) {
        PYKV_TRY(tokenize_prompt(in->model, kvzip_first_text, &p->first));
        PYKV_TRY(tokenize_prompt(in->model, kvzip_next_text, &p->next));
        PYKV_TRY(tokenize_prompt(in->model, kvzip_suffix_text, &p->suffix));
        p->tokenized = 1;
    }
    const int32_t C = pass_chunk_len(p, in->cap);
    if (C < 1)
        return pykv_error(PYKV_ERR_CONTEXT_FULL, "policy 'kvzip': no room for its reconstruction pass (%d tokens "
                          "free in a prefill chunk or in the cache; a larger n_batch or n_ctx, or a smaller budget)",
                          in->cap);
    const int64_t a = (int64_t)i * C;
    if (a >= in->n_tokens) {
        p->n_replay = 0;
        return PYKV_OK;
    }
    p->a = (int32_t)a;
    p->b = in->n_tokens - p->a < C ? in->n_tokens : p->a + C;
    p->n_replay = in->n_tokens;
    if (i == 0) {
        put(out, n, p->first.tokens, p->first.n);
    } else {
        put(out, n, p->next.tokens, p->next.n);
        const int32_t tail = KVZIP_PREV_TAIL < C ? KVZIP_PREV_TAIL : C;
        put(out, n, in->tokens + p->a - tail, tail);
    }
    put(out, n, p->suffix.tokens, p->suffix.n);
    put(out, n, in->tokens + p->a, p->b - p->a);
    return PYKV_OK;
}

// One layer's pass: the entries that a query of KV head g may weigh are the sinks [0, sink),
// the chunk [c0, c1) and the pass's own [self0, self0 + T).
struct pass_job {
    const struct policy_event *ev;
    const struct kv_list      *lists;   // the layer's lists (a host copy for a layer on the GPU)
    int32_t *sink, *c0, *self0;   // (n_head_kv) each
    int32_t  width;       // c1 - c0, the same for every list
    float   *best;        // (n_head, width) the largest weight per query head and chunk entry
    float   *logits;      // (n_threads, n_sink + width + T)
    int32_t  logits_stride;
};

// q . key for entries [j0, j0 + n) of l, into out (the attention kernels' dot products).
static void key_dots(const float *q, const struct kv_list *l, int32_t j0, int32_t n, int d, float *out) {
    struct kv_list view = *l;
    view.k = (char *)l->k + (size_t)j0 * kv_format_row_bytes(l->fmt_k, d);
    attention_dots(q, &view, 0, n, d, out);
}

// The restricted softmax of query row t of query head hq, folded into best (max).
static void pass_row(const struct pass_job *job, int hq, int t, float *z, float *best) {
    const struct policy_event *ev = job->ev;
    const struct hparams *hp = ev->hp;
    const int g = hq / (hp->n_head / hp->n_head_kv), d = hp->head_dim;
    const struct kv_list *l = &job->lists[g];
    const float *q = ev->q + ((size_t)t * hp->n_head + hq) * d;
    const float scale = 1.0f / sqrtf((float)d);
    const int32_t ns = job->sink[g], w = job->width, n = ns + w + t + 1;
    key_dots(q, l, 0, ns, d, z);
    key_dots(q, l, job->c0[g], w, d, z + ns);
    key_dots(q, l, job->self0[g], t + 1, d, z + ns + w);
    for (int32_t j = 0; j < n; j++) z[j] *= scale;
    softmax(z, n);
    for (int32_t j = 0; j < w; j++) best[j] = z[ns + j] > best[j] ? z[ns + j] : best[j];
}

static void pass_task(void *arg, int ith, int nth) {
    const struct pass_job *job = arg;
    const struct hparams *hp = job->ev->hp;
    long h0, h1;
    split_range(hp->n_head, ith, nth, &h0, &h1);
    float *z = job->logits + (size_t)ith * job->logits_stride;
    for (long hq = h0; hq < h1; hq++) {
        float *best = job->best + (size_t)hq * job->width;
        for (int32_t j = 0; j < job->width; j++) best[j] = 0.0f;
        for (int t = 0; t < job->ev->T; t++) pass_row(job, (int)hq, t, z, best);
    }
}

// The entries a pass row of KV head g weighs (sink, c0, self0: n_head_kv each, in `at`) and
// the chunk's width; tracks the entries' scores.
static pykv_status pass_layout(struct kvzip *p, const struct policy_event *ev, struct pass_job *job) {
    const int hkv = ev->hp->n_head_kv;
    job->ev = ev;
    job->width = p->b - p->a;
    int32_t *at = malloc((size_t)3 * hkv * sizeof(int32_t));
    if (!at) return pykv_error(PYKV_ERR_NOMEM, "out of memory for KVzip's pass");
    job->sink = at;
    job->c0 = at + hkv;
    job->self0 = at + 2 * hkv;
    for (int g = 0; g < hkv; g++) {
        const int32_t i = ev->layer * hkv + g, n_ctx_entries = kv_cache_list(ev->cache, ev->layer, g)->n - ev->T;
        PYKV_TRY(track_entries(p, i, n_ctx_entries));   // the caller frees job->sink
        job->c0[g] = n_ctx_entries - p->n_replay + p->a;
        job->sink[g] = p->n_sink < job->c0[g] ? p->n_sink : job->c0[g];
        job->self0[g] = n_ctx_entries;
    }
    job->best = malloc((size_t)ev->hp->n_head * (job->width ? job->width : 1) * sizeof(float));
    return job->best ? PYKV_OK : pykv_error(PYKV_ERR_NOMEM, "out of memory for KVzip's pass");
}

// Each chunk entry's score: the max over its KV head's query heads of their best weights.
static void pass_fold(struct kvzip *p, const struct pass_job *job) {
    const struct policy_event *ev = job->ev;
    const int hkv = ev->hp->n_head_kv, group = ev->hp->n_head / hkv;
    for (int g = 0; g < hkv; g++) {
        float *s = p->scores[ev->layer * hkv + g] + job->c0[g];
        for (int32_t j = 0; j < job->width; j++) {
            float m = 0.0f;
            for (int r = 0; r < group; r++) {
                const float v = job->best[(size_t)(g * group + r) * job->width + j];
                m = v > m ? v : m;
            }
            s[j] = m;
        }
    }
}

// The pass over lists in host memory (the layer's, or a host copy of a layer on the GPU).
static pykv_status score_pass(struct kvzip *p, const struct policy_event *ev, const struct kv_list *lists) {
    struct pass_job job = { .lists = lists };
    pykv_status st = pass_layout(p, ev, &job);
    const int nth = threadpool_size(ev->pool);
    job.logits_stride = p->n_sink + job.width + ev->T;
    if (st == PYKV_OK && !(job.logits = malloc((size_t)nth * job.logits_stride * sizeof(float))))
        st = pykv_error(PYKV_ERR_NOMEM, "out of memory for KVzip's pass");
    if (st == PYKV_OK) {
        threadpool_run(ev->pool, pass_task, &job);
        pass_fold(p, &job);
    }
    free(job.best);
    free(job.logits);
    free(job.sink);
    return st;
}

// The pass over a layer on the GPU, by the device's twin of pass_row; *done is 0 when the
// device cannot take it.
static pykv_status score_pass_device(struct kvzip *p, const struct policy_event *ev, int *done) {
    struct pass_job job = { 0 };
    pykv_status st = pass_layout(p, ev, &job);
    if (st == PYKV_OK) st = kvzip_pass_device(ev, job.sink, job.c0, job.self0, job.width, job.best, done);
    if (st == PYKV_OK && *done) pass_fold(p, &job);
    free(job.best);
    free(job.sink);
    return st;
}

static pykv_status kvzip_after_layer(struct kv_policy *base, const struct policy_event *ev) {
    struct kvzip *p = (struct kvzip *)base;
    if (ev->probe.n == 0 || ev->probe.n != ev->T || p->n_replay == 0) return PYKV_OK;   // not a pass
    PYKV_TRY(kvzip_lists(p, ev->hp->n_layer * ev->hp->n_head_kv));
    if (!ev->q_device) return score_pass(p, ev, kv_cache_list(ev->cache, ev->layer, 0));
    int done = 0;   // a layer on the GPU: the pass runs there
    PYKV_TRY(score_pass_device(p, ev, &done));
    if (done) return PYKV_OK;
    // else the pass's queries and the layer's keys come down, and it runs on the host
    struct policy_event host;
    float *q = NULL;
    struct kv_list *lists = calloc((size_t)ev->hp->n_head_kv, sizeof(*lists));
    pykv_status st = lists ? ws_host_event(ev, &host, &q) : pykv_error(PYKV_ERR_NOMEM, "out of memory for KVzip's pass");
    if (st == PYKV_OK) st = kv_layer_host_copy(ev->cache, ev->layer, 0, lists);
    if (st == PYKV_OK) st = score_pass(p, &host, lists);
    kv_layer_host_copy_free(ev->cache, lists);
    free(lists);
    free(q);
    return st;
}

// ---- selection ----

// The score selection ranks entry j of list i by: the sinks first, then its own.
static float rank_of(const struct kvzip *p, const struct kv_list *l, int32_t i, int32_t j) {
    return l->pos[j] < p->n_sink ? KVZIP_UNSCORED : p->scores[i][j];
}

// Keep the K best ranked entries of lists [i0, i1) together.
static pykv_status keep_best(struct kvzip *p, struct kv_cache *c, int32_t i0, int32_t i1, int64_t K) {
    int64_t total = 0;
    for (int32_t i = i0; i < i1; i++) total += c->lists[i].n;
    if (total <= K) return PYKV_OK;
    float *s = malloc((size_t)total * sizeof(float));
    int64_t *idx = malloc((size_t)(K > 0 ? K : 1) * sizeof(int64_t));
    int32_t *keep = malloc((size_t)total * sizeof(int32_t));
    pykv_status st = s && idx && keep ? PYKV_OK : pykv_error(PYKV_ERR_NOMEM, "out of memory in KVzip's selection");
    int64_t n_idx = 0;
    if (st == PYKV_OK) {
        for (int32_t i = i0, at = 0; i < i1; i++)
            for (int32_t j = 0; j < c->lists[i].n; j++) s[at++] = rank_of(p, &c->lists[i], i, j);
        st = ws_select_top(s, total, K, idx, &n_idx);
    }
    int64_t list_start = 0, at = 0;
    for (int32_t i = i0; i < i1 && st == PYKV_OK; i++) {
        struct kv_list *l = &c->lists[i];
        int32_t m = 0;
        for (; at < n_idx && idx[at] < list_start + l->n; at++) keep[m++] = (int32_t)(idx[at] - list_start);
        list_start += l->n;
        kv_compact_rows(p->scores[i], sizeof(float), keep, m);
        p->n_scored[i] = m;
        st = kv_list_retain(c, l, keep, m);
    }
    free(s); free(idx); free(keep);
    return st;
}

static pykv_status kvzip_after_chunk(struct kv_policy *base, const struct policy_event *ev) {
    struct kvzip *p = (struct kvzip *)base;
    if (ev->n_prompt <= 1 || !ev->is_last_chunk) return PYKV_OK;
    const int32_t B = ws_budget(&base->cfg, ev);
    if (B <= p->n_sink)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'kvzip': the budget %d must be larger than n_sink=%d", B,
                          p->n_sink);
    struct kv_cache *c = ev->cache;
    const int32_t hkv = c->n_head_kv, n_lists = c->n_layer * hkv;
    PYKV_TRY(kvzip_lists(p, n_lists));
    for (int32_t i = 0; i < n_lists; i++) PYKV_TRY(track_entries(p, i, c->lists[i].n));
    // lists per selection: all of them, a layer's, or (a cache bounded by n_ctx) one
    const int32_t scope = base->cfg.cap > 0 ? 1 : p->layerwise ? hkv : n_lists;
    for (int32_t i0 = 0; i0 < n_lists; i0 += scope) PYKV_TRY(keep_best(p, c, i0, i0 + scope, (int64_t)B * scope));
    return PYKV_OK;
}

// ---- saved states: every list's scores, one per entry ----

static void kvzip_state_write(const struct kv_policy *base, const struct kv_cache *c, struct state_writer *w) {
    const struct kvzip *p = (const struct kvzip *)base;
    for (int32_t i = 0; i < c->n_layer * c->n_head_kv; i++) {
        const int32_t n = c->lists[i].n, scored = p->scores ? (p->n_scored[i] < n ? p->n_scored[i] : n) : 0;
        if (scored) state_put(w, p->scores[i], (size_t)scored * sizeof(float));
        for (int32_t j = scored; j < n; j++) state_put(w, &(float){ KVZIP_UNSCORED }, sizeof(float));
    }
}

static pykv_status kvzip_state_read(struct kv_policy *base, const struct kv_cache *c, const int32_t *list_n,
                                    struct state_reader *r, int apply) {
    struct kvzip *p = (struct kvzip *)base;
    const int32_t n_lists = c->n_layer * c->n_head_kv;
    if (apply) PYKV_TRY(kvzip_lists(p, n_lists));
    for (int32_t i = 0; i < n_lists; i++) {
        if (apply) {
            p->n_scored[i] = 0;
            PYKV_TRY(track_entries(p, i, list_n[i]));
        }
        PYKV_TRY(policy_state_floats("kvzip", r, apply ? p->scores[i] : NULL, list_n[i]));
    }
    return PYKV_OK;
}

const struct policy_ops policy_kvzip = {
    .name = "kvzip",
    .description = "KVzip: the model repeats the prompt; entries keep the most attention that reconstruction pays "
                   "them, ranked across all layers and heads",
    .init = kvzip_init,
    .free = kvzip_free,
    .after_layer = kvzip_after_layer,
    .after_chunk = kvzip_after_chunk,
    .scoring_pass = kvzip_scoring_pass,
    .reset = kvzip_reset,
    .state_write = kvzip_state_write,
    .state_read = kvzip_state_read,
    .min_budget = kvzip_min_budget,
    .options = "n_sink=4, chunk_size=2048, layerwise=0, evict_every_chunk=0",
    .choose = "a document compressed before the question is known (asked many questions); costs about one more "
              "prefill",
    .default_budget_frac = POLICY_DEFAULT_BUDGET_FRAC,
    .default_budget_min = POLICY_DEFAULT_BUDGET_MIN,
    .budget_floor = POLICY_BUDGET_FLOOR,
    .device_lists = 1,
};
