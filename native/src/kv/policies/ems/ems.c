// ems.c - EMS: evict-then-merge with a global-local score (docs/policies.md#ems; the paper
// publishes no code).
//
// Choices (every point the paper leaves open, and what this runtime adds):
//  * Granularity: per (layer, KV head) lists, as the cache keeps them; query-head scores are reduced by
//    the GQA mean (s_Glo and s_Loc alike).
//  * s_Glo: the attention each entry received from every query so far (all prompt chunks and
//    decode steps), from the forward pass's column sums (POLICY_NEEDS_ATTENTION_SUMS), exactly, no
//    truncation; a merged entry's is its members' total mass.
//  * s_Loc (prefill): sum over the last min(L_win, chunk) queries (the context makes the last
//    chunk hold at least L_win tokens: last_chunk_min); scored over the whole list, merged
//    entries expanded (ems-score.c). Mean alignment: a = sum_j s_Loc / sum_j s_Glo over the
//    whole list (window included); s_GL = max(a s_Glo, s_Loc); mean pooling (kernel 7, zeros
//    counted at the edges, PyTorch avg_pool1d) over the candidates (the non-window entries).
//  * Partition, redundancy and merge: ems-prefill.c and ems-merge.c. Similarity uses the
//    keys as stored (post-RoPE): the paper's "w.o. pos" variant, the one whose merged rotated
//    direction attention.c can expand (no per-member re-rotation). No protected centres (the
//    paper's PPL setting). One-shot weighted average, w = s_Loc. R with a negative key or value
//    cosine never merges. tau = 1 is evict-only; gamma = 1 has no TBM tokens.
//  * On a GPU, a prompt's end on the device lists (ems-gpu-prefill.c): the same partition
//    and merges, every TBM entry's most similar centre found on the device and only the rows
//    that may merge brought down.
//  * Decode (ems-decode.c; each list as soon as it has attended, through decode_list,
//    overlapped with the attention of the layer's other lists; on a GPU, every list once the
//    step is done, ems-gpu.c): fixed budget B per list,
//    window -> centre, weakest centre by unpooled s_GL merged (R >= tau) or evicted;
//    s_Glo += the step's attention; s_Loc = s_Loc_past + s_Loc_cur, s_Loc_cur accumulates
//    decode queries and replaces s_Loc_past every L_win steps (counted per layer since the last prefill); member count <= gamma * B per list
//    (evict instead of merge when over it).
//  * Budget B = policy_budget(cfg, n_prompt) at the end of each prefill call (decoding with no
//    prefill before uses the absolute budget); B > L_win is required; a prompt of at most B
//    tokens is left untouched (bit-identical to full). Window = the last L_win entries.
//  * Policy args: window (L_win, default 32), kernel (odd, default 7), tau (in [0, 1], default
//    0.6), gamma (integer >= 1, default 4). No sinks. Unknown keys are errors.
//  * Merge metadata (member norms, flags) is allocated by the cache and counted in its bytes;
//    the policy's own score arrays (6 floats per entry, and 2 of scratch) are not cache
//    bytes, as for h2o. A saved state (pykv_state_save) keeps them with the budget and the
//    per-layer step counts, so a loaded context merges and evicts as the saved one would.
#include "kv/policies/ems/ems.h"
#include "kv/policies/common/policy-make.h"
#include "kv/policies/common/policy-state.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "model/model.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

extern const struct policy_ops policy_ems;

#define EMS_ARGS "window, kernel, tau, gamma"

struct ems {
    struct kv_policy base;
    struct ems_opts  o;
    int32_t          budget;   // B of the last prefill; 0 before one
    int32_t          n_lists;
    struct ems_list *lists;    // (n_layer * n_head_kv)
    int32_t         *steps;    // (n_layer) decode steps since the last prefill
    int32_t          n_layer;
    struct ws_opts   ws;       // window and kernel as parsed (shared checks)
    struct ems_gpu  *gpu;      // decode steps of device lists (ems-gpu.c); NULL until one
};

