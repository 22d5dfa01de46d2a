// context.c - creating a context and the decode loop: chunking, policy hooks, rollback.
#include "graph/context.h"
#include "graph/forward-gpu.h"
#include "cpu/attention.h"
#include "core/error.h"
#include "cpu/gemm-q8.h"
#include "core/log.h"
#include "cpu/ops.h"
#include "core/perf.h"
#include "cpu/quant.h"
#include "cpu/quant-q8.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define DEFAULT_N_UBATCH 512

void pykv_context_default_params(struct pykv_context_params *p) {
    if (!p) return;
    memset(p, 0, sizeof(*p));
    p->struct_size = sizeof(*p);
    p->n_ctx = 4096;
    p->n_ubatch = DEFAULT_N_UBATCH;
    p->n_threads = 0;
    p->policy = "full";
    p->window = -1;
    p->sink = -1;
    p->kv_type = PYKV_TYPE_F16;
    p->kv_type_v = -1;
}

static float *alloc_floats(size_t n, int *failed) {
    float *p = calloc(n ? n : 1, sizeof(float));
    if (!p) *failed = 1;
    return p;
}

// The widest input of any weight matrix: the row length of the matmul scratch.
static size_t matmul_max_cols(const struct hparams *hp) {
    size_t cols = (size_t)hp->n_embd;
    if ((size_t)hp->n_ff > cols) cols = (size_t)hp->n_ff;
    if ((size_t)hp->n_head * hp->head_dim > cols) cols = (size_t)hp->n_head * hp->head_dim;
    return cols;
}

// Attention weights of a tile of queries over a list, which may briefly hold a chunk's probe
// tokens on top of n_ctx entries.
static size_t scores_per_thread(const pykv_context *ctx) {
    return (size_t)ATTENTION_TILE * ((size_t)ctx->n_ctx + (size_t)ctx->n_ubatch);
}

static pykv_status alloc_scratch(pykv_context *ctx) {
    const struct hparams *hp = &ctx->model->hp;
    size_t T = (size_t)ctx->n_ubatch, nt = (size_t)threadpool_size(ctx->pool);
    size_t q_dim = (size_t)hp->n_head * hp->head_dim, kv_dim = (size_t)hp->n_head_kv * hp->head_dim;
    struct scratch *b = &ctx->buf;
    int failed = 0;
    b->x = alloc_floats(T * hp->n_embd, &failed);
    b->xb = alloc_floats(T * hp->n_embd, &failed);
    b->q = alloc_floats(T * q_dim, &failed);
    b->k = alloc_floats(T * kv_dim, &failed);
    b->v = alloc_floats(T * kv_dim, &failed);
    b->att = alloc_floats(T * q_dim, &failed);
    b->gate = alloc_floats(T * hp->n_ff, &failed);
    b->up = alloc_floats(T * hp->n_ff, &failed);
    b->scores_stride = scores_per_thread(ctx);
    b->scores = alloc_floats(nt * b->scores_stride, &failed);
    b->flash_work_stride = flash_work_floats(hp->head_dim, hp->n_head / hp->n_head_kv);
    b->flash_work = alloc_floats(nt * b->flash_work_stride, &failed);
    b->part_m = alloc_floats((size_t)hp->n_head * DECODE_MAX_SEGMENTS, &failed);
    b->part_l = alloc_floats((size_t)hp->n_head * DECODE_MAX_SEGMENTS, &failed);
    b->part_o = alloc_floats((size_t)hp->n_head * DECODE_MAX_SEGMENTS * hp->head_dim, &failed);
    b->matmul.dequant = alloc_floats(nt * matmul_scratch_floats(matmul_max_cols(hp)), &failed);
    b->matmul.xq = calloc(1, Q8_ACT_BYTES(matmul_max_cols(hp)));
    b->matmul.xpk = calloc(T * pk_blocks(matmul_max_cols(hp)) + 1, sizeof(pk_act));
    b->segments_next = calloc((size_t)hp->n_head_kv, sizeof(atomic_int));
    b->segments_left = calloc((size_t)hp->n_head_kv, sizeof(atomic_int));
    b->segments = calloc((size_t)hp->n_head_kv, sizeof(int));
    failed |= !b->matmul.xq || !b->matmul.xpk || !b->segments_next || !b->segments_left || !b->segments;
    b->rope_inv_freq = alloc_floats((size_t)hp->n_rot / 2, &failed);
    b->rope_cs = alloc_floats(T * (size_t)hp->n_rot, &failed);
    b->colsum_stride = (size_t)ctx->cache.max_entries;
    if (policy_needs_sums(ctx->policy->ops))
        b->attn_colsum = alloc_floats((size_t)hp->n_head * b->colsum_stride, &failed);
    ctx->logits = alloc_floats((size_t)hp->n_vocab, &failed);
    ctx->chunk_start_n = calloc((size_t)hp->n_layer * hp->n_head_kv, sizeof(int32_t));
    ctx->chunk_tokens = calloc((size_t)ctx->n_ubatch, sizeof(pykv_token));
    if (failed || !ctx->chunk_start_n || !ctx->chunk_tokens)
        return pykv_error(PYKV_ERR_NOMEM, "out of memory allocating activation buffers for n_ubatch=%d", ctx->n_ubatch);
    rope_inv_freq(b->rope_inv_freq, hp->n_rot, hp->rope_freq_base, ctx->model->rope_freqs);
    return PYKV_OK;
}

