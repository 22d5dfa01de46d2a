// forward-gpu.c - the offloaded layers of the forward pass (forward-gpu.h).
//
// A layer reads as forward.c's CPU layer does: RMSNorm -> Q,K,V -> RoPE -> append K/V to each
// KV head's list -> attention over each list -> output projection -> residual -> RMSNorm ->
// SwiGLU FFN -> residual. Every step is a kernel on the context's stream; the host only
// keeps the lists' bookkeeping (lengths and positions) and waits once per chunk. A decode
// step, whose dozens of small kernels per layer cost more to launch than to run on a small
// model, is recorded once as a CUDA graph and replayed (PYKV_CUDA_GRAPHS=0 turns that off).
// Each step is named on the stream (cuda_timing_mark) for PYKV_CUDA_TIMINGS' table of where
// the GPU's time goes (ggml-cuda/timing.h).
#include "graph/forward-gpu.h"
#include "core/error.h"
#include "core/log.h"
#include "model/offload.h"

#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"
#include "ggml-cuda/kernels.h"
#include "ggml-cuda/timing.h"
#include "kv/kv-device.h"
#include "kv/policies/common/window-scores.h"
#include "graph/attention-schedule.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// The head sizes the attention kernels take.
#define GPU_MAX_HEAD_DIM 256

struct gpu_run {
    cuda_stream stream;
    int         first_layer;
    const char *policy_name;   // the policy's (static) name, for the table of PYKV_CUDA_TIMINGS
    void       *arena;     // one allocation holds every buffer below
    size_t      bytes;
    float      *x, *xb;    // (n_ubatch, n_embd)
    float      *q, *att;   // (n_ubatch, n_head * head_dim)
    float      *k, *v;     // (n_ubatch, n_head_kv * head_dim)
    float      *gate, *up; // (n_ubatch, n_ff)
    float      *rope_cs;   // (n_ubatch, n_rot)
    float      *logits;    // (n_vocab)
    void       *xq;        // a decode step's activations quantised to Q8_1 (the fused path)
    void       *matmul_work;
    void       *attn_work;
    // A decode step recorded as a CUDA graph (record_decode), run again at every step while
    // the lists stay where they are: it reads its inputs from pinned host memory (the
    // token's residual stream, its RoPE table, every offloaded list's length) when it runs.
    int         graphs;        // 0: PYKV_CUDA_GRAPHS=0, or a recording failed
    cuda_graph  graph;
    int64_t     graph_moves;   // the cache's device_moves when it was recorded
    int32_t    *lens;          // (offloaded layers * n_head_kv) the lists' lengths, device
    float      *h_x;           // pinned: (n_embd)
    float      *h_cs;          // pinned: (n_rot)
    int32_t    *h_lens;        // pinned: as lens
    // A recorded step of a policy that takes a decode step's attention sums (h2o, tova, cake)
    // also computes them (cuda_decode_probs after each layer's attention): n_head rows of
    // sums_stride floats per offloaded layer, brought back with the logits, so that the hooks
    // run once the step is done. The stride is the lists' largest room when recorded: a list
    // that outgrows it moves, and the step is recorded again.
    float      *sums;          // device
    float      *h_sums;        // pinned
    size_t      sums_bytes;    // of each
    int64_t     sums_stride;   // 0: the recorded step computes no sums
};

// The most memory the recorded step's sums may take (each of device and pinned host); a
// policy whose lists are longer decodes layer by layer instead.
#define GPU_STEP_SUMS_MAX_BYTES ((size_t)64 << 20)

int gpu_first_layer(const pykv_context *ctx) {
    return ctx->gpu ? ctx->gpu->first_layer : ctx->model->hp.n_layer;
}

// Why this context cannot run the model's GPU layers there, or NULL when it can.
static const char *gpu_refusal(const pykv_context *ctx, char *buf, size_t cap) {
    const struct hparams *hp = &ctx->model->hp;
    const struct policy_ops *ops = ctx->policy->ops;
    if (!policy_runs_on_gpu(ops))
        snprintf(buf, cap, "the '%s' policy does not run on the GPU: this context runs every layer on the CPU",
                 ops->name);
    else if (ctx->buf.matmul.exact)
        snprintf(buf, cap, "exact_matmul runs on the CPU: this context runs every layer there");
    else if (hp->n_head_kv > CUDA_MAX_KV_HEADS || hp->head_dim > GPU_MAX_HEAD_DIM)
        snprintf(buf, cap, "the CUDA kernels take up to %d KV heads of up to %d values; this model has %d of %d: "
                 "every layer runs on the CPU", CUDA_MAX_KV_HEADS, GPU_MAX_HEAD_DIM, hp->n_head_kv, hp->head_dim);
    else
        return NULL;
    return buf;
}