// ---- per-list score arrays -------------------------------------------------------------

// Every per-entry array of s, for the loops that treat them alike.
#define EMS_SCORE_ARRAYS 6
static void score_arrays(struct ems_list *s, float **f[EMS_SCORE_ARRAYS]) {
    f[0] = &s->glo; f[1] = &s->lp; f[2] = &s->lc; f[3] = &s->wsum; f[4] = &s->kmag; f[5] = &s->inv;
}

pykv_status ems_list_track(struct ems_list *s, int32_t n) {
    if (n < s->n) s->n = n;   // rolled back after a cancelled chunk
    if (n > s->cap) {
        int32_t cap = n + n / 4 + 16;
        float **f[EMS_SCORE_ARRAYS];
        score_arrays(s, f);
        for (int a = 0; a < EMS_SCORE_ARRAYS; a++) {
            float *x = realloc(*f[a], (size_t)cap * sizeof(float));
            if (!x) return pykv_error(PYKV_ERR_NOMEM, "ems: out of memory for scores");
            *f[a] = x;
        }
        float *w = realloc(s->work, (size_t)cap * 2 * sizeof(float));
        if (!w) return pykv_error(PYKV_ERR_NOMEM, "ems: out of memory for scores");
        s->work = w;
        s->cap = cap;
    }
    for (int32_t j = s->n; j < n; j++) {
        s->glo[j] = s->lp[j] = s->lc[j] = s->wsum[j] = 0.0f;
        s->kmag[j] = 1.0f;
        s->inv[j] = -1.0f;
    }
    s->n = n;
    return PYKV_OK;
}

void ems_list_compact(struct ems_list *s, const int32_t *keep, int32_t n_keep) {
    float **f[EMS_SCORE_ARRAYS];
    score_arrays(s, f);
    for (int a = 0; a < EMS_SCORE_ARRAYS; a++) kv_compact_rows(*f[a], sizeof(float), keep, n_keep);
    s->n = n_keep;
}

void ems_list_drop(struct ems_list *s, int32_t j, int32_t tail) {
    float **f[EMS_SCORE_ARRAYS];
    score_arrays(s, f);
    for (int a = 0; a < EMS_SCORE_ARRAYS; a++) kv_drop_row(*f[a], sizeof(float), s->n, j, tail);
    s->n--;
}

void ems_list_free(struct ems_list *s) {
    float **f[EMS_SCORE_ARRAYS];
    score_arrays(s, f);
    for (int a = 0; a < EMS_SCORE_ARRAYS; a++) free(*f[a]);
    free(s->work);
    memset(s, 0, sizeof(*s));
}

// ---- options ---------------------------------------------------------------------------

// window and kernel as the window policies take them (ems has no pool= or gqa=)
static const struct policy_opt ems_opts[] = {
    { .key = "window", .type = POLICY_OPT_INT, .offset = offsetof(struct ems, ws.window), .lo = 1, .hi = 1 << 24 },
    { .key = "kernel", .type = POLICY_OPT_INT, .offset = offsetof(struct ems, ws.kernel), .lo = 1, .hi = 1025 },
    { .key = "tau", .type = POLICY_OPT_DOUBLE, .offset = offsetof(struct ems, o.tau), .lo = 0.0, .hi = 1.0 },
    { .key = "gamma", .type = POLICY_OPT_INT, .offset = offsetof(struct ems, o.gamma), .lo = 1, .hi = 1024 },
};

static void ems_free(struct kv_policy *base) {
    struct ems *p = (struct ems *)base;
    if (p->lists)
        for (int32_t i = 0; i < p->n_lists; i++) ems_list_free(&p->lists[i]);
    free(p->lists);
    free(p->steps);
    ems_gpu_free(p->gpu);
    free(p);
}