static void free_scratch(struct scratch *b) {
    free(b->x); free(b->xb); free(b->q); free(b->k); free(b->v); free(b->att);
    free(b->gate); free(b->up); free(b->scores); free(b->matmul.dequant); free(b->matmul.xq); free(b->matmul.xpk); free(b->rope_inv_freq); free(b->rope_cs); free(b->attn_colsum);
    free(b->flash_work); free(b->part_m); free(b->part_l); free(b->part_o); free(b->segments_next); free(b->segments_left); free(b->segments);
}

static pykv_status validate_params(const pykv_model *m, const struct pykv_context_params *p) {
    if (p->struct_size != sizeof(*p))
        return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_context_params.struct_size is %zu, expected %zu (header/library mismatch)",
                          p->struct_size, sizeof(*p));
    if (m->vocab_only) return pykv_error(PYKV_ERR_INVALID_ARG, "the model was loaded with vocab_only: it has no weights to run");
    if (p->n_ctx > (1u << 24)) return pykv_error(PYKV_ERR_INVALID_ARG, "n_ctx %u is too large", p->n_ctx);
    if (p->n_ubatch > (1u << 16)) return pykv_error(PYKV_ERR_INVALID_ARG, "n_ubatch %u is too large", p->n_ubatch);
    if (kv_format_of_type(p->kv_type) < 0)
        return pykv_error(PYKV_ERR_INVALID_ARG, "kv_type must be F16 (%d), F32 (%d) or Q8_0 (%d), got %d", PYKV_TYPE_F16,
                          PYKV_TYPE_F32, PYKV_TYPE_Q8_0, p->kv_type);
    if (p->kv_type_v != -1 && kv_format_of_type(p->kv_type_v) < 0)
        return pykv_error(PYKV_ERR_INVALID_ARG, "kv_type_v must be F16 (%d), F32 (%d), Q8_0 (%d) or -1 (as kv_type), "
                          "got %d", PYKV_TYPE_F16, PYKV_TYPE_F32, PYKV_TYPE_Q8_0, p->kv_type_v);
    if (p->n_threads < 0 || p->n_threads > 512)
        return pykv_error(PYKV_ERR_INVALID_ARG, "n_threads must be between 1 and 512 (or 0 for automatic), got %d", p->n_threads);
    if (p->budget < 0) return pykv_error(PYKV_ERR_INVALID_ARG, "budget must be positive, got %d", p->budget);
    if (!(p->budget_frac >= 0.0f && p->budget_frac <= 1.0f))
        return pykv_error(PYKV_ERR_INVALID_ARG, "budget fraction must be between 0 and 1, got %g", (double)p->budget_frac);
    if (!(p->rope_freq_base >= 0.0f && p->rope_freq_base <= 1e30f))
        return pykv_error(PYKV_ERR_INVALID_ARG, "rope_freq_base must be positive and finite (0 = the model's), got %g",
                          (double)p->rope_freq_base);
    if (!(p->rope_freq_scale >= 0.0f && p->rope_freq_scale <= 1e6f))
        return pykv_error(PYKV_ERR_INVALID_ARG, "rope_freq_scale must be positive and finite (0 = 1), got %g",
                          (double)p->rope_freq_scale);
    return PYKV_OK;
}

// The parameters' RoPE overrides: another base frequency, and linear position scaling folded
// into the frequencies (a token's angle is its position times inv_freq).
static void apply_rope_params(pykv_context *ctx, const struct pykv_context_params *p) {
    const struct hparams *hp = &ctx->model->hp;
    const float base = p->rope_freq_base > 0.0f ? p->rope_freq_base : hp->rope_freq_base;
    rope_inv_freq(ctx->buf.rope_inv_freq, hp->n_rot, base, ctx->model->rope_freqs);
    if (p->rope_freq_scale > 0.0f)
        for (int i = 0; i < hp->n_rot / 2; i++) ctx->buf.rope_inv_freq[i] *= p->rope_freq_scale;
}

// Make the policy from the parameters: evict_every_chunk comes out of its arguments (the
// configuration keeps them whole, as saved states identify the settings by them), and the
// budget rules of its descriptor go into its configuration.
static pykv_status init_policy(pykv_context *ctx, const struct policy_ops *ops, const struct pykv_context_params *p) {
    char *own_args = NULL;
    PYKV_TRY(policy_split_args(ops->name, ctx->policy_args, &own_args, &ctx->evict_every_chunk));
    if (ctx->evict_every_chunk && ops->keeps_every_entry) {
        free(own_args);
        return pykv_error(PYKV_ERR_INVALID_ARG, "the '%s' policy keeps every entry: evict_every_chunk does not apply",
                          ops->name);
    }
    struct policy_config cfg = { .budget = p->budget, .budget_frac = p->budget_frac, .window = p->window,
                                 .sink = p->sink, .args = own_args, .name = ops->name,
                                 .default_frac = ops->default_budget_frac, .default_min = ops->default_budget_min };
    pykv_status st = ops->init(&cfg, &ctx->policy);
    free(own_args);
    PYKV_TRY(st);
    cfg.args = ctx->policy_args;
    cfg.floor = policy_floor(ctx->policy);
    cfg.notices = &ctx->notices;
    ctx->policy->cfg = cfg;
    ctx->cache_bounded = !ops->keeps_every_entry && (ops->evicts_while_reading || ctx->evict_every_chunk);
    if (ctx->cache_bounded) ctx->policy->cfg.cap = ctx->n_ctx;
    return PYKV_OK;
}