static int32_t offloaded_lists(const pykv_context *ctx) {
    return (ctx->model->hp.n_layer - ctx->model->gpu->first_layer) * ctx->model->hp.n_head_kv;
}

static size_t max_size(size_t a, size_t b) { return a > b ? a : b; }

// Lay out (or, with base set, place) the buffers one after another, 256-byte aligned.
static size_t place_buffers(struct gpu_run *g, const pykv_context *ctx, char *base) {
    const struct hparams *hp = &ctx->model->hp;
    const size_t U = (size_t)ctx->n_ubatch, hd = (size_t)hp->head_dim;
    int64_t max_cols = hp->n_embd;
    if ((int64_t)hp->n_head * hp->head_dim > max_cols) max_cols = (int64_t)hp->n_head * hp->head_dim;
    if (hp->n_ff > max_cols) max_cols = hp->n_ff;
    const struct { void **at; size_t bytes; } bufs[] = {
        { (void **)&g->x, U * hp->n_embd * sizeof(float) },
        { (void **)&g->xb, U * hp->n_embd * sizeof(float) },
        // q and gate also take a decode step's whole q|k|v and gate|up rows (decode_layer)
        { (void **)&g->q, max_size(U * hp->n_head * hd, (size_t)(hp->n_head + 2 * hp->n_head_kv) * hd) * sizeof(float) },
        { (void **)&g->att, U * hp->n_head * hd * sizeof(float) },
        { (void **)&g->k, U * hp->n_head_kv * hd * sizeof(float) },
        { (void **)&g->v, U * hp->n_head_kv * hd * sizeof(float) },
        { (void **)&g->gate, max_size(U * hp->n_ff, 2 * (size_t)hp->n_ff) * sizeof(float) },
        { (void **)&g->up, U * hp->n_ff * sizeof(float) },
        { (void **)&g->rope_cs, U * hp->n_rot * sizeof(float) },
        { (void **)&g->logits, (size_t)hp->n_vocab * sizeof(float) },
        { (void **)&g->lens, (size_t)offloaded_lists(ctx) * sizeof(int32_t) },
        { &g->xq, cuda_q8_1_bytes(max_cols, 1) },
        { &g->matmul_work, cuda_matmul_work_bytes(max_cols, ctx->n_ubatch) },
        { &g->attn_work, cuda_attention_decode_work_bytes(hp->n_head, hp->head_dim, ctx->cache.max_entries) },
    };
    size_t used = 0;
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) {
        if (base) *bufs[i].at = base + used;
        used += cuda_align(bufs[i].bytes);
    }
    return used;
}

pykv_status gpu_run_init(pykv_context *ctx) {
    const struct model_gpu *mg = ctx->model->gpu;
    if (!mg) return PYKV_OK;
    char why[256];
    if (gpu_refusal(ctx, why, sizeof(why))) {
        policy_notice(&ctx->notices, NOTICE_GPU, "%s", why);
        return PYKV_OK;
    }
    PYKV_TRY(cuda_set_device(mg->device));
    struct gpu_run *g = calloc(1, sizeof(*g));
    if (!g) return pykv_error(PYKV_ERR_NOMEM, "out of memory");
    const struct hparams *hp = &ctx->model->hp;
    g->first_layer = mg->first_layer;
    g->policy_name = ctx->policy->ops->name;
    const char *graphs = getenv("PYKV_CUDA_GRAPHS");
    g->graphs = !(graphs && graphs[0] == '0');
    g->bytes = place_buffers(g, ctx, NULL);
    void *pinned = NULL;
    const size_t pinned_bytes = ((size_t)hp->n_embd + hp->n_rot + (size_t)offloaded_lists(ctx)) * 4;
    pykv_status st = cuda_alloc(&g->arena, g->bytes, "the context's activations");
    if (st == PYKV_OK) st = cuda_host_alloc(&pinned, pinned_bytes);
    if (st == PYKV_OK) st = cuda_stream_create(&g->stream);
    if (st != PYKV_OK) {
        cuda_host_free(pinned);
        cuda_free(g->arena);
        free(g);
        return st;
    }
    place_buffers(g, ctx, g->arena);
    g->h_x = pinned;
    g->h_cs = g->h_x + hp->n_embd;
    g->h_lens = (int32_t *)(g->h_cs + hp->n_rot);
    ctx->gpu = g;
    kv_cache_set_device(&ctx->cache, g->first_layer, mg->device, g->stream);
    return PYKV_OK;
}

