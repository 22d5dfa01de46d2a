// take.c - TAKE (docs/policies.md#take): task-aware eviction after every prefill chunk, so the
// cache never holds the whole prompt.
//
// Schedule (after_layer of every chunk of a multi-token call): the context runs
// each chunk but the last followed by the probe tokens (probe_len below; pykv_set_probe
// gives an explicit one) at the positions right after the chunk ([ours]).
// At every scored layer the probe queries update the layer's EMA (take-score.h: pre-RoPE,
// alpha on the past, rows aligned at the end), the EMA probe, rotated to the current probe
// positions, scores the layer's entries (the appended probe entries excluded), and each
// KV head keeps its top k entries; the probe entries stay at the end of the list for the
// forward pass to drop.
//
// Choices ([decide] / [ours]):
//  * Last chunk: no probe is appended ([ours]); the chunk's real tail is the
//    probe: its last `rows` tokens, rows = the EMA's row count (the earlier chunks' probe
//    length), or probe_len when the call is a single chunk, at most the chunk's length.
//    The context keeps at least probe_len tokens in the last chunk (last_chunk_min). Those
//    tail entries are candidates like any other (no protected window, [ours]),
//    scored causally by position. A call that fits one chunk is its own last chunk.
//  * The context refuses a probe of n_ubatch / 2 tokens or more (pykv_decode error), so
//    the default probe_len = 32 needs n_batch > 64 for multi-chunk prompts.
//  * Budgets: B = policy_budget(cfg, tokens of the call); k(i, l) = B_warmup for layers
//    l <= W_L - 1 on every chunk but the last, else B. Defaults W_L = n_layer / 2
//    (warmup_layers), B_warmup = min(tokens of the call, 20 * B) ([decide]; warmup_budget),
//    and B_warmup is never below B nor above n_ctx (the cache's size). A list with at most k entries is left as it is, so a
//    prompt of at most B tokens is never evicted.
//  * Layer-level delay: layers below the key layer W_L - 1 are not scored; the key layer's
//    per-head selection, taken as positions, is applied to layers 0 .. W_L - 1 from the
//    key layer's hook (those layers hold the same positions). warmup_layers = 0: every
//    layer is scored with B on every chunk (no warm-up).
//  * The EMA restarts with every multi-token call (a call is recognised by its first
//    chunk: the call length changes or the chunk does not start where the last one ended)
//    and after pykv_reset; the EMA is updated on every chunk, also when nothing is evicted.
//  * Scores: mean over the probe rows, GQA mean ([ours]), avg pooling with
//    kernel 7 ([decide]); top-k ties go to the lower position.
//  * On a GPU, a scored layer that decides for no layer below it evicts without waiting for
//    the device (take-evict-gpu.h: the selection and compaction queued there, the kept
//    positions written at the chunk's end, after_gpu_layers); the key layer waits for its
//    selection, which the layers below it take as positions.
//  * Decode steps (one token) never evict: the cache grows by one entry per list per step
//    ([ours]). A later multi-token call is a new TAKE prefill and evicts again.
//  * Defaults alpha = 0.2 (the LongBench value), probe_len = 32 ([decide]).
//    Arguments: alpha (0 <= alpha < 1), probe_len (>= 1), warmup_layers (0 .. n_layer,
//    checked at the first chunk), warmup_budget (>= 1, tokens), kernel (odd, >= 1);
//    anything else is an error.
#include "kv/policies/common/policy-make.h"
#include "kv/kv-device.h"
#include "kv/policies/take/take-evict-gpu.h"
#include "kv/policies/take/take-score.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "model/model.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

extern const struct policy_ops policy_take;

#define TAKE_ARGS "alpha, probe_len, warmup_layers, warmup_budget, kernel"

struct take {
    struct kv_policy base;
    double           alpha;
    int32_t          probe_len;
    int32_t          warmup_layers;   // -1 = n_layer / 2
    int32_t          warmup_budget;   // -1 = min(call tokens, 20 * B)
    int32_t          kernel;
    // state of the current multi-token call
    int32_t          n_layer;
    struct take_ema *ema;             // (n_layer), allocated at the first chunk
    struct take_deferred *deferred;   // GPU layers' evictions whose positions wait for the chunk's end
};