static pykv_status context_setup(pykv_context *ctx, const struct pykv_context_params *p) {
    const struct hparams *hp = &ctx->model->hp;
    ctx->n_ctx = p->n_ctx ? (int32_t)p->n_ctx : hp->n_ctx_train;
    ctx->n_ubatch = p->n_ubatch ? (int32_t)p->n_ubatch : DEFAULT_N_UBATCH;
    ctx->buf.matmul.exact = p->exact_matmul != 0;
    if (ctx->n_ubatch > ctx->n_ctx) ctx->n_ubatch = ctx->n_ctx;
    int n_threads = p->n_threads ? p->n_threads : perf_physical_cores();
    ctx->pool = threadpool_create(n_threads);
    if (!ctx->pool) return PYKV_ERR_NOMEM;

    const struct policy_ops *ops = policy_find(p->policy ? p->policy : "full");
    if (!ops) return PYKV_ERR_INVALID_ARG;
    if (ops->keeps_every_entry && (p->budget > 0 || p->budget_frac > 0.0f))
        return pykv_error(PYKV_ERR_INVALID_ARG, "the '%s' policy keeps every entry: a budget does not apply to it "
                          "(choose an evicting policy, or give no budget)", ops->name);
    if (p->policy_args && !(ctx->policy_args = strdup(p->policy_args)))
        return pykv_error(PYKV_ERR_NOMEM, "out of memory");
    PYKV_TRY(init_policy(ctx, ops, p));

    // Lists may briefly hold a chunk's probe tokens on top of n_ctx entries.
    const int32_t type_v = p->kv_type_v == -1 ? p->kv_type : p->kv_type_v;
    PYKV_TRY(kv_cache_init(&ctx->cache, hp->n_layer, hp->n_head_kv, hp->head_dim, ctx->n_ctx + ctx->n_ubatch,
                           kv_format_of_type(p->kv_type), kv_format_of_type(type_v)));
    PYKV_TRY(alloc_scratch(ctx));
    apply_rope_params(ctx, p);
    return gpu_run_init(ctx);
}

static void context_destroy(pykv_context *ctx);

pykv_status pykv_context_init(pykv_model *model, const struct pykv_context_params *params, pykv_context **out) {
    pykv_clear_error();
    if (!out) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_context_init: out is NULL");
    *out = NULL;
    if (!model) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_context_init: model is NULL");
    struct pykv_context_params p;
    pykv_context_default_params(&p);
    if (params) p = *params;
    PYKV_TRY(validate_params(model, &p));
    pykv_context *ctx = calloc(1, sizeof(*ctx));
    if (!ctx) return pykv_error(PYKV_ERR_NOMEM, "out of memory");
    ctx->model = model;
    pykv_status st = context_setup(ctx, &p);
    if (st != PYKV_OK) {
        context_destroy(ctx);
        return st;
    }
    *out = ctx;
    return PYKV_OK;
}

// A nonzero value for the calling thread, unique among the threads alive: the address of a
// thread-local byte.
static uintptr_t context_thread_tag(void) {
    static _Thread_local char tag;
    return (uintptr_t)&tag;
}

static void context_destroy(pykv_context *ctx) {
    if (ctx->pool) threadpool_free(ctx->pool);
    if (ctx->policy) ctx->policy->ops->free(ctx->policy);
    kv_cache_free(&ctx->cache);
    gpu_run_free(ctx);   // after the cache: it gives the device memory the lists held back too
    free_scratch(&ctx->buf);
    free(ctx->logits);
    outputs_free(&ctx->out);
    free(ctx->chunk_start_n);
    free(ctx->policy_args);
    free(ctx->probe);
    free(ctx->chunk_tokens);
    free(ctx->run.held);
    free(ctx);
}

// Freeing a context that a pykv_decode or pykv_decode_step is using: from that call's own
// thread (its progress callback) the call frees it as it returns; from another thread the
// call is cancelled and the free waits for it to return, so the caller may free the model
// next. Between two steps of a begun decode nothing runs: the free is immediate.
void pykv_context_free(pykv_context *ctx) {
    if (!ctx) return;
    const uintptr_t owner = atomic_load(&ctx->decode_owner);
    if (owner == context_thread_tag()) {
        atomic_store(&ctx->free_pending, 1);
        atomic_store(&ctx->cancel, 1);
        return;
    }
    if (owner) {
        atomic_store(&ctx->cancel, 1);
        const struct timespec pause = { 0, 200 * 1000 };   // 0.2 ms: a layer takes longer
        while (atomic_load(&ctx->decode_owner)) nanosleep(&pause, NULL);
    }
    context_destroy(ctx);
}