void gpu_run_free(pykv_context *ctx) {
    struct gpu_run *g = ctx->gpu;
    if (!g) return;
    cuda_stream_sync(g->stream);   // the lists' memory, freed on the stream, is back in the pool
    cuda_pool_trim();              // and goes back to the device
    cuda_graph_free(g->graph);
    if (cuda_timings_on()) {
        char title[96];
        snprintf(title, sizeof(title), "policy %s, layers %d to %d of %d", g->policy_name, g->first_layer,
                 ctx->model->hp.n_layer - 1, ctx->model->hp.n_layer);
        cuda_timing_report(g->stream, title);
    }
    cuda_stream_destroy(g->stream);
    cuda_host_free(g->h_x);
    cuda_host_free(g->h_sums);
    cuda_free(g->sums);
    cuda_free(g->arena);
    free(g);
    ctx->gpu = NULL;
}

static void matmul_gpu(struct gpu_run *g, float *out, const struct gpu_tensor *w, const float *x, int T) {
    cuda_matmul(g->stream, out, w->data, w->type, w->ne[0], w->ne[1], x, T, g->matmul_work);
}

// The products of one input x (cols values a row): x made ready for them once (cuda_matmul_stage),
// then each weight's product (matmul_staged).
static void matmul_stage(struct gpu_run *g, const float *x, int64_t cols, int T) {
    cuda_matmul_stage(g->stream, g->matmul_work, x, cols, T);
}
static void matmul_staged(struct gpu_run *g, float *out, const struct gpu_tensor *w, const float *x, int T) {
    cuda_matmul_staged(g->stream, out, w->data, w->type, w->ne[0], w->ne[1], x, T, g->matmul_work);
}

// A decode step's layer when its products can share quantised activations (decode_fused):
// the same steps as enqueue_layer in fewer kernels. The norms, SwiGLU and the attention's
// merge write Q8_1 activations directly, q|k|v and gate|up are one product each (their
// weights stored back to back, offload.h), and the output and down products add into the
// residual stream.
static int decode_fused(const struct gpu_layer *w) {
    return w->wqkv.data && w->w_gate_up.data && cuda_type_quantised(w->wo.type) && cuda_type_quantised(w->w_down.type);
}

static void decode_layer(struct gpu_run *g, const pykv_model *m, int layer, const struct cuda_kv_layer *before,
                         const struct cuda_kv_layer *after) {
    const struct hparams *hp = &m->hp;
    const struct gpu_layer *w = model_gpu_layer(m, layer);
    const cuda_stream s = g->stream;
    const int dim = hp->n_embd, hd = hp->head_dim, q_dim = hp->n_head * hd, kv_dim = hp->n_head_kv * hd;
    float *q = g->q, *k = q + q_dim, *v = k + kv_dim, *gate = g->gate, *up = gate + hp->n_ff;

    // attention
    cuda_timing_mark(s, "norm");
    cuda_rmsnorm_q8_1(s, g->xq, g->x, w->attn_norm, dim, 1, hp->rms_eps);
    cuda_timing_mark(s, "q|k|v product");
    cuda_matvec_q8_pre(s, q, w->wqkv.data, w->wqkv.type, dim, w->wqkv.ne[1], g->xq, 1, 0);
    cuda_timing_mark(s, "rope, kv append");
    cuda_rope_kv_append(s, before, q, hp->n_head, k, v, 1, hp->n_rot, g->rope_cs);
    cuda_timing_mark(s, "attention");
    cuda_attention_decode(s, after, q, hp->n_head, g->att, g->xq, g->attn_work);
    cuda_timing_mark(s, "output product");
    cuda_matvec_q8_pre(s, g->x, w->wo.data, w->wo.type, q_dim, dim, g->xq, 1, 1);

    // feed-forward
    cuda_timing_mark(s, "norm");
    cuda_rmsnorm_q8_1(s, g->xq, g->x, w->ffn_norm, dim, 1, hp->rms_eps);
    cuda_timing_mark(s, "gate|up product");
    cuda_matvec_q8_pre(s, gate, w->w_gate_up.data, w->w_gate_up.type, dim, w->w_gate_up.ne[1], g->xq, 1, 0);
    cuda_timing_mark(s, "swiglu");
    cuda_swiglu_q8_1(s, g->xq, gate, up, hp->n_ff, 1);
    cuda_timing_mark(s, "down product");
    cuda_matvec_q8_pre(s, g->x, w->w_down.data, w->w_down.type, hp->n_ff, dim, g->xq, 1, 1);
}