static void ems_defaults(struct kv_policy *base) {
    struct ems *p = (struct ems *)base;
    ws_opts_default(&p->ws);
    p->o.tau = 0.6;
    p->o.gamma = 4;
}

static pykv_status ems_finish(struct kv_policy *base, const struct policy_config *cfg) {
    struct ems *p = (struct ems *)base;
    PYKV_TRY(ws_opts_finish("ems", &p->ws, cfg));
    p->o.window = p->ws.window;
    p->o.kernel = p->ws.kernel;
    return PYKV_OK;
}

static const struct policy_maker ems_maker = {
    .ops = &policy_ems,
    .size = sizeof(struct ems),
    .accepted = EMS_ARGS,
    .opts = ems_opts,
    .n_opts = (int)(sizeof(ems_opts) / sizeof(ems_opts[0])),
    .defaults = ems_defaults,
    .finish = ems_finish,
};

static pykv_status ems_init(const struct policy_config *cfg, struct kv_policy **out) {
    return policy_make(&ems_maker, cfg, out);
}

static void ems_reset(struct kv_policy *base) {
    struct ems *p = (struct ems *)base;
    if (p->lists)
        for (int32_t i = 0; i < p->n_lists; i++) p->lists[i].n = 0;
    if (p->steps) memset(p->steps, 0, (size_t)p->n_layer * sizeof(int32_t));
    p->budget = 0;
}

static int32_t ems_last_chunk_min(const struct kv_policy *base) {
    return ((const struct ems *)base)->o.window;
}

// ---- schedule --------------------------------------------------------------------------

void ems_attention_mean(const struct policy_event *ev, int32_t g, int32_t j0, int32_t m, float *a) {
    const int32_t G = ev->hp->n_head / ev->hp->n_head_kv;
    // the query heads summed in order: any thread count gives the same floats
    ems_rows_mean(ev->attn_colsum + (size_t)g * G * ev->attn_colsum_stride, ev->attn_colsum_stride, G, j0, m, a);
}

// s_Glo += a prefill chunk's attention (blocks of entries, so that the mean vectorises).
static void accumulate(struct ems_list *s, const struct policy_event *ev, int32_t g) {
    enum { BLOCK = 64 };
    for (int32_t j0 = 0; j0 < s->n; j0 += BLOCK) {
        const int32_t m = s->n - j0 < BLOCK ? s->n - j0 : BLOCK;
        float a[BLOCK];
        ems_attention_mean(ev, g, j0, m, a);
        for (int32_t i = 0; i < m; i++) s->glo[j0 + i] += a[i];
    }
}

// s_Loc from the sums a GPU layer computed over the window's queries (policy_event.window_sums,
// merged entries expanded): the GQA mean of each KV head's rows, in head order.
static pykv_status window_local_scores(const struct policy_event *ev, float **out) {
    const int32_t hkv = ev->hp->n_head_kv, G = ev->hp->n_head / hkv;
    for (int32_t g = 0; g < hkv; g++) {
        const int32_t n = kv_cache_list(ev->cache, ev->layer, g)->n;
        if (!(out[g] = malloc((size_t)(n ? n : 1) * sizeof(float)))) {
            for (int32_t h = 0; h <= g; h++) { free(out[h]); out[h] = NULL; }
            return pykv_error(PYKV_ERR_NOMEM, "ems: out of memory for local scores");
        }
        ems_rows_mean(ev->window_sums + (size_t)g * G * ev->attn_colsum_stride, ev->attn_colsum_stride, G, 0, n, out[g]);
    }
    return PYKV_OK;
}