pykv_status pykv_context_set_threads(pykv_context *ctx, int32_t n_threads) {
    if (!ctx || n_threads < 1 || n_threads > 512)
        return pykv_error(PYKV_ERR_INVALID_ARG, "n_threads must be between 1 and 512, got %d", n_threads);
    PYKV_TRY(context_refuse_busy(ctx, "pykv_context_set_threads"));
    if (n_threads == threadpool_size(ctx->pool)) return PYKV_OK;
    const struct hparams *hp = &ctx->model->hp;
    struct threadpool *pool = threadpool_create(n_threads);
    if (!pool) return PYKV_ERR_NOMEM;
    float *scores = calloc((size_t)n_threads * ctx->buf.scores_stride, sizeof(float));
    float *mm = calloc((size_t)n_threads * matmul_scratch_floats(matmul_max_cols(hp)), sizeof(float));
    float *flash = calloc((size_t)n_threads * ctx->buf.flash_work_stride, sizeof(float));
    if (!scores || !mm || !flash) {
        free(scores); free(mm); free(flash); threadpool_free(pool);
        return pykv_error(PYKV_ERR_NOMEM, "out of memory resizing the thread pool");
    }
    threadpool_free(ctx->pool);
    free(ctx->buf.scores);
    free(ctx->buf.matmul.dequant);
    free(ctx->buf.flash_work);
    ctx->pool = pool;
    ctx->buf.scores = scores;
    ctx->buf.matmul.dequant = mm;
    ctx->buf.flash_work = flash;
    return PYKV_OK;
}

int32_t context_list_limit(const pykv_context *ctx) {
    return ctx->policy->ops->needs & POLICY_NEEDS_STEP_ROOM ? ctx->n_ctx + 1 : ctx->n_ctx;
}

int32_t context_position_limit(const pykv_context *ctx) {
    return ctx->cache_bounded ? MAX_POSITION : ctx->n_ctx;
}

// A cache-bounded context: a prefill is cut back to the budget after every chunk, so any
// length goes through; a decode step needs room in its lists (n_ctx entries, or one more
// for a policy that evicts it again at once).
static pykv_status check_cache_room(const pykv_context *ctx, int32_t n) {
    if ((int64_t)ctx->n_past + n > MAX_POSITION)
        return pykv_error(PYKV_ERR_CONTEXT_FULL, "%d tokens after %d would pass position %d, the most pykv runs",
                          n, ctx->n_past, MAX_POSITION);
    if (n != 1) return PYKV_OK;
    int32_t most = 0;
    for (int i = 0; i < ctx->cache.n_layer * ctx->cache.n_head_kv; i++)
        if (ctx->cache.lists[i].n > most) most = ctx->cache.lists[i].n;
    if (most + n > context_list_limit(ctx))
        return pykv_error(PYKV_ERR_CONTEXT_FULL, "the KV cache is full: a list holds %d entries, n_ctx=%d (policy '%s' "
                          "lets decoding grow the cache)", most, ctx->n_ctx, ctx->policy->ops->name);
    return PYKV_OK;
}

static pykv_status check_tokens(const pykv_context *ctx, const pykv_token *tokens, int32_t n) {
    if (n < 0 || (n > 0 && !tokens)) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_decode: invalid token array");
    int32_t n_vocab = ctx->model->hp.n_vocab;
    for (int32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= n_vocab)
            return pykv_error(PYKV_ERR_INVALID_ARG, "token %d at index %d is out of range (vocabulary has %d tokens)",
                              tokens[i], i, n_vocab);
    if (ctx->cache_bounded) return check_cache_room(ctx, n);
    if ((int64_t)ctx->n_past + n > ctx->n_ctx)
        return pykv_error(PYKV_ERR_CONTEXT_FULL,
                          "%d tokens do not fit in the context: %d of n_ctx=%d are used, %d are free (policy '%s' "
                          "keeps the whole prompt until its end; take, or evict_every_chunk=1, read longer prompts)",
                          n, ctx->n_past, ctx->n_ctx, ctx->n_ctx - ctx->n_past, ctx->policy->ops->name);
    return PYKV_OK;
}

// Undo a chunk that failed half way: drop the entries it appended to every list.
static void rollback_chunk(pykv_context *ctx) {
    for (int i = 0; i < ctx->cache.n_layer * ctx->cache.n_head_kv; i++)
        kv_list_truncate(&ctx->cache, &ctx->cache.lists[i], ctx->chunk_start_n[i]);
}

static pykv_status run_hook(pykv_context *ctx, pykv_status (*hook)(struct kv_policy *, const struct policy_event *)) {
    if (!hook) return PYKV_OK;
    struct policy_event ev = ctx->event;
    ev.n_past = ctx->n_past;
    return hook(ctx->policy, &ev);
}

// The size of the next chunk: n_ubatch less room for the probe, except that the policy's
// observation window must arrive in one (the last) chunk, so the chunk before it is cut
// short when needed.
static int next_chunk_size(const pykv_context *ctx, int32_t remaining, int32_t n_probe) {
    int T = remaining < ctx->n_ubatch ? remaining : ctx->n_ubatch;
    if (T < remaining && T > ctx->n_ubatch - n_probe) T = ctx->n_ubatch - n_probe;
    const struct policy_ops *ops = ctx->policy->ops;
    if (T < remaining && ops->last_chunk_min) {
        int32_t need = ops->last_chunk_min(ctx->policy);
        if (need > ctx->n_ubatch) need = ctx->n_ubatch;
        if (remaining - T < need) T = remaining - need;
    }
    return T;
}