// One layer's kernels over the T tokens in g->x: `before` gives the lists' lengths before
// the chunk (where its keys and values go), `after` with them (what attention reads).
static void enqueue_layer(struct gpu_run *g, const pykv_model *m, int layer, int T,
                          const struct cuda_kv_layer *before, const struct cuda_kv_layer *after) {
    const struct hparams *hp = &m->hp;
    const struct gpu_layer *w = model_gpu_layer(m, layer);
    const cuda_stream s = g->stream;
    const int dim = hp->n_embd;
    if (T == 1 && decode_fused(w)) {
        decode_layer(g, m, layer, before, after);
        return;
    }

    // attention
    cuda_timing_mark(s, "norm");
    cuda_rmsnorm(s, g->xb, g->x, w->attn_norm, dim, T, hp->rms_eps);
    cuda_timing_mark(s, "q|k|v product");
    matmul_stage(g, g->xb, dim, T);
    matmul_staged(g, g->q, &w->wq, g->xb, T);
    matmul_staged(g, g->k, &w->wk, g->xb, T);
    matmul_staged(g, g->v, &w->wv, g->xb, T);
    cuda_timing_mark(s, "rope, kv append");
    cuda_rope_kv_append(s, before, g->q, hp->n_head, g->k, g->v, T, hp->n_rot, g->rope_cs);
    cuda_timing_mark(s, "attention");
    if (T == 1) cuda_attention_decode(s, after, g->q, hp->n_head, g->att, NULL, g->attn_work);
    else cuda_attention_prefill(s, after, g->q, hp->n_head, T, g->att);
    cuda_timing_mark(s, "output product");
    matmul_gpu(g, g->xb, &w->wo, g->att, T);
    cuda_timing_mark(s, "residual");
    cuda_add(s, g->x, g->xb, (int64_t)T * dim);

    // feed-forward
    cuda_timing_mark(s, "norm");
    cuda_rmsnorm(s, g->xb, g->x, w->ffn_norm, dim, T, hp->rms_eps);
    cuda_timing_mark(s, "gate|up product");
    matmul_stage(g, g->xb, dim, T);
    matmul_staged(g, g->gate, &w->w_gate, g->xb, T);
    matmul_staged(g, g->up, &w->w_up, g->xb, T);
    cuda_timing_mark(s, "swiglu");
    cuda_swiglu(s, g->gate, g->gate, g->up, (int64_t)T * hp->n_ff);
    cuda_timing_mark(s, "down product");
    matmul_gpu(g, g->xb, &w->w_down, g->gate, T);
    cuda_timing_mark(s, "residual");
    cuda_add(s, g->x, g->xb, (int64_t)T * dim);
}

// The classifier over the last of the T tokens, into g->logits.
static void enqueue_logits(struct gpu_run *g, const pykv_model *m, int T) {
    const struct model_gpu *mg = m->gpu;
    const int dim = m->hp.n_embd;
    cuda_timing_mark(g->stream, "classifier");
    cuda_rmsnorm(g->stream, g->xb, g->x + (size_t)(T - 1) * dim, mg->output_norm, dim, 1, m->hp.rms_eps);
    matmul_gpu(g, g->logits, &mg->out, g->xb, 1);
}

// Whether a chunk of T tokens gives the hooks attention sums (forward.c's rule).
static int hooks_take_sums(const struct policy_ops *ops, int T) {
    return policy_needs_sums(ops) && (T == 1 || (ops->needs & POLICY_NEEDS_ATTENTION_SUMS));
}

// The hooks as forward.c calls them: after_layer, then on a decode step decode_list for each
// list in turn.
static pykv_status run_hooks(pykv_context *ctx, const struct policy_event *ev) {
    const struct policy_ops *ops = ctx->policy->ops;
    if (ops->after_layer) PYKV_TRY(ops->after_layer(ctx->policy, ev));
    for (int g = 0; ev->T == 1 && ev->n_prompt == 1 && ops->decode_list && g < ctx->model->hp.n_head_kv; g++)
        PYKV_TRY(ops->decode_list(ctx->policy, ev, g));
    return PYKV_OK;
}

