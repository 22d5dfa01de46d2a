// context.h - a model instance in use: KV cache, policy, scratch buffers, threads, timings.
#pragma once
#include <stdatomic.h>
#include <stdint.h>
#include "kv/kv-cache.h"
#include "model/model.h"
#include "cpu/ops.h"
#include "graph/outputs.h"
#include "kv/policy.h"
#include "core/threadpool.h"

// Activation buffers for one chunk of up to n_ubatch tokens (allocated once at init; the
// forward pass allocates nothing).
struct scratch {
    float *x;        // (n_ubatch, n_embd) residual stream
    float *xb;       // (n_ubatch, n_embd) normed input / attention projection output
    float *q;        // (n_ubatch, n_head * head_dim)
    float *k;        // (n_ubatch, n_head_kv * head_dim)
    float *v;        // (n_ubatch, n_head_kv * head_dim)
    float *att;      // (n_ubatch, n_head * head_dim) attention output
    float *gate;     // (n_ubatch, n_ff)
    float *up;       // (n_ubatch, n_ff)
    float *scores;   // (n_threads, scores_stride) attention weights of a tile of queries
    size_t scores_stride;   // ATTENTION_TILE * (n_ctx + n_ubatch)
    struct matmul_buf matmul;   // dequant: (n_threads, matmul_scratch_floats(max input features))
    float *rope_inv_freq;   // (n_rot / 2) base^(-2i/n_rot) / freq_factor
    float *rope_cs;         // (n_ubatch, n_rot) the chunk's tokens' RoPE cos and sin (rope_angles)
    float *attn_colsum;     // (n_head, colsum_stride) attention received per entry, when the policy asks
    size_t colsum_stride;   // the most entries a list holds (n_ctx + n_ubatch)
    float *flash_work;      // (n_threads, flash_work_stride) blocked prefill attention
    size_t flash_work_stride;
    float *part_m, *part_l; // (n_head, DECODE_MAX_SEGMENTS) a decode step's split attention
    float *part_o;          // (n_head, DECODE_MAX_SEGMENTS, head_dim)
    atomic_int *segments_next;   // (n_head_kv) a decode step's next segment to claim per list
    atomic_int *segments_left;   // (n_head_kv) a decode step's segments still to attend per list
    int        *segments;        // (n_head_kv) its segment counts, fixed before the threads start
};

// A decode step splits each list into segments of at least DECODE_SEGMENT entries, at most
// DECODE_MAX_SEGMENTS of them (attention-schedule.c).
#define DECODE_SEGMENT 256
#define DECODE_MAX_SEGMENTS 16

// Positions stay below this however long the sequence (RoPE angles in float lose their
// precision far beyond any training context).
#define MAX_POSITION (1 << 24)

// A decode call in progress: pykv_decode_begin sets it up, each pykv_decode_step runs its
// next chunk (pykv_decode runs them all within one call).
struct decode_run {
    int                active;      // begun, and the step that ends it has not come yet
    const pykv_token  *tokens;      // the call's tokens: pykv_decode's caller's, or `held`
    int32_t            n_tokens;
    int32_t            done;        // tokens evaluated so far (the chunks that stay)
    const pykv_token  *probe;       // appended to every chunk but the last (choose_probe)
    int32_t            n_probe;
    int                is_prefill;  // more than one token: a prompt, else a decode step
    int                was_empty;   // began on an empty context (pykv_is_single_run)
    double             ms;          // time spent in the call's finished chunks
    pykv_token        *held;        // pykv_decode_begin's copy of the tokens
    int32_t            held_cap;
};

struct pykv_context {
    pykv_model        *model;
    int32_t            n_ctx;
    int32_t            n_ubatch;
    struct threadpool *pool;
    struct kv_cache    cache;
    struct kv_policy  *policy;
    // Cut the cache back to the budget after every prefill chunk (the policy argument
    // evict_every_chunk=1), so the chunks of a prompt end as a call's last chunk does.
    int                evict_every_chunk;
    // n_ctx bounds the cache's lists, not the positions (pykv_cache_bounded).
    int                cache_bounded;
    struct policy_notices notices;      // warnings given once (pykv_take_warning)
    int32_t           *chunk_start_n;   // (n_layer * n_head_kv) list lengths before a chunk
    struct scratch     buf;
    struct gpu_run    *gpu;             // the device side of the offloaded layers (forward-gpu.h), or NULL
    int32_t            n_past;
    float             *logits;          // (n_vocab)
    int                has_logits;
    // The cache is what one pykv_decode() of its n_past tokens on an empty context leaves:
    // a later call sees a cache an evicting policy already compressed (pykv_is_single_run).
    int                single_run;
    struct token_outputs out;          // every token's logits / hidden state, when asked
    struct policy_event event;          // what the policy hooks see of the current call
    char              *policy_args;     // the context's own copy of params->policy_args
    pykv_token        *probe;           // task probe set by pykv_set_probe, or NULL
    int32_t            n_probe_set;
    pykv_token        *chunk_tokens;    // (n_ubatch) a chunk followed by its probe
    atomic_int         cancel;
    pykv_progress_callback progress;   // after each chunk of a multi-token call, or NULL
    void              *progress_user;
    struct decode_run  run;
    // The thread running a pykv_decode or pykv_decode_step on this context
    // (context_thread_tag), 0 when none: its progress callback may call in, another thread's
    // calls are refused, and pykv_context_free waits for the call to stop.
    atomic_uintptr_t   decode_owner;
    atomic_int         free_pending;   // pykv_context_free came from the running call's thread
    struct pykv_timings timings;
};

// PYKV_OK, or an error naming `what` while a pykv_decode or pykv_decode_step runs on ctx, or
// while a decode begun with pykv_decode_begin is unfinished: the calls that change the
// context refuse from inside its progress callback, from any other thread, and between the
// steps of a prompt.
pykv_status context_refuse_busy(const pykv_context *ctx, const char *what);

// Run tokens [0, T) at positions n_past.. through every layer, appending their K/V to the
// cache; computes the logits of the last token when want_logits, and the per-token outputs
// that are switched on (outputs.h). T <= n_ubatch.
// The last n_probe of the T tokens are probe tokens (see policy.h): processed, scored by
// the policy, then dropped from the cache; n_past does not count them.
pykv_status forward_chunk(pykv_context *ctx, const pykv_token *tokens, int T, int n_probe, int want_logits);

// The most entries one list may hold: n_ctx, one more while a policy that evicts at every
// decode step has not yet dropped the step's entry.
int32_t context_list_limit(const pykv_context *ctx);

// The most tokens a context may have seen: n_ctx, or MAX_POSITION when n_ctx bounds only the
// cache (pykv_cache_bounded).
int32_t context_position_limit(const pykv_context *ctx);