// The probe appended to the chunks of this call: the context's, or the call's last tokens.
static pykv_status choose_probe(pykv_context *ctx, const pykv_token *tokens, int32_t n_tokens,
                                const pykv_token **probe, int32_t *n_probe) {
    const struct policy_ops *ops = ctx->policy->ops;
    *probe = NULL;
    *n_probe = 0;
    if (n_tokens <= ctx->n_ubatch || !ops->probe_len) return PYKV_OK;   // one chunk: its tail is the probe
    int32_t n = ctx->probe ? ctx->n_probe_set : ops->probe_len(ctx->policy, n_tokens);
    if (n <= 0) return PYKV_OK;
    // A default probe (the call's tail) shrinks to fit small chunks; an explicit one must fit.
    if (!ctx->probe && n > ctx->n_ubatch / 4) n = ctx->n_ubatch / 4 > 0 ? ctx->n_ubatch / 4 : 1;
    if (n >= ctx->n_ubatch / 2)
        return pykv_error(PYKV_ERR_INVALID_ARG, "the probe (%d tokens) must be shorter than half the prefill chunk "
                          "(n_ubatch=%d)", n, ctx->n_ubatch);
    *probe = ctx->probe ? ctx->probe : tokens + n_tokens - n;
    *n_probe = n;
    return PYKV_OK;
}

pykv_status pykv_set_probe(pykv_context *ctx, const pykv_token *tokens, int32_t n_tokens) {
    if (!ctx) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_set_probe: ctx is NULL");
    PYKV_TRY(context_refuse_busy(ctx, "pykv_set_probe"));
    if (n_tokens < 0 || (n_tokens > 0 && !tokens)) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_set_probe: invalid token array");
    for (int32_t i = 0; i < n_tokens; i++)
        if (tokens[i] < 0 || tokens[i] >= ctx->model->hp.n_vocab)
            return pykv_error(PYKV_ERR_INVALID_ARG, "probe token %d at index %d is out of range", tokens[i], i);
    pykv_token *copy = NULL;
    if (n_tokens > 0) {
        copy = malloc((size_t)n_tokens * sizeof(pykv_token));
        if (!copy) return pykv_error(PYKV_ERR_NOMEM, "out of memory");
        memcpy(copy, tokens, (size_t)n_tokens * sizeof(pykv_token));
    }
    free(ctx->probe);
    ctx->probe = copy;
    ctx->n_probe_set = n_tokens;
    return PYKV_OK;
}

// The time a call took for its first n tokens goes into the timings; a call that stops early
// counts the chunks it finished, which stay evaluated.
static void add_timings(pykv_context *ctx, int is_prefill, int32_t n, double ms) {
    if (n == 0) return;
    if (is_prefill) { ctx->timings.t_prefill_ms += ms; ctx->timings.n_prefill += n; }
    else            { ctx->timings.t_decode_ms += ms;  ctx->timings.n_decode += n; }
}

static pykv_status refuse_owner(uintptr_t owner, const char *what) {
    if (!owner) return PYKV_OK;
    if (owner == context_thread_tag())
        return pykv_error(PYKV_ERR_INVALID_ARG, "%s: not while a decode runs on this context (from its progress "
                          "callback)", what);
    return pykv_error(PYKV_ERR_INVALID_ARG, "%s: another thread is running pykv_decode on this context (a "
                      "context is used by one thread at a time)", what);
}

static pykv_status refuse_unfinished(const pykv_context *ctx, const char *what) {
    if (!ctx->run.active) return PYKV_OK;
    return pykv_error(PYKV_ERR_INVALID_ARG, "%s: a decode begun with pykv_decode_begin is unfinished (%d of its %d "
                      "tokens evaluated): step it to its end, stop it with pykv_cancel and one more step, or "
                      "pykv_reset", what, ctx->run.done, ctx->run.n_tokens);
}

pykv_status context_refuse_busy(const pykv_context *ctx, const char *what) {
    PYKV_TRY(refuse_owner(atomic_load(&ctx->decode_owner), what));
    return refuse_unfinished(ctx, what);
}

// A call that runs the model holds the context for its thread; it refuses while another call
// holds it, or while a begun decode is unfinished (unless it steps that decode).
static pykv_status hold_context(pykv_context *ctx, const char *what, int steps_the_run) {
    uintptr_t idle = 0;
    if (!atomic_compare_exchange_strong(&ctx->decode_owner, &idle, context_thread_tag()))
        return refuse_owner(idle, what);
    const pykv_status st = steps_the_run ? PYKV_OK : refuse_unfinished(ctx, what);
    if (st != PYKV_OK) atomic_store(&ctx->decode_owner, 0);
    return st;
}

// The end of a call that held the context: it is idle again, or freed when the call's
// progress callback asked for that.
static pykv_status release_context(pykv_context *ctx, pykv_status st) {
    if (atomic_load(&ctx->free_pending)) {
        context_destroy(ctx);
        return pykv_error(PYKV_ERR_CANCELLED, "cancelled: the context was freed from the call's progress callback");
    }
    atomic_store(&ctx->decode_owner, 0);
    return st;
}