static const struct policy_opt take_opts[] = {
    { .key = "alpha", .type = POLICY_OPT_DOUBLE, .offset = offsetof(struct take, alpha), .lo = 0.0, .hi = 1.0 },
    { .key = "probe_len", .type = POLICY_OPT_INT, .offset = offsetof(struct take, probe_len), .lo = 1, .hi = INT32_MAX },
    { .key = "warmup_layers", .type = POLICY_OPT_INT, .offset = offsetof(struct take, warmup_layers), .lo = 0,
      .hi = INT32_MAX },
    { .key = "warmup_budget", .type = POLICY_OPT_INT, .offset = offsetof(struct take, warmup_budget), .lo = 1,
      .hi = INT32_MAX },
    { .key = "kernel", .type = POLICY_OPT_INT, .offset = offsetof(struct take, kernel), .lo = 1, .hi = 1023 },
};

static void take_defaults(struct kv_policy *base) {
    struct take *p = (struct take *)base;
    p->alpha = 0.2;
    p->probe_len = 32;
    p->warmup_layers = -1;
    p->warmup_budget = -1;
    p->kernel = 7;
}

// What the table's ranges do not say: alpha below 1 (1 would never update the probe), an odd kernel.
static pykv_status take_finish(struct kv_policy *base, const struct policy_config *cfg) {
    (void)cfg;
    const struct take *p = (const struct take *)base;
    if (p->alpha >= 1.0)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'take': alpha must be in [0, 1), got %g", p->alpha);
    if (p->kernel % 2 == 0)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'take': kernel must be odd, got %d", p->kernel);
    return PYKV_OK;
}

static void take_free(struct kv_policy *base) {
    struct take *p = (struct take *)base;
    if (p->ema)
        for (int32_t l = 0; l < p->n_layer; l++) take_ema_free(&p->ema[l]);
    free(p->ema);
    take_deferred_free(p->deferred);
    free(p);
}

static const struct policy_maker take_maker = {
    .ops = &policy_take,
    .size = sizeof(struct take),
    .accepted = TAKE_ARGS,
    .opts = take_opts,
    .n_opts = (int)(sizeof(take_opts) / sizeof(take_opts[0])),
    .defaults = take_defaults,
    .finish = take_finish,
};

static pykv_status take_init(const struct policy_config *cfg, struct kv_policy **out) {
    return policy_make(&take_maker, cfg, out);
}

static void take_reset(struct kv_policy *base) {
    struct take *p = (struct take *)base;
    if (p->ema)
        for (int32_t l = 0; l < p->n_layer; l++) p->ema[l].rows = 0;
}

// The first scored layer of a chunk: a call's first chunk restarts the EMA (the context
// says which chunk starts a call, so one cut short by a cancel or an error does not carry
// its scores into the next).
static pykv_status begin_chunk(struct take *p, const struct policy_event *ev) {
    if (!p->ema) {
        p->n_layer = ev->hp->n_layer;
        p->ema = calloc((size_t)p->n_layer, sizeof(*p->ema));
        if (!p->ema) return pykv_error(PYKV_ERR_NOMEM, "out of memory for the TAKE probe state");
    }
    if (ev->is_first_chunk)
        for (int32_t l = 0; l < p->n_layer; l++) p->ema[l].rows = 0;
    return PYKV_OK;
}

// Keep `chosen` (ascending indices of the first n_real entries) and the entries after
// n_real (this layer's probe) of list l.
static pykv_status keep_indices(struct kv_cache *c, struct kv_list *l, const int64_t *chosen, int64_t n_chosen,
                                int32_t n_real, int32_t *keep) {
    int32_t m = 0;
    for (int64_t j = 0; j < n_chosen; j++) keep[m++] = (int32_t)chosen[j];
    for (int32_t j = n_real; j < l->n; j++) keep[m++] = j;
    return m == l->n ? PYKV_OK : kv_list_retain(c, l, keep, m);
}

// Keep the entries of list l whose positions appear in want (ascending, n_want of them).
static pykv_status keep_positions(struct kv_cache *c, struct kv_list *l, const int32_t *want, int32_t n_want,
                                  int32_t *keep) {
    int32_t m = 0, w = 0;
    for (int32_t j = 0; j < l->n; j++) {
        while (w < n_want && want[w] < l->pos[j]) w++;
        if (w < n_want && want[w] == l->pos[j]) keep[m++] = j;
    }
    return m == l->n ? PYKV_OK : kv_list_retain(c, l, keep, m);
}