static pykv_status prefill_end(struct ems *p, const struct policy_event *ev) {
    const int32_t hkv = ev->hp->n_head_kv;
    const int32_t B = policy_budget(&p->base.cfg, ev->n_prompt);
    PYKV_TRY(ws_check_budget("ems", B, p->o.window));
    p->budget = B;
    p->steps[ev->layer] = 0;
    int32_t rows = p->o.window < ev->n_prompt ? p->o.window : ev->n_prompt;
    if (rows > ev->T) rows = ev->T;
    float **loc = calloc((size_t)hkv, sizeof(float *));
    if (!loc) return pykv_error(PYKV_ERR_NOMEM, "ems: out of memory");
    const int on_device = kv_cache_list(ev->cache, ev->layer, 0)->on_device;
    const int window = ev->window_sums && ev->window_rows == rows;
    pykv_status st = window ? window_local_scores(ev, loc)
                   : on_device ? pykv_error(PYKV_ERR_INTERNAL, "ems: a GPU layer's prompt came without its window's sums")
                   : ems_local_scores(ev, rows, loc);
    if (st == PYKV_OK && on_device) st = ems_gpu_prefill_layer(ev, &p->o, B, &p->lists[ev->layer * hkv], loc);
    for (int32_t g = 0; g < hkv && st == PYKV_OK && !on_device; g++)
        st = ems_prefill_list(ev, &p->o, B, g, &p->lists[ev->layer * hkv + g], loc[g]);
    for (int32_t g = 0; g < hkv; g++) free(loc[g]);
    free(loc);
    return st;
}

// One decode step of list g of ev->layer (decode_list: run by the forward pass as soon as
// the list has attended, while other threads attend the layer's other lists; after_layer
// did the layer's bookkeeping and checks before the attention): s_Glo and s_Loc_cur take
// the step's attention, s_Loc_cur replaces s_Loc_past every L_win steps, then the list goes
// back to the budget (ems-decode.c).
static pykv_status ems_decode_step(struct kv_policy *base, const struct policy_event *ev, int32_t g) {
    struct ems *p = (struct ems *)base;
    struct ems_list *s = &p->lists[ev->layer * ev->hp->n_head_kv + g];
    const struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
    const int roll = p->steps[ev->layer] % p->o.window == 0;
    PYKV_TRY(ems_list_track(s, l->n));
    if (l->on_device) return ems_gpu_decode_list(&p->gpu, ev, p->budget, g, s, roll);
    return ems_decode_list(ev, &p->o, p->budget, g, s, roll);
}

// Once every GPU layer's lists have taken a decode step's scores: their evictions and merges.
static pykv_status ems_after_step(struct kv_policy *base, struct kv_cache *c, int discard) {
    struct ems *p = (struct ems *)base;
    return ems_gpu_after_step(p->gpu, c, &p->o, p->budget, discard);
}

static pykv_status ems_alloc(struct ems *p, int32_t n_layer, int32_t n_head_kv) {
    if (p->lists) return PYKV_OK;
    p->n_lists = n_layer * n_head_kv;
    p->lists = calloc((size_t)p->n_lists, sizeof(struct ems_list));
    p->n_layer = n_layer;
    p->steps = calloc((size_t)n_layer, sizeof(int32_t));
    return p->lists && p->steps ? PYKV_OK : pykv_error(PYKV_ERR_NOMEM, "ems: out of memory for scores");
}

static pykv_status ems_after_layer(struct kv_policy *base, const struct policy_event *ev) {
    struct ems *p = (struct ems *)base;
    const int32_t hkv = ev->hp->n_head_kv;
    PYKV_TRY(ems_alloc(p, ev->hp->n_layer, hkv));
    if (!ev->attn_colsum) return pykv_error(PYKV_ERR_INTERNAL, "ems: the forward pass gave no attention sums");
    if (ev->n_prompt == 1) {   // before the layer's attention: decode_list does the lists
        if (p->budget == 0 && base->cfg.budget > 0) p->budget = base->cfg.budget;
        ++p->steps[ev->layer];
        return PYKV_OK;
    }
    for (int32_t g = 0; g < hkv; g++) {
        struct ems_list *s = &p->lists[ev->layer * hkv + g];
        PYKV_TRY(ems_list_track(s, kv_cache_list(ev->cache, ev->layer, g)->n));
        accumulate(s, ev, g);
    }
    return ev->is_last_chunk ? prefill_end(p, ev) : PYKV_OK;
}