// Set up the chunk loop over tokens (checked, and kept where they are until the run ends).
static pykv_status run_begin(pykv_context *ctx, const pykv_token *tokens, int32_t n_tokens) {
    struct decode_run *r = &ctx->run;
    const pykv_token *probe = NULL;
    int32_t n_probe = 0;
    if (n_tokens > 0) {
        PYKV_TRY(choose_probe(ctx, tokens, n_tokens, &probe, &n_probe));
        PYKV_TRY(outputs_reserve(&ctx->out, n_tokens, ctx->model->hp.n_vocab, ctx->model->hp.n_embd));
    }
    r->active = 1;
    r->tokens = tokens;
    r->n_tokens = n_tokens;
    r->done = 0;
    r->probe = probe;
    r->n_probe = n_probe;
    r->is_prefill = n_tokens > 1;
    r->was_empty = ctx->n_past == 0;
    r->ms = 0.0;
    if (n_tokens == 0) return PYKV_OK;   // the first step ends it

    ctx->has_logits = 0;   // until the last chunk has run
    ctx->event = (struct policy_event){ .cache = &ctx->cache, .hp = &ctx->model->hp, .pool = ctx->pool,
                                        .layer = -1, .n_prompt = n_tokens, .n_past_end = ctx->n_past + n_tokens };
    ctx->single_run = 0;   // until this call completes on an empty context
    const int32_t n_train = ctx->model->hp.n_ctx_train;
    if (ctx->n_past + n_tokens > n_train)
        policy_notice(&ctx->notices, NOTICE_TRAIN_CTX, "the sequence passes the model's training context (%d tokens): "
                      "the model runs on positions it never saw, and its output may degrade", n_train);
    return PYKV_OK;
}

// The run is over with status st: the time of its finished chunks goes into the timings.
static pykv_status run_end(pykv_context *ctx, pykv_status st) {
    struct decode_run *r = &ctx->run;
    add_timings(ctx, r->is_prefill, r->done, r->ms);
    r->active = 0;
    r->tokens = NULL;
    r->probe = NULL;
    return st;
}

// The policy's scoring passes over the tokens read since the cache was last compressed: each
// runs as a chunk of probe tokens only, at the positions after the sequence, and leaves no
// entry behind (scoring_pass in policy.h).
static pykv_status run_scoring_passes(pykv_context *ctx, int32_t first) {
    const struct decode_run *r = &ctx->run;
    int32_t longest = 0;
    for (int i = 0; i < ctx->cache.n_layer * ctx->cache.n_head_kv; i++)
        if (ctx->cache.lists[i].n > longest) longest = ctx->cache.lists[i].n;
    const int32_t room = ctx->cache.max_entries - longest;
    const struct policy_replay in = { .model = ctx->model, .tokens = r->tokens + first, .n_tokens = r->done - first,
                                      .n_past = ctx->n_past, .cap = room < ctx->n_ubatch ? room : ctx->n_ubatch };
    for (int32_t i = 0;; i++) {
        int32_t n = 0;
        PYKV_TRY(ctx->policy->ops->scoring_pass(ctx->policy, &in, i, ctx->chunk_tokens, &n));
        if (n <= 0) return PYKV_OK;
        if (n > in.cap) return pykv_error(PYKV_ERR_INTERNAL, "policy '%s': a scoring pass of %d tokens passes its "
                                          "room of %d", ctx->policy->ops->name, n, in.cap);
        PYKV_TRY(forward_chunk(ctx, ctx->chunk_tokens, n, n, 0));
    }
}