// Select and evict on the scored layer ev->layer; the key layer also shrinks layers below.
static pykv_status evict_layer(struct take *p, const struct policy_event *ev, const float *qa, int qa_on_device,
                               int32_t rows, int32_t pos0, int32_t k, int32_t key) {
    const struct hparams *hp = ev->hp;
    const int32_t Hkv = hp->n_head_kv;
    int32_t *n_cols = malloc((size_t)Hkv * sizeof(int32_t));
    int64_t *offset = malloc((size_t)Hkv * sizeof(int64_t));
    if (!n_cols || !offset) {
        free(n_cols); free(offset);
        return pykv_error(PYKV_ERR_NOMEM, "out of memory in TAKE eviction");
    }
    int64_t total = 0;
    int32_t max_n = 1;
    for (int32_t g = 0; g < Hkv; g++) {
        const struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
        n_cols[g] = l->n - ev->probe.n;
        offset[g] = total;
        total += n_cols[g];
        if (l->n > max_n) max_n = l->n;
        for (int32_t low = 0; ev->layer == key && low < key; low++)
            if (kv_cache_list(ev->cache, low, g)->n > max_n) max_n = kv_cache_list(ev->cache, low, g)->n;
    }
    float *scores = malloc((size_t)(total + 1) * sizeof(float));
    int64_t *chosen = malloc((size_t)max_n * sizeof(int64_t));
    int32_t *keep = malloc((size_t)max_n * sizeof(int32_t));
    int32_t *want = malloc((size_t)max_n * sizeof(int32_t));
    pykv_status st = (scores && chosen && keep && want) ? PYKV_OK
                   : pykv_error(PYKV_ERR_NOMEM, "out of memory in TAKE eviction (%lld entries)", (long long)total);
    if (st == PYKV_OK)
        st = take_layer_scores(ev, qa, qa_on_device, rows, pos0, n_cols, offset, p->kernel, TAKE_ROWS_EQUAL, scores);
    for (int32_t g = 0; g < Hkv && st == PYKV_OK; g++) {
        struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
        int64_t n_chosen = 0;
        if (n_cols[g] <= k) {   // no-op rule: everything kept
            for (int32_t j = 0; j < n_cols[g]; j++) chosen[j] = j;
            n_chosen = n_cols[g];
        } else {
            st = ws_select_top(scores + offset[g], n_cols[g], k, chosen, &n_chosen);
        }
        for (int64_t j = 0; j < n_chosen && st == PYKV_OK; j++) want[j] = l->pos[chosen[j]];
        if (st == PYKV_OK) st = keep_indices(ev->cache, l, chosen, n_chosen, n_cols[g], keep);
        for (int32_t low = 0; ev->layer == key && low < key && st == PYKV_OK; low++)
            st = keep_positions(ev->cache, kv_cache_list(ev->cache, low, g), want, (int32_t)n_chosen, keep);
    }
    free(n_cols); free(offset); free(scores); free(chosen); free(keep); free(want);
    return st;
}