// ---- saved state -----------------------------------------------------------------------

// The budget, each layer's decode steps, then every list's score arrays (one value per
// entry each; an entry not tracked yet gets what ems_list_track would give it).
static void ems_state_write(const struct kv_policy *base, const struct kv_cache *c, struct state_writer *w) {
    const struct ems *p = (const struct ems *)base;
    state_put_i32(w, p->budget);
    for (int32_t l = 0; l < c->n_layer; l++) state_put_i32(w, p->steps ? p->steps[l] : 0);
    static const float untracked[EMS_SCORE_ARRAYS] = { 0.0f, 0.0f, 0.0f, 0.0f, 1.0f, -1.0f };
    for (int32_t i = 0; i < c->n_layer * c->n_head_kv; i++) {
        const int32_t n = c->lists[i].n;
        struct ems_list *s = p->lists ? &p->lists[i] : NULL;
        const int32_t tracked = s ? (s->n < n ? s->n : n) : 0;
        float **f[EMS_SCORE_ARRAYS];
        if (s) score_arrays(s, f);
        for (int a = 0; a < EMS_SCORE_ARRAYS; a++) {
            if (tracked) state_put(w, *f[a], (size_t)tracked * sizeof(float));
            for (int32_t j = tracked; j < n; j++) state_put(w, &untracked[a], sizeof(float));
        }
    }
}

static pykv_status ems_state_read(struct kv_policy *base, const struct kv_cache *c, const int32_t *list_n,
                                  struct state_reader *r, int apply) {
    struct ems *p = (struct ems *)base;
    int32_t budget;
    PYKV_TRY(policy_state_ints("ems", "budget", r, &budget, 1, 0, INT32_MAX));
    if (apply) PYKV_TRY(ems_alloc(p, c->n_layer, c->n_head_kv));
    PYKV_TRY(policy_state_ints("ems", "step count", r, apply ? p->steps : NULL, c->n_layer, 0, INT32_MAX));
    if (apply) p->budget = budget;
    for (int32_t i = 0; i < c->n_layer * c->n_head_kv; i++) {
        struct ems_list *s = apply ? &p->lists[i] : NULL;
        float **f[EMS_SCORE_ARRAYS];
        if (s) {
            s->n = 0;
            PYKV_TRY(ems_list_track(s, list_n[i]));
            score_arrays(s, f);
        }
        for (int a = 0; a < EMS_SCORE_ARRAYS; a++) PYKV_TRY(policy_state_floats("ems", r, s ? *f[a] : NULL, list_n[i]));
    }
    return PYKV_OK;
}

const struct policy_ops policy_ems = {
    .name = "ems",
    .description = "evict-then-merge: global-local score, redundant tokens merged into class centres; fixed budget",
    .init = ems_init,
    .free = ems_free,
    .after_layer = ems_after_layer,
    .decode_list = ems_decode_step,
    .after_step = ems_after_step,
    .last_chunk_min = ems_last_chunk_min,
    .reset = ems_reset,
    .state_write = ems_state_write,
    .state_read = ems_state_read,
    .needs = POLICY_NEEDS_ATTENTION_SUMS | POLICY_NEEDS_STEP_ROOM,
    .min_budget = ws_min_budget,
    .options = "window=32, kernel=7, tau=0.6, gamma=4, evict_every_chunk=0",
    .choose = "long generations in a fixed memory: evicted entries are merged into similar kept ones",
    .default_budget_frac = POLICY_DEFAULT_BUDGET_FRAC,
    .default_budget_min = POLICY_DEFAULT_BUDGET_MIN,
    .budget_floor = POLICY_BUDGET_FLOOR,
    .device_lists = 1,
    .host_lists = 1,
    .device_prefill_end = 1,
};