// The run's next chunk, with the policy's hooks and the progress callback after it:
// PYKV_PENDING while chunks remain, PYKV_OK once the last is done, or an error that ends the
// run (a failed or cancelled chunk is rolled back; the chunks before it stay).
static pykv_status run_step(pykv_context *ctx) {
    struct decode_run *r = &ctx->run;
    if (r->n_tokens == 0) return run_end(ctx, PYKV_OK);
    const struct policy_ops *ops = ctx->policy->ops;
    const double t0 = perf_now_ms();
    const int T = next_chunk_size(ctx, r->n_tokens - r->done, r->n_probe);
    const int last = r->done + T == r->n_tokens, p = last ? 0 : r->n_probe;
    // with evict_every_chunk the policy compresses after every chunk as after a call's last
    ctx->event.is_last_chunk = last || (r->is_prefill && ctx->evict_every_chunk);
    ctx->event.is_first_chunk = r->done == 0;
    memcpy(ctx->chunk_tokens, r->tokens + r->done, (size_t)T * sizeof(pykv_token));
    if (p) memcpy(ctx->chunk_tokens + T, r->probe, (size_t)p * sizeof(pykv_token));
    for (int i = 0; i < ctx->cache.n_layer * ctx->cache.n_head_kv; i++) ctx->chunk_start_n[i] = ctx->cache.lists[i].n;
    ctx->cache.device_ahead = ops->keeps_every_entry ? r->n_tokens - r->done - T : 0;
    pykv_status st = forward_chunk(ctx, ctx->chunk_tokens, T + p, p, last);
    ctx->cache.device_ahead = 0;
    if (st != PYKV_OK) {
        rollback_chunk(ctx);
        ctx->has_logits = 0;
        ctx->out.n = 0;
        if (st == PYKV_ERR_CANCELLED) atomic_store(&ctx->cancel, 0);   // reported: no longer pending
        return run_end(ctx, st);
    }
    ctx->n_past += T;
    r->done += T;
    if (r->is_prefill && ctx->event.is_last_chunk && ops->scoring_pass) {
        st = run_scoring_passes(ctx, ctx->evict_every_chunk ? r->done - T : 0);
        if (st != PYKV_OK) {   // the chunk is undone, as one that failed
            ctx->n_past -= T;
            r->done -= T;
            rollback_chunk(ctx);
            ctx->has_logits = 0;
            ctx->out.n = 0;
            if (st == PYKV_ERR_CANCELLED) atomic_store(&ctx->cancel, 0);
            return run_end(ctx, st);
        }
    }
    pykv_status hook = r->is_prefill ? run_hook(ctx, ops->after_chunk) : PYKV_OK;
    r->ms += perf_now_ms() - t0;   // the chunk and its hook; the progress callback is the caller's time
    if (hook != PYKV_OK) {
        ctx->out.n = 0;
        return run_end(ctx, hook);
    }
    if (r->is_prefill && ctx->progress && !ctx->progress(r->done, r->n_tokens, ctx->progress_user))
        atomic_store(&ctx->cancel, 1);   // stops the next chunk, or is reported below
    if (!last) return PYKV_PENDING;

    const double t_hook = perf_now_ms();
    hook = run_hook(ctx, r->is_prefill ? ops->after_prefill : ops->after_decode);
    r->ms += perf_now_ms() - t_hook;
    if (hook != PYKV_OK) {
        ctx->out.n = 0;
        return run_end(ctx, hook);
    }
    ctx->single_run = r->was_empty;
    // a cancel that arrived while the last chunk ran (which a layer-by-layer policy does not
    // stop half way) is still reported, so a generation loop stops here
    if (atomic_exchange(&ctx->cancel, 0))
        return run_end(ctx, pykv_error(PYKV_ERR_CANCELLED, "cancelled (after the call's last chunk: its tokens were "
                                       "evaluated)"));
    return run_end(ctx, PYKV_OK);
}

pykv_status pykv_decode(pykv_context *ctx, const pykv_token *tokens, int32_t n_tokens) {
    pykv_clear_error();
    if (!ctx) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_decode: ctx is NULL");
    PYKV_TRY(hold_context(ctx, "pykv_decode", 0));
    ctx->out.n = 0;   // the rows are this call's, or none when it fails
    pykv_status st = check_tokens(ctx, tokens, n_tokens);
    if (st == PYKV_OK) st = run_begin(ctx, tokens, n_tokens);   // the caller's tokens: they outlive the call
    if (st == PYKV_OK)
        do st = run_step(ctx); while (st == PYKV_PENDING);
    return release_context(ctx, st);
}

// The begun decode's own copy of its tokens, in a buffer that grows to the longest call's.
static pykv_status hold_tokens(pykv_context *ctx, const pykv_token *tokens, int32_t n_tokens) {
    struct decode_run *r = &ctx->run;
    if (n_tokens > r->held_cap) {
        pykv_token *held = realloc(r->held, (size_t)n_tokens * sizeof(pykv_token));
        if (!held) return pykv_error(PYKV_ERR_NOMEM, "out of memory holding %d tokens", n_tokens);
        r->held = held;
        r->held_cap = n_tokens;
    }
    if (n_tokens > 0) memcpy(r->held, tokens, (size_t)n_tokens * sizeof(pykv_token));
    return PYKV_OK;
}

pykv_status pykv_decode_begin(pykv_context *ctx, const pykv_token *tokens, int32_t n_tokens) {
    pykv_clear_error();
    if (!ctx) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_decode_begin: ctx is NULL");
    PYKV_TRY(hold_context(ctx, "pykv_decode_begin", 0));
    ctx->out.n = 0;
    pykv_status st = check_tokens(ctx, tokens, n_tokens);
    if (st == PYKV_OK) st = hold_tokens(ctx, tokens, n_tokens);
    if (st == PYKV_OK) st = run_begin(ctx, ctx->run.held, n_tokens);
    return release_context(ctx, st);
}

pykv_status pykv_decode_step(pykv_context *ctx, int32_t *n_done) {
    pykv_clear_error();
    if (n_done) *n_done = 0;
    if (!ctx) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_decode_step: ctx is NULL");
    PYKV_TRY(hold_context(ctx, "pykv_decode_step", 1));
    if (!ctx->run.active)
        return release_context(ctx, pykv_error(PYKV_ERR_INVALID_ARG, "pykv_decode_step: no decode is begun "
                               "(pykv_decode_begin first; the step that returned PYKV_OK or an error ended the last one)"));
    const pykv_status st = run_step(ctx);
    if (n_done) *n_done = ctx->run.done;   // read before a free from the progress callback
    return release_context(ctx, st);
}

int32_t pykv_decode_pending(const pykv_context *ctx) {
    return ctx && ctx->run.active;
}

const float *pykv_get_logits(pykv_context *ctx) { return ctx && ctx->has_logits ? ctx->logits : NULL; }

int32_t pykv_n_past(const pykv_context *ctx) { return ctx ? ctx->n_past : 0; }