static pykv_status take_after_layer(struct kv_policy *base, const struct policy_event *ev) {
    struct take *p = (struct take *)base;
    if (ev->n_prompt <= 1 || ev->T <= 0) return PYKV_OK;   // decode step: the cache grows
    const struct hparams *hp = ev->hp;
    const int32_t WL = p->warmup_layers < 0 ? hp->n_layer / 2 : p->warmup_layers;
    if (WL > hp->n_layer)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'take': warmup_layers=%d exceeds the model's %d layers",
                          WL, hp->n_layer);
    const int32_t key = WL - 1, first = key > 0 ? key : 0;
    if (ev->layer < first) return PYKV_OK;   // shallow layers wait for the key layer
    if (ev->layer == first) PYKV_TRY(begin_chunk(p, ev));

    // The probe rows: the appended probe, or the last chunk's real tail.
    struct take_ema *e = &p->ema[ev->layer];
    const int32_t real = ev->T - ev->probe.n;
    const size_t width = (size_t)hp->n_head * hp->head_dim;
    int32_t rows, pos0;
    if (ev->probe.n > 0) {
        rows = ev->probe.n;
        pos0 = ev->n_past;
    } else {
        rows = e->rows > 0 ? e->rows : p->probe_len;
        if (rows > real) rows = real;
        pos0 = ev->n_past - rows;
    }
    // the probe rows are the chunk's last ones either way; a layer on the GPU mixes them there
    float *qa = NULL;
    pykv_status st = PYKV_OK;
    if (ev->q_device) {   // device memory, given back once the work queued with it is done
        st = kv_device_resize(ev->cache->device, ev->cache->device_stream, (void **)&qa, 0,
                              (size_t)rows * width * sizeof(float));
        if (st == PYKV_OK) st = take_ema_update_device(e, rows, pos0, p->alpha, ev, qa);
    } else {
        float *q_rows = malloc((size_t)rows * width * sizeof(float));
        qa = malloc((size_t)rows * width * sizeof(float));
        if (!qa || !q_rows) {
            free(qa); free(q_rows);
            return pykv_error(PYKV_ERR_NOMEM, "out of memory for the TAKE probe");
        }
        st = ws_query_rows(ev, ev->T - rows, rows, q_rows);
        if (st == PYKV_OK) st = take_ema_update(e, q_rows, rows, pos0, p->alpha, ev, qa);
        free(q_rows);
    }

    const int32_t B = policy_budget(&base->cfg, ev->n_prompt);
    int64_t Bw = p->warmup_budget > 0 ? p->warmup_budget : (ev->n_prompt < 20LL * B ? ev->n_prompt : 20LL * B);
    if (Bw < B) Bw = B;
    if (base->cfg.cap > 0 && Bw > base->cfg.cap) Bw = base->cfg.cap;   // the cache's size (B is within it)
    const int32_t k = (ev->layer <= key && !ev->is_last_chunk) ? (int32_t)Bw : B;
    int any = 0;
    for (int32_t g = 0; g < hp->n_head_kv; g++) {
        any |= kv_cache_list(ev->cache, ev->layer, g)->n - ev->probe.n > k;
        for (int32_t low = 0; ev->layer == key && low < key; low++) any |= kv_cache_list(ev->cache, low, g)->n > k;
    }
    // a GPU layer that decides for no layer below it evicts without waiting for the device
    int queued = 0;
    if (st == PYKV_OK && any && ev->q_device && !(ev->layer == key && key > 0))
        st = take_deferred_evict(&p->deferred, ev, qa, rows, pos0, p->kernel, k, &queued);
    if (st == PYKV_OK && any && !queued) st = evict_layer(p, ev, qa, ev->q_device != NULL, rows, pos0, k, key);
    if (ev->q_device) kv_device_resize(ev->cache->device, ev->cache->device_stream, (void **)&qa, 0, 0);
    else free(qa);
    return st;
}

// The end of a chunk's layers on the GPU: the positions of what the queued evictions kept.
static pykv_status take_after_gpu_layers(struct kv_policy *base, struct kv_cache *cache) {
    return take_deferred_finish(((struct take *)base)->deferred, cache);
}

static int32_t take_probe_len(const struct kv_policy *base, int32_t n_tokens) {
    const struct take *p = (const struct take *)base;
    return p->probe_len < n_tokens ? p->probe_len : n_tokens;
}

static int32_t take_last_chunk_min(const struct kv_policy *base) { return ((const struct take *)base)->probe_len; }

const struct policy_ops policy_take = {
    .name = "take",
    .description = "TAKE: a task probe scores the cache after every prefill chunk (EMA of probe queries, "
                   "warm-up budget for shallow layers), so the cache never holds the whole prompt",
    .init = take_init,
    .free = take_free,
    .after_layer = take_after_layer,
    .after_gpu_layers = take_after_gpu_layers,
    .last_chunk_min = take_last_chunk_min,
    .probe_len = take_probe_len,
    .reset = take_reset,
    .options = "alpha=0.2, probe_len=32, warmup_layers=n_layer/2, warmup_budget=min(prompt, 20 B), kernel=7",
    .choose = "a prompt longer than memory: evicts after every prefill chunk, so n_ctx bounds the cache, "
              "not the prompt; the question at the prompt's end (or set_probe) guides it",
    .default_budget_frac = POLICY_DEFAULT_BUDGET_FRAC,
    .default_budget_min = POLICY_DEFAULT_BUDGET_MIN,
    .budget_floor = POLICY_BUDGET_FLOOR,
    .evicts_while_reading = 1,
    .device_lists = 1,
};