// The sums of a prompt's last chunk's window of queries (the policy's last_chunk_min rows),
// computed on the device, into *window (freed by the caller) and ev->window_sums.
static pykv_status window_sums_device(pykv_context *ctx, struct policy_event *ev, float **window) {
    const struct policy_ops *ops = ctx->policy->ops;
    *window = NULL;
    if (!ops->last_chunk_min) return PYKV_OK;
    const int32_t w = ops->last_chunk_min(ctx->policy), rows = w < ev->T ? w : ev->T;
    if (rows <= 0) return PYKV_OK;
    if (!(*window = malloc((size_t)ctx->model->hp.n_head * ctx->buf.colsum_stride * sizeof(float))))
        return pykv_error(PYKV_ERR_NOMEM, "out of memory for the attention sums of layer %d", ev->layer);
    const pykv_status st = ws_attention_sums_device(ev, rows, *window, ctx->buf.colsum_stride);
    if (st != PYKV_OK) {
        free(*window);
        *window = NULL;
        return st;
    }
    ev->window_sums = *window;
    ev->window_rows = rows;
    return PYKV_OK;
}

// A policy with host_lists (EMS) sees the layer as the CPU's hooks do: its lists, the chunk's
// queries (in ctx->buf.q) and the attention sums in host memory, the lists going back after.
// A prefill chunk's sums come from the device (merged entries expanded), a decode step's from
// the CPU over the staged lists.
static pykv_status host_layer_hook(pykv_context *ctx, struct policy_event *ev, int n_probe, const float *d_q) {
    const struct policy_ops *ops = ctx->policy->ops;
    const struct hparams *hp = &ctx->model->hp;
    const int T = ev->T;
    struct kv_staged saved[CUDA_MAX_KV_HEADS];
    if (!d_q) return pykv_error(PYKV_ERR_INTERNAL, "the '%s' policy's hooks need the layer's queries", ops->name);
    const int sums = hooks_take_sums(ops, T), sums_on_device = sums && T > 1;
    if (sums_on_device) PYKV_TRY(ws_attention_sums_device(ev, T, ctx->buf.attn_colsum, ctx->buf.colsum_stride));
    float *window = NULL;   // the window's own sums (policy_event.window_sums)
    if (sums_on_device && ev->is_last_chunk) PYKV_TRY(window_sums_device(ctx, ev, &window));
    pykv_status st = ws_query_rows(ev, 0, T, ctx->buf.q);
    if (st == PYKV_OK) st = kv_layer_stage(&ctx->cache, ev->layer, saved);
    if (st != PYKV_OK) {
        free(window);
        return st;
    }
    ev->q = ctx->buf.q;
    ev->q_device = NULL;
    ev->probe.q = n_probe ? ctx->buf.q + (size_t)(T - n_probe) * hp->n_head * hp->head_dim : NULL;
    if (sums) {
        if (!sums_on_device) prefill_attention_sums(ctx, ev->layer, T);   // the CPU's over the staged lists
        ev->attn_colsum = ctx->buf.attn_colsum;
        ev->attn_colsum_stride = (int32_t)ctx->buf.colsum_stride;
    }
    st = run_hooks(ctx, ev);
    const pykv_status back = kv_layer_unstage(&ctx->cache, ev->layer, saved);
    free(window);
    return st != PYKV_OK ? st : back;
}

// Whether a host_lists policy's hooks for this layer need its lists in host memory
// (policy_ops.host_lists): at the end of a prefill call (unless the policy does it on the
// device lists, policy_ops.device_prefill_end) and on decode steps. Earlier chunks take the
// sums only, computed on the device over the lists in place (merged entries expanded).
// A decode step whose hooks run after the recorded step, with its sums, stays on the device
// when the policy takes such steps there (policy_ops.after_step).
static int hooks_on_host_lists(pykv_context *ctx, const struct policy_event *ev, const float *d_q,
                               const float *sums) {
    if (!d_q) return !(sums && ctx->policy->ops->after_step);
    if (ev->T == 1) return 1;
    return ev->is_last_chunk && !ctx->policy->ops->device_prefill_end;
}