int32_t pykv_n_ctx(const pykv_context *ctx) { return ctx ? ctx->n_ctx : 0; }

int32_t pykv_cache_bounded(const pykv_context *ctx) { return ctx ? ctx->cache_bounded : 0; }

const char *pykv_take_warning(pykv_context *ctx) {
    if (!ctx || ctx->notices.taken >= ctx->notices.n) return NULL;
    return ctx->notices.text[ctx->notices.taken++];
}

int32_t pykv_is_single_run(const pykv_context *ctx) {
    return ctx && (ctx->policy->ops->keeps_every_entry || ctx->n_past == 0 || ctx->single_run);
}

void pykv_reset(pykv_context *ctx) {
    if (!ctx || refuse_owner(atomic_load(&ctx->decode_owner), "pykv_reset") != PYKV_OK) return;   // the error says why
    if (ctx->run.active) run_end(ctx, PYKV_OK);   // a begun decode ends: its tokens are forgotten too
    kv_cache_clear(&ctx->cache);
    if (ctx->policy->ops->reset) ctx->policy->ops->reset(ctx->policy);
    ctx->n_past = 0;
    ctx->has_logits = 0;
    ctx->out.n = 0;
    atomic_store(&ctx->cancel, 0);
}

pykv_status pykv_truncate(pykv_context *ctx, int32_t n_keep) {
    pykv_clear_error();
    if (!ctx) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_truncate: ctx is NULL");
    PYKV_TRY(context_refuse_busy(ctx, "pykv_truncate"));
    if (n_keep < 0 || n_keep > ctx->n_past)
        return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_truncate: n_keep %d is outside 0..%d (the tokens evaluated)",
                          n_keep, ctx->n_past);
    if (n_keep == 0) {
        pykv_reset(ctx);
        return PYKV_OK;
    }
    // refused even when nothing would be cut, so that a caller learns it on any call
    if (!ctx->policy->ops->keeps_every_entry)
        return pykv_error(PYKV_ERR_INVALID_ARG,
                          "pykv_truncate: the '%s' policy compresses the cache with the later tokens in view, so "
                          "it cannot be cut back to a prefix; reset and evaluate the prefix again",
                          ctx->policy->ops->name);
    pykv_status status = PYKV_OK;
    if (n_keep < ctx->n_past) {
        status = kv_cache_keep_prefix(&ctx->cache, n_keep);   // the lists are cut whatever it says
        ctx->n_past = n_keep;
        ctx->has_logits = 0;
        ctx->out.n = 0;
    }
    atomic_store(&ctx->cancel, 0);
    return status;
}

void pykv_cancel(pykv_context *ctx) {
    if (ctx) atomic_store(&ctx->cancel, 1);
}

void pykv_set_progress_callback(pykv_context *ctx, pykv_progress_callback callback, void *user_data) {
    if (!ctx) return;
    ctx->progress = callback;
    ctx->progress_user = user_data;
}

pykv_status pykv_kv_stats(const pykv_context *ctx, struct pykv_kv_stats *s) {
    if (!ctx || !s) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_kv_stats: NULL argument");
    if (s->struct_size != sizeof(*s)) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_kv_stats.struct_size mismatch");
    s->entries = kv_cache_entries(&ctx->cache);
    s->bytes = ctx->cache.bytes;
    s->peak_bytes = ctx->cache.peak_bytes;
    s->evicted = ctx->cache.evicted;
    s->merged = ctx->cache.merged;
    s->n_layer = ctx->cache.n_layer;
    s->n_head_kv = ctx->cache.n_head_kv;
    s->policy = ctx->policy->ops->name;
    s->kv_type = kv_format_type(ctx->cache.fmt_k);
    s->kv_type_v = kv_format_type(ctx->cache.fmt_v);
    s->device_bytes = ctx->cache.device_bytes;
    return PYKV_OK;
}

int32_t pykv_kv_head_entries(const pykv_context *ctx, int32_t layer, int32_t head) {
    if (!ctx || layer < 0 || layer >= ctx->cache.n_layer || head < 0 || head >= ctx->cache.n_head_kv) return -1;
    return ctx->cache.lists[(size_t)layer * ctx->cache.n_head_kv + head].n;
}

pykv_status pykv_kv_head_positions(const pykv_context *ctx, int32_t layer, int32_t head, pykv_pos *out,
                                   int32_t cap, int32_t *n_out) {
    int32_t n = pykv_kv_head_entries(ctx, layer, head);
    if (n < 0 || !n_out) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_kv_head_positions: no list (%d, %d)", layer, head);
    *n_out = n;
    if (!out || cap < n) return PYKV_ERR_BUFFER_TOO_SMALL;
    memcpy(out, ctx->cache.lists[(size_t)layer * ctx->cache.n_head_kv + head].pos, (size_t)n * sizeof(pykv_pos));
    return PYKV_OK;
}

void pykv_get_timings(const pykv_context *ctx, struct pykv_timings *t) {
    if (!ctx || !t) return;
    *t = ctx->timings;
    t->struct_size = sizeof(*t);
}

void pykv_reset_timings(pykv_context *ctx) {
    if (ctx) memset(&ctx->timings, 0, sizeof(ctx->timings));
}
