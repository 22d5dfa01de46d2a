// policy.h - the KV eviction policy interface and registry.
//
// A policy is a vtable plus its own state. The context calls its hooks at fixed points of
// the forward pass; each policy declares which hooks it needs (docs/architecture.md#policy-hooks):
//   after_layer   - a layer has appended its K/V and attended (cascading policies; also decode
//                   steps for policies that evict per layer); the pool is idle, free to use
//   after_chunk   - every layer of a prefill chunk is done (chunked policies such as TAKE)
//   after_prefill - the last chunk of a multi-token pykv_decode() is done (SnapKV-style)
//   after_decode  - a single-token step is done (H2O, decode-time eviction)
//   decode_list   - a decode step: one list has attended (per-list eviction, overlapped with
//                   the attention of the layer's other lists)
//   scoring_pass  - extra passes after a compressing prefill chunk, whose K/V are dropped
//                   (KVzip's reconstruction of the context)
//   after_step, after_gpu_layers - the GPU's decode step, or a chunk's GPU layers, are done:
//                   the work their hooks queued is finished (EMS's merges, TAKE's positions)
// A NULL hook is never called. Policies see the cache and the context's configuration.
#pragma once
#include <stdint.h>
#include "kv/kv-cache.h"
#include "pykv.h"
#include "kv/state-io.h"

// Warnings a context gives once each (pykv_take_warning hands them to the caller; they are
// logged too): a share budget raised to the policy's floor, a budget cut to n_ctx, positions
// past the model's training context, a context that keeps the model's GPU layers on the CPU.
enum policy_notice_kind { NOTICE_BUDGET_FLOOR = 0, NOTICE_BUDGET_CAP = 1, NOTICE_TRAIN_CTX = 2, NOTICE_GPU = 3,
                          NOTICE_KINDS = 4 };

struct policy_notices {
    unsigned said;                        // bit per kind already given
    int32_t  n, taken;                    // messages kept, messages handed out
    char     text[NOTICE_KINDS][320];
};