// The policy's hooks for a layer on the GPU, once its kernels are queued: the work the policy
// queues on the stream (scoring, compaction) runs after them and before the next layer's.
// d_q: the layer's queries, still in g->q, or NULL when the hooks run after a recorded decode
// step, which brings the layer's attention sums back in `sums` (host, g->sums_stride apart)
// when the policy takes them. Otherwise the sums, which the CPU's attention writes as it
// goes, are computed again from d_q into the same host buffer.
static pykv_status layer_hook(pykv_context *ctx, int layer, int T, int n_probe, const float *d_q,
                              const float *sums) {
    const struct policy_ops *ops = ctx->policy->ops;
    struct policy_event ev = ctx->event;
    ev.layer = layer;
    ev.n_past = ctx->n_past + T - n_probe;
    ev.q = NULL;
    ev.q_device = d_q;
    ev.T = T;
    ev.probe.n = n_probe;
    ev.probe.q = NULL;   // the last n_probe rows of q_device
    ev.probe.rope_inv_freq = ctx->buf.rope_inv_freq;
    ev.wo = &ctx->model->layers[layer].wo;
    ev.wo_device = &model_gpu_layer(ctx->model, layer)->wo;
    ev.attn_colsum = NULL;
    ev.window_sums = NULL;
    if (ops->host_lists && hooks_on_host_lists(ctx, &ev, d_q, sums)) return host_layer_hook(ctx, &ev, n_probe, d_q);
    float *window = NULL;
    if (sums) {
        ev.attn_colsum = sums;
        ev.attn_colsum_stride = (int32_t)ctx->gpu->sums_stride;
    } else if (d_q && hooks_take_sums(ops, T)) {
        PYKV_TRY(ws_attention_sums_device(&ev, T, ctx->buf.attn_colsum, ctx->buf.colsum_stride));
        ev.attn_colsum = ctx->buf.attn_colsum;
        ev.attn_colsum_stride = (int32_t)ctx->buf.colsum_stride;
        // a device_prefill_end policy's last chunk (hooks_on_host_lists)
        if (ops->host_lists && ev.is_last_chunk) PYKV_TRY(window_sums_device(ctx, &ev, &window));
    }
    const pykv_status st = run_hooks(ctx, &ev);
    free(window);
    return st;
}

// The chunk layer by layer: each layer's kernels queued as the host appends the chunk's
// positions to its lists, then the policy's hook.
static pykv_status run_layers(pykv_context *ctx, int T, int n_probe) {
    struct gpu_run *g = ctx->gpu;
    const struct hparams *hp = &ctx->model->hp;
    // a chunk stops between layers only while no hook may have changed a list (forward.c)
    const int hooks = ctx->policy->ops->after_layer || ctx->policy->ops->decode_list;
    cuda_timing_mark(g->stream, "upload");
    PYKV_TRY(cuda_upload_async(g->x, ctx->buf.x, (size_t)T * hp->n_embd * sizeof(float), g->stream));
    PYKV_TRY(cuda_upload_async(g->rope_cs, ctx->buf.rope_cs, (size_t)T * hp->n_rot * sizeof(float), g->stream));
    for (int layer = g->first_layer; layer < hp->n_layer; layer++) {
        if (!hooks && layer > g->first_layer && atomic_load_explicit(&ctx->cancel, memory_order_relaxed))
            return pykv_error(PYKV_ERR_CANCELLED, "cancelled");
        for (int h = 0; h < hp->n_head_kv; h++) {   // the chunk's entries, then merged entries changed on the host go up
            struct kv_list *l = kv_cache_list(&ctx->cache, layer, h);
            kv_list_push_positions(l, ctx->n_past, T);
            PYKV_TRY(kv_list_sync_members(&ctx->cache, l));
        }
        struct cuda_kv_layer before, after;
        kv_device_layer(&ctx->cache, layer, NULL, &after);
        before = after;
        for (int h = 0; h < hp->n_head_kv; h++) before.n[h] -= T;
        enqueue_layer(g, ctx->model, layer, T, &before, &after);
        if (hooks) {
            cuda_timing_mark(g->stream, "policy hooks");
            PYKV_TRY(layer_hook(ctx, layer, T, n_probe, g->q, NULL));
        }
        for (int h = 0; n_probe && h < hp->n_head_kv; h++) {   // the probe's K/V are never kept
            struct kv_list *l = kv_cache_list(&ctx->cache, layer, h);
            kv_list_truncate(&ctx->cache, l, l->n - n_probe);
        }
    }
    return cuda_check("a layer on the GPU");
}

// Where layer `layer`'s rows start in the recorded step's sums (g->sums, g->h_sums); layer
// n_layer gives their size.
static size_t step_sums_at(const struct gpu_run *g, const struct hparams *hp, int layer) {
    return (size_t)(layer - g->first_layer) * hp->n_head * (size_t)g->sums_stride;
}

// Before a recording: room for the step's sums when the policy takes them (g->sums_stride set,
// 0 otherwise). Returns 0 when they would take more than GPU_STEP_SUMS_MAX_BYTES or the memory
// is not there: such a step runs layer by layer.
static int step_sums_reserve(pykv_context *ctx) {
    struct gpu_run *g = ctx->gpu;
    const struct hparams *hp = &ctx->model->hp;
    g->sums_stride = 0;
    if (!hooks_take_sums(ctx->policy->ops, 1)) return 1;
    int32_t room = 1;
    for (int layer = g->first_layer; layer < hp->n_layer; layer++)
        for (int h = 0; h < hp->n_head_kv; h++) {
            const int32_t cap = kv_cache_list(&ctx->cache, layer, h)->cap;
            room = cap > room ? cap : room;
        }
    const size_t bytes = (size_t)(hp->n_layer - g->first_layer) * hp->n_head * (size_t)room * sizeof(float);
    if (bytes > GPU_STEP_SUMS_MAX_BYTES) return 0;
    if (bytes > g->sums_bytes) {   // the last step is done (its host copy synchronised): no kernel holds them
        cuda_free(g->sums);
        cuda_host_free(g->h_sums);
        g->sums = NULL;
        g->h_sums = NULL;
        g->sums_bytes = 0;
        if (cuda_alloc((void **)&g->sums, bytes, "a decode step's attention sums") != PYKV_OK ||
            cuda_host_alloc((void **)&g->h_sums, bytes) != PYKV_OK) {
            cuda_free(g->sums);
            g->sums = NULL;
            return 0;
        }
        g->sums_bytes = bytes;
    }
    g->sums_stride = room;
    return 1;
}

// Record a decode step of every offloaded layer and the classifier: its inputs come from the
// pinned buffers, the lists' lengths from g->lens.
static pykv_status record_decode(pykv_context *ctx) {
    struct gpu_run *g = ctx->gpu;
    const struct hparams *hp = &ctx->model->hp;
    const cuda_stream s = g->stream;
    PYKV_TRY(cuda_graph_capture_begin(s));
    pykv_status st = cuda_upload_async(g->x, g->h_x, (size_t)hp->n_embd * sizeof(float), s);
    if (st == PYKV_OK) st = cuda_upload_async(g->rope_cs, g->h_cs, (size_t)hp->n_rot * sizeof(float), s);
    if (st == PYKV_OK) st = cuda_upload_async(g->lens, g->h_lens, (size_t)offloaded_lists(ctx) * sizeof(int32_t), s);
    for (int layer = g->first_layer; st == PYKV_OK && layer < hp->n_layer; layer++) {
        struct cuda_kv_layer kl;
        kv_device_layer(&ctx->cache, layer, g->lens + (size_t)(layer - g->first_layer) * hp->n_head_kv, &kl);
        enqueue_layer(g, ctx->model, layer, 1, &kl, &kl);
        if (g->sums_stride)   // the layer's queries are still in g->q
            cuda_decode_probs(s, &kl, g->q, hp->n_head, g->sums + step_sums_at(g, hp, layer), g->sums_stride);
    }
    if (st == PYKV_OK) enqueue_logits(g, ctx->model, 1);
    const pykv_status end = cuda_graph_capture_end(s, &g->graph);   // ends the capture whatever happened
    if (st == PYKV_OK) st = end;
    if (st == PYKV_OK) g->graph_moves = ctx->cache.device_moves;
    return st;
}

// A decode step through the recorded graph (recorded again when a list has moved). Falls
// back to run_layers (*done = 0) when recording fails, and records no more after that.
static pykv_status run_decode_graph(pykv_context *ctx, int *done) {
    struct gpu_run *g = ctx->gpu;
    const struct hparams *hp = &ctx->model->hp;
    *done = 0;
    for (int layer = g->first_layer; layer < hp->n_layer; layer++)   // merged entries changed since they went up
        for (int h = 0; h < hp->n_head_kv; h++) {
            struct kv_list *l = kv_cache_list(&ctx->cache, layer, h);
            if (l->n_members && l->member_block_cap < l->n + 1) l->members_stale = 1;   // the step's entry too
            PYKV_TRY(kv_list_sync_members(&ctx->cache, l));
        }
    if (!g->graph || g->graph_moves != ctx->cache.device_moves) {
        if (!step_sums_reserve(ctx)) return PYKV_OK;   // recorded again at the next step
        if (record_decode(ctx) != PYKV_OK) {
            LOG_WARN("CUDA graphs off for this context: %s", pykv_last_error());
            g->graphs = 0;
            return PYKV_OK;
        }
    }
    memcpy(g->h_x, ctx->buf.x, (size_t)hp->n_embd * sizeof(float));
    memcpy(g->h_cs, ctx->buf.rope_cs, (size_t)hp->n_rot * sizeof(float));
    for (int layer = g->first_layer; layer < hp->n_layer; layer++)
        for (int h = 0; h < hp->n_head_kv; h++) {
            struct kv_list *l = kv_cache_list(&ctx->cache, layer, h);
            kv_list_push_positions(l, ctx->n_past, 1);
            g->h_lens[(size_t)(layer - g->first_layer) * hp->n_head_kv + h] = l->n;
        }
    *done = 1;
    cuda_timing_mark(g->stream, "decode step (CUDA graph)");
    PYKV_TRY(cuda_graph_launch(g->graph, g->stream));
    cuda_timing_mark(g->stream, "download");
    PYKV_TRY(cuda_download_async(ctx->logits, g->logits, (size_t)hp->n_vocab * sizeof(float), g->stream));
    if (g->sums_stride)
        PYKV_TRY(cuda_download_async(g->h_sums, g->sums, step_sums_at(g, hp, hp->n_layer) * sizeof(float), g->stream));
    PYKV_TRY(cuda_check("a decode step on the GPU"));
    return cuda_stream_sync(g->stream);
}