// Record (and log) a warning of this kind unless the context already gave one.
void policy_notice(struct policy_notices *ns, enum policy_notice_kind kind, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

struct policy_config {
    int32_t     budget;        // entries per (layer, KV head) on average; 0 = from budget_frac
    float       budget_frac;   // fraction of the prompt; with budget 0 too, the policy's default
    int32_t     window;        // -1 = the policy's default
    int32_t     sink;          // -1 = the policy's default
    const char *args;          // "k=v,k=v" or NULL
    // Set by the context once the policy is made (policy_budget reads them):
    const char *name;          // the policy's name, for messages
    float       default_frac;  // the descriptor's default budget: this share of the prompt,
    int32_t     default_min;   //   at least this many entries
    int32_t     floor;         // a share budget is raised to at least this many entries
    int32_t     cap;           // no budget above this many entries (n_ctx); 0 = none
    struct policy_notices *notices;   // the context's, or NULL
};

struct hparams;
struct tensor;
struct gpu_tensor;
struct threadpool;

// The task probe of a prefill chunk (policies with probe_len, e.g. TAKE): the last n of the
// chunk's T tokens, at the positions right after the chunk's real tokens (policy_event.n_past
// counts those only). Their K/V are the last n entries of every list of the layer: a policy
// must leave them there, and the forward pass drops them after after_layer.
struct policy_probe {
    int32_t      n;               // probe tokens in the chunk; 0: none
    const float *q;               // their queries, post-RoPE: the last n rows of the event's q
                                  // (NULL when n is 0)
    const float *rope_inv_freq;   // (n_rot / 2): undo or redo RoPE on queries (set with n 0 too)
};

struct policy_event {
    struct kv_cache      *cache;
    const struct hparams *hp;
    struct threadpool    *pool;          // for parallel scoring (threadpool_run)
    int32_t               layer;         // after_layer and decode_list only; -1 otherwise
    int32_t               n_past;        // tokens in the sequence, this chunk included
    int32_t               n_prompt;      // tokens of the current pykv_decode() call (1 = decode step)
    int32_t               n_past_end;    // tokens in the sequence once the current call is done
    int32_t               is_last_chunk; // this chunk ends the current pykv_decode() call, or the policy
                                         // is to compress after every chunk (evict_every_chunk)
    int32_t               is_first_chunk; // this chunk starts the current pykv_decode() call
    // after_layer only: this chunk's queries, post-RoPE, (T, n_head, head_dim); the chunk's
    // tokens sit at positions [n_past - T, n_past) and are the last T entries of each list.
    // A layer on the GPU gives them in device memory as q_device instead (q and probe.q are
    // NULL; q_device is NULL too on a decode step whose hooks run after the recorded step).
    const float          *q;
    const float          *q_device;
    int32_t               T;
    // after_layer and decode_list, for policies with POLICY_NEEDS_ATTENTION_SUMS (one-token
    // chunks only with POLICY_NEEDS_DECODE_ATTENTION_SUMS; NULL otherwise): the attention
    // each entry of the layer's lists received from this chunk's queries, per query head: row h (stride
    // attn_colsum_stride) holds one value per entry of KV head h / (n_head / n_head_kv).
    const float          *attn_colsum;
    int32_t               attn_colsum_stride;
    // after_layer of a host_lists policy at a prompt's last chunk on a GPU layer: the same
    // sums from the chunk's last window_rows queries only (window_rows = min(last_chunk_min,
    // T)), computed on the device (before the lists came down, or with device_prefill_end in
    // their place); NULL otherwise.
    const float          *window_sums;
    int32_t               window_rows;
    // after_layer only: the probe tokens (policies with probe_len, e.g. TAKE).
    struct policy_probe   probe;
    // after_layer only: the layer's output projection (attn_output, ne = (n_head * head_dim,
    // n_embd), possibly quantized), for policies that weigh a value by what it adds to the
    // layer's output (criticalkv).
    const struct tensor  *wo;
    // A layer on the GPU: the same projection in device memory (model/offload.h); NULL
    // otherwise.
    const struct gpu_tensor *wo_device;
};

struct kv_policy;

// What a policy's scoring passes (policy_ops.scoring_pass) are made from: the tokens read
// since the cache was last compressed (the call's; the chunk's with evict_every_chunk), the
// last n_tokens entries of every list, at positions [n_past - n_tokens, n_past).
struct policy_replay {
    const struct pykv_model *model;   // for pykv_tokenize (a pass's own text)
    const pykv_token        *tokens;
    int32_t                  n_tokens;
    int32_t                  n_past;
    int32_t                  cap;      // the most tokens one pass may hold
};

// What a policy needs the forward pass to compute or hold for it (policy_ops.needs).
enum policy_needs {
    // Each entry's attention summed per query head, for after_layer on every chunk (costs a
    // prefill pass over the weights it already computes, and splits attention by head).
    POLICY_NEEDS_ATTENTION_SUMS        = 1u << 0,
    // The same sums on decode steps only, for decode_list (a decode step's attention writes
    // them as it goes, no extra pass); multi-token chunks then get attn_colsum NULL.
    POLICY_NEEDS_DECODE_ATTENTION_SUMS = 1u << 1,
    // Room for one entry past n_ctx in every list: each decode step appends its entry and
    // then evicts back to the budget, so the cache does not grow (pykv_policy_info's
    // evicts_every_step).
    POLICY_NEEDS_STEP_ROOM             = 1u << 2,
};

struct policy_ops {
    const char *name;
    const char *description;
    pykv_status (*init)(const struct policy_config *cfg, struct kv_policy **out);
    void        (*free)(struct kv_policy *p);
    pykv_status (*after_layer)(struct kv_policy *p, const struct policy_event *ev);
    pykv_status (*after_chunk)(struct kv_policy *p, const struct policy_event *ev);
    pykv_status (*after_prefill)(struct kv_policy *p, const struct policy_event *ev);
    pykv_status (*after_decode)(struct kv_policy *p, const struct policy_event *ev);
    // Decode steps only (one-token calls; a one-token chunk of a longer prompt is not one):
    // list g of ev->layer has attended (new entry appended, its attention sums final). Runs
    // on a pool thread inside the attention's task while other threads attend the layer's
    // other lists, so calls for different g may run at the same time and must not use the
    // pool. A policy that sets it gets after_layer on decode steps before the layer's
    // attention instead of after it (per-layer bookkeeping).
    pykv_status (*decode_list)(struct kv_policy *p, const struct policy_event *ev, int32_t g);
    // Tokens the last prefill chunk must hold (the observation window), or NULL for none:
    // the context shortens the chunk before it so the window's queries arrive together.
    int32_t     (*last_chunk_min)(const struct kv_policy *p);
    // Probe tokens to append to every chunk but the last of a prefill of n_tokens (0: none).
    // They are the context's probe (pykv_set_probe) or else the call's last tokens.
    int32_t     (*probe_len)(const struct kv_policy *p, int32_t n_tokens);
    // Scoring passes (KVzip's context reconstruction), NULL for none: after a prefill chunk that
    // compresses (is_last_chunk) and before its after_chunk, the context asks for passes
    // i = 0, 1, ... until one has no tokens: the policy writes pass i's tokens (at most
    // in->cap) to out and their count to *n. A pass runs through the model at the positions
    // after the sequence as a chunk made of probe tokens only (after_layer sees probe.n == T);
    // its K/V are dropped and n_past stays. A pass that fails or is cancelled rolls the chunk
    // back as a failed chunk does.
    pykv_status (*scoring_pass)(struct kv_policy *p, const struct policy_replay *in, int32_t i, pykv_token *out,
                                int32_t *n);
    // After the hooks of a GPU decode step that ran once the step was done (device_lists):
    // called when every GPU layer's have run, with discard set when one of them failed (work
    // they queued is then forgotten). NULL if the policy queues nothing.
    pykv_status (*after_step)(struct kv_policy *p, struct kv_cache *cache, int discard);
    // After the GPU layers of a multi-token call's chunk (device_lists), also when one of them
    // failed, before after_chunk: what their hooks left to finish once the stream's work is
    // done (TAKE: the positions of the entries the device chose). NULL if they leave nothing.
    pykv_status (*after_gpu_layers)(struct kv_policy *p, struct kv_cache *cache);
    // The cache was cleared (pykv_reset): forget per-entry state. NULL if there is none.
    void        (*reset)(struct kv_policy *p);
    // Saved states (pykv_state_save / load) of a policy that keeps state of its own between
    // calls (scores per entry, a budget fixed by the last prefill); NULL for none.
    // state_write puts it through w, which may only count. state_read takes back what
    // state_write put, for a cache whose list i will hold list_n[i] entries (the cache's
    // order): with apply = 0 it checks every value and changes nothing; with apply = 1, on
    // bytes it has passed, it replaces the policy's state (failing only for memory).
    void        (*state_write)(const struct kv_policy *p, const struct kv_cache *c, struct state_writer *w);
    pykv_status (*state_read)(struct kv_policy *p, const struct kv_cache *c, const int32_t *list_n,
                              struct state_reader *r, int apply);
    // What the forward pass must provide for the policy: a mask of POLICY_NEEDS_* bits (0: none).
    unsigned      needs;
    // Nonzero: the policy never evicts and keeps no per-entry state, so the cache can be cut
    // back to any prefix of the tokens (pykv_truncate) and equal a fresh run over it.
    int           keeps_every_entry;
    // What users see (pykv_policy_get_info, `pykv info --policies`), and the budget rules:
    const char   *options;        // the policy arguments and their defaults, "key=default, ..."
    const char   *choose;         // one line on when to choose it
    // The budget when none is given: default_budget_frac of the prompt, at least
    // default_budget_min entries (so short prompts keep everything).
    float         default_budget_frac;
    int32_t       default_budget_min;
    // A share budget (budget_frac) never goes below this many entries; min_budget (NULL: 1)
    // gives the least the policy works with under its options (its window, its sinks),
    // which raises the floor when larger.
    int32_t       budget_floor;
    int32_t     (*min_budget)(const struct kv_policy *p);
    // Nonzero: evicts after every prefill chunk by itself (TAKE), so a prompt longer than
    // n_ctx goes through: n_ctx bounds the cache, not the prompt.
    int           evicts_while_reading;
    // Nonzero: the hooks work on the lists of layers offloaded to a GPU, whose keys and values
    // are in device memory: they read them and the queries only through the helpers that
    // take q_device (ws_stats_compute, ws_value_l1_max, ws_query_rows, ws_host_event,
    // take_layer_scores, ws_device_scores; the attention sums come computed),
    // kv_list_rows_f32, kv_layer_host_copy or the score functions of es_layer_keep_top (run
    // over a host copy unless the device has their twin); change lists only through
    // kv_list_retain, kv_list_drop and kv_list_truncate; and on a decode step touch only the
    // lists of ev->layer (after_layer and decode_list run for every GPU layer once the step
    // is done, with the step's attention sums when the policy takes them). A context whose
    // policy lacks it runs every layer on the CPU.
    int           device_lists;
    // Nonzero (with device_lists): at the end of a prefill call and on decode steps the hooks
    // read and change the lists on the host as they do on the CPU (EMS's merges); around
    // those hooks of a GPU layer the context brings its lists, the chunk's queries and the
    // attention sums to host memory (kv_layer_stage) and sends the lists back, with their
    // merged entries, which the GPU's attention expands. The hooks of earlier chunks take
    // only the attention sums, computed on the device (the last chunk's too), merged entries
    // expanded. A policy with after_step takes decode steps on the device lists instead, once
    // the recorded step is done.
    int           host_lists;
    // Nonzero (with host_lists): the hooks of a prompt's last chunk on a GPU layer work on the
    // device lists instead, as earlier chunks' do, with the attention sums and the window's
    // sums (policy_event.window_sums) computed on the device.
    int           device_prefill_end;
};

// Nonzero when a context with the policy runs the model's GPU layers there (pykv_policy_info's
// runs_on_gpu): its hooks work on device lists.
static inline int policy_runs_on_gpu(const struct policy_ops *ops) { return ops->device_lists != 0; }

// Nonzero when the forward pass keeps attention sums for the policy (on any step).
static inline int policy_needs_sums(const struct policy_ops *ops) {
    return (ops->needs & (POLICY_NEEDS_ATTENTION_SUMS | POLICY_NEEDS_DECODE_ATTENTION_SUMS)) != 0;
}

// The budget in entries per (layer, KV head) for a prompt of n_prompt tokens: cfg->budget;
// or ceil(cfg->budget_frac * n_prompt), raised to cfg->floor (with one warning); or, with
// neither given, the policy's default: ceil(default_frac * n_prompt), at least default_min,
// and at most half of cfg->cap for a prompt longer than the cache (room to generate).
// Never above cfg->cap (n_ctx; a warning when a prompt longer than that meets it), at least 1.
int32_t policy_budget(const struct policy_config *cfg, int32_t n_prompt);

// Nonzero when cfg gives no budget (the policy's default applies).
static inline int policy_budget_is_default(const struct policy_config *cfg) {
    return cfg->budget <= 0 && !(cfg->budget_frac > 0.0f);
}

// The least budget the policy works with under its options (floor of share budgets).
int32_t policy_floor(const struct kv_policy *p);

// The budget rules the evicting policies share (their descriptors name them): with no budget
// given, a quarter of the prompt, at least 256 entries per (layer, KV head), so prompts of up
// to 256 tokens keep everything; a share budget never below 64 entries (or the policy's own
// least, when larger), below which every policy loses most of what the prompt said.
#define POLICY_DEFAULT_BUDGET_FRAC 0.25f
#define POLICY_DEFAULT_BUDGET_MIN  256
#define POLICY_BUDGET_FLOOR        64

// Every policy state starts with its ops and configuration.
struct kv_policy {
    const struct policy_ops *ops;
    struct policy_config     cfg;
};

// The arguments every evicting policy takes, parsed out of args: evict_every_chunk=0|1 (cut
// the cache back to the budget after every prefill chunk). *rest (malloc'd, NULL when args
// is NULL) holds the policy's own arguments.
pykv_status policy_split_args(const char *policy, const char *args, char **rest, int *every_chunk);

// The registry; NULL when name is unknown (pykv_last_error lists the names).
const struct policy_ops *policy_find(const char *name);
const struct policy_ops *policy_registry_get(int i);