pykv_status gpu_forward_layers(pykv_context *ctx, int T, int n_probe, int want_x, int want_logits, int *logits_done) {
    struct gpu_run *g = ctx->gpu;
    const struct model_gpu *mg = ctx->model->gpu;
    const struct hparams *hp = &ctx->model->hp;
    *logits_done = 0;
    PYKV_TRY(cuda_set_device(mg->device));   // the calling thread may not have chosen it yet
    // a recorded decode step keeps no layer's queries, only the attention sums it computes
    // for the policies that take them: the hooks run once it is done, except those of a
    // policy whose lists go to host memory around its hooks and that has no after_step
    const struct policy_ops *ops = ctx->policy->ops;
    const int hooks = ops->after_layer || ops->decode_list;
    const int hooks_after_step = !hooks || (T == 1 && ctx->event.n_prompt == 1 && (!ops->host_lists || ops->after_step));
    if (g->graphs && T == 1 && !n_probe && !want_x && want_logits && mg->output && hooks_after_step) {
        int done = 0;
        PYKV_TRY(run_decode_graph(ctx, &done));
        if (done) {
            *logits_done = 1;
            // a decode step's hooks touch their own layer's lists only (policy_ops.device_lists),
            // so they may all run once the step is done
            pykv_status st = PYKV_OK;
            if (hooks) cuda_timing_mark(g->stream, "policy hooks");
            kv_device_hold_moves(g->stream);   // every list's eviction, in one launch after the last layer's
            for (int layer = g->first_layer; hooks && st == PYKV_OK && layer < hp->n_layer; layer++) {
                const float *sums = g->sums_stride ? g->h_sums + step_sums_at(g, hp, layer) : NULL;
                st = layer_hook(ctx, layer, 1, 0, NULL, sums);
            }
            const pykv_status sent = kv_device_send_moves(g->stream);
            if (st == PYKV_OK) st = sent;
            if (ops->after_step) {
                cuda_timing_mark(g->stream, "policy after the step");
                const pykv_status after = ops->after_step(ctx->policy, &ctx->cache, st != PYKV_OK);
                if (st == PYKV_OK) st = after;
            }
            PYKV_TRY(st);
            cuda_timing_end(g->stream);
            return cuda_stream_sync(g->stream);
        }
    }
    pykv_status st = run_layers(ctx, T, n_probe);
    if (ops->after_gpu_layers) {   // before anything reads the lists' positions again (a failed chunk's rollback too)
        cuda_timing_mark(g->stream, "policy after the layers");
        const pykv_status after = ops->after_gpu_layers(ctx->policy, &ctx->cache);
        if (st == PYKV_OK) st = after;
    }
    PYKV_TRY(st);
    if (want_logits && mg->output) {
        enqueue_logits(g, ctx->model, T);
        cuda_timing_mark(g->stream, "download");
        PYKV_TRY(cuda_download_async(ctx->logits, g->logits, (size_t)hp->n_vocab * sizeof(float), g->stream));
        *logits_done = 1;
    }
    if (want_x) {
        cuda_timing_mark(g->stream, "download");
        PYKV_TRY(cuda_download_async(ctx->buf.x, g->x, (size_t)T * hp->n_embd * sizeof(float), g->stream));
    }
    PYKV_TRY(cuda_check("the output on the GPU"));
    cuda_timing_end(g->stream);
    return cuda_stream_sync(g->stream);
}

#else   // a build without CUDA: no context has GPU layers

pykv_status gpu_run_init(pykv_context *ctx) {
    (void)ctx;
    return PYKV_OK;
}
void gpu_run_free(pykv_context *ctx) { (void)ctx; }
int gpu_first_layer(const pykv_context *ctx) { return ctx->model->hp.n_layer; }
pykv_status gpu_forward_layers(pykv_context *ctx, int T, int n_probe, int want_x, int want_logits, int *logits_done) {
    (void)ctx; (void)T; (void)n_probe; (void)want_x; (void)want_logits;
    *logits_done = 0;
    return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend");
}

#endif
