/*
 * pykv.h - the public C API of libpykv.
 *
 * Conventions (as in llama.h, with two differences for FFI bindings):
 *  - handles are opaque; the model must outlive every context made from it;
 *  - params structs are passed by pointer and start with struct_size; fill them from
 *    pykv_*_default_params() first;
 *  - every fallible call returns a pykv_status; on failure pykv_last_error() (per thread)
 *    says why. Nothing in the library aborts on bad input.
 *  - string outputs use (buf, cap, *n_out): on PYKV_ERR_BUFFER_TOO_SMALL *n_out holds the
 *    size needed, so callers can probe then allocate.
 *
 * The region between the cffi markers is parsed by the Python binding (pykv/_ffi.py):
 * keep it to plain declarations, with PYKV_API as the only macro.
 */
#ifndef PYKV_H
#define PYKV_H

#include <stddef.h>
#include <stdint.h>

/* The library is built with PYKV_BUILD defined: on Windows it exports the API and a program
 * using it imports it (define PYKV_STATIC to link a static build); with GCC and Clang the
 * API stays visible when the rest of the library is built with hidden visibility. */
#if defined(_WIN32) && !defined(PYKV_STATIC)
#  if defined(PYKV_BUILD)
#    define PYKV_API __declspec(dllexport)
#  else
#    define PYKV_API __declspec(dllimport)
#  endif
#elif defined(__GNUC__) && __GNUC__ >= 4
#  define PYKV_API __attribute__((visibility("default")))
#else
#  define PYKV_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* --- cffi begin --- */

#define PYKV_ABI_VERSION 7
#define PYKV_DEFAULT_SEED 4294967295

typedef int32_t pykv_token;
typedef int32_t pykv_pos;

typedef enum pykv_status {
    PYKV_OK                      = 0,
    PYKV_ERR_INVALID_ARG         = 1,  /* a bad argument from the caller */
    PYKV_ERR_IO                  = 2,  /* a file could not be opened, mapped or read */
    PYKV_ERR_FORMAT              = 3,  /* a corrupt or truncated GGUF, bad metadata */
    PYKV_ERR_UNSUPPORTED         = 4,  /* valid input this build cannot run (tensor type, arch) */
    PYKV_ERR_NOMEM               = 5,
    PYKV_ERR_CONTEXT_FULL        = 6,  /* the tokens do not fit in n_ctx */
    PYKV_ERR_CANCELLED           = 7,  /* pykv_cancel() stopped the call */
    PYKV_ERR_BUFFER_TOO_SMALL    = 8,  /* *n_out holds the size needed */
    PYKV_ERR_INTERNAL            = 9,
    /* Not an error: pykv_decode_step ran a chunk and the begun decode has more to run. It is
     * positive, so a `!= PYKV_OK` test alone takes it for a failure: compare with it first. */
    PYKV_PENDING                 = 100,
} pykv_status;

/* Tensor element types; the numbers are GGUF's (ggml_type). */
typedef enum pykv_type {
    PYKV_TYPE_F32  = 0,
    PYKV_TYPE_F16  = 1,
    PYKV_TYPE_Q4_0 = 2,
    PYKV_TYPE_Q4_1 = 3,
    PYKV_TYPE_Q5_0 = 6,
    PYKV_TYPE_Q5_1 = 7,
    PYKV_TYPE_Q8_0 = 8,
    PYKV_TYPE_Q2_K = 10,
    PYKV_TYPE_Q3_K = 11,
    PYKV_TYPE_Q4_K = 12,
    PYKV_TYPE_Q5_K = 13,
    PYKV_TYPE_Q6_K = 14,
    PYKV_TYPE_IQ4_NL = 20,
    PYKV_TYPE_IQ4_XS = 23,
    PYKV_TYPE_BF16 = 30,
} pykv_type;

typedef struct pykv_grammar pykv_grammar;
typedef struct pykv_model   pykv_model;
typedef struct pykv_context pykv_context;
typedef struct pykv_sampler pykv_sampler;

/* ---- library ---- */

PYKV_API int32_t     pykv_abi_version(void);
/* The message of the last failed call on this thread ("" when none). */
PYKV_API const char *pykv_last_error(void);
/* CPU features the kernels use, build options. Static string. */
PYKV_API const char *pykv_system_info(void);
/* 0 = silent (default), 1 = errors, 2 = warnings, 3 = info, 4 = debug; logs go to stderr. */
PYKV_API void        pykv_log_set_level(int32_t level);

/* ---- model ---- */

struct pykv_model_params {
    size_t  struct_size;
    int32_t use_mmap;    /* 1 (default): map the file; 0: read it into memory */
    int32_t vocab_only;  /* 1: load metadata and tokenizer only, no weights */
    int32_t n_gpu_layers;/* layers on the GPU, as llama.cpp's -ngl: the last N of the model's
                            layers, with their KV cache; more than n_layer also puts the output
                            norm and classifier there; -1 = all of it. 0 (default) = none. A
                            build without CUDA, or a machine without a GPU, runs every layer on
                            the CPU and says so once (a warning in the log) */
    int32_t main_gpu;    /* the CUDA device the layers go to (default 0) */
};

PYKV_API void        pykv_model_default_params(struct pykv_model_params *params);
PYKV_API pykv_status pykv_model_load(const char *path, const struct pykv_model_params *params,
                                     pykv_model **out);
PYKV_API void        pykv_model_free(pykv_model *model);

struct pykv_model_info {
    size_t  struct_size;
    int32_t n_vocab;
    int32_t n_ctx_train;
    int32_t n_embd;
    int32_t n_layer;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t head_dim;
    int32_t n_ff;
    float   rope_freq_base;
    float   rms_eps;
    int32_t tied_output;   /* 1 when output.weight is absent and token_embd is reused */
    int64_t n_params;
    int64_t n_bytes;       /* bytes of tensor data in the file */
    int32_t gguf_version;
    int32_t vocab_only;
    int32_t n_gpu_layers;  /* layers whose weights and KV cache are on the GPU (0: all on the CPU) */
    int32_t gpu_output;    /* 1 when the output norm and classifier are on the GPU too */
    int32_t gpu_device;    /* the CUDA device they are on, -1 when none */
    int64_t gpu_bytes;     /* GPU memory the weights take */
};
PYKV_API pykv_status pykv_model_get_info(const pykv_model *model, struct pykv_model_info *info);

/* GGUF metadata: keys by index, values rendered as text (arrays summarised). */
PYKV_API int32_t     pykv_model_meta_count(const pykv_model *model);
PYKV_API pykv_status pykv_model_meta_key(const pykv_model *model, int32_t i, char *buf,
                                         int32_t cap, int32_t *n_out);
PYKV_API pykv_status pykv_model_meta_value(const pykv_model *model, int32_t i, char *buf,
                                           int32_t cap, int32_t *n_out);
/* The value of a string key, e.g. "tokenizer.chat_template". PYKV_ERR_INVALID_ARG if absent. */
PYKV_API pykv_status pykv_model_meta_string(const pykv_model *model, const char *key, char *buf,
                                            int32_t cap, int32_t *n_out);

struct pykv_tensor_info {
    size_t      struct_size;
    const char *name;      /* owned by the model */
    int32_t     type;      /* pykv_type */
    int32_t     n_dims;
    int64_t     ne[4];     /* ne[0] is the row length, as in ggml */
    uint64_t    offset;    /* from the start of the file */
    uint64_t    n_bytes;
};
PYKV_API int32_t     pykv_model_tensor_count(const pykv_model *model);
PYKV_API pykv_status pykv_model_tensor_info(const pykv_model *model, int32_t i,
                                            struct pykv_tensor_info *info);

/* ---- tensor types (also used by the tests) ---- */

/* "q4_1" etc., or NULL for an unknown type. */
PYKV_API const char *pykv_type_name(int32_t type);
/* Block size in elements and bytes; 0 for an unknown type. */
PYKV_API int32_t     pykv_type_block_size(int32_t type);
PYKV_API int32_t     pykv_type_block_bytes(int32_t type);
/* Dequantize n elements (a multiple of the block size) of type from src into dst. */
PYKV_API pykv_status pykv_dequantize(int32_t type, const void *src, int64_t n, float *dst);

/* ---- vocabulary and tokenizer (thread-safe) ---- */

PYKV_API int32_t     pykv_vocab_n_tokens(const pykv_model *model);
PYKV_API pykv_token  pykv_vocab_bos(const pykv_model *model);   /* -1 when none */
PYKV_API pykv_token  pykv_vocab_eos(const pykv_model *model);
PYKV_API pykv_token  pykv_vocab_eot(const pykv_model *model);
PYKV_API int32_t     pykv_vocab_is_eog(const pykv_model *model, pykv_token token);
PYKV_API int32_t     pykv_vocab_is_control(const pykv_model *model, pykv_token token);
PYKV_API int32_t     pykv_vocab_add_bos(const pykv_model *model);
/* add_special: add BOS/EOS as the model's metadata asks.
 * parse_special: text like "<|im_start|>" becomes the special token, not its characters. */
PYKV_API pykv_status pykv_tokenize(const pykv_model *model, const char *text, int32_t text_len,
                                   int32_t add_special, int32_t parse_special,
                                   pykv_token *tokens, int32_t cap, int32_t *n_out);
/* The bytes of one token; special/control tokens render as their text only if special. */
PYKV_API pykv_status pykv_token_to_piece(const pykv_model *model, pykv_token token,
                                         int32_t special, char *buf, int32_t cap, int32_t *n_out);
/* The bytes of a token sequence (SentencePiece's leading space after BOS is removed). */
PYKV_API pykv_status pykv_detokenize(const pykv_model *model, const pykv_token *tokens,
                                     int32_t n_tokens, int32_t special, char *buf, int32_t cap,
                                     int32_t *n_out);

/* ---- context: the KV cache and the forward pass ---- */

struct pykv_context_params {
    size_t      struct_size;
    uint32_t    n_ctx;        /* 0 = the model's training context */
    uint32_t    n_ubatch;     /* prefill chunk (default 512) */
    int32_t     n_threads;    /* 0 = number of physical cores */
    const char *policy;       /* eviction policy name; NULL or "full" keeps everything */
    int32_t     budget;       /* entries per (layer, KV head) on average; 0 = use budget_frac */
    float       budget_frac;  /* budget as a fraction of the prompt when budget == 0 */
    int32_t     window;       /* -1 = the policy's default */
    int32_t     sink;         /* -1 = the policy's default */
    const char *policy_args;  /* "k=v,k=v" policy-specific options, or NULL */
    int32_t     exact_matmul; /* 1 = float activations in every matrix product (the reference
                                 path); 0 (default) = decode steps and prefill chunks
                                 quantise activations to 8 bits and take integer dot products
                                 for the quantised weight types, as llama.cpp does */
    int32_t     kv_type;      /* how keys (and values, unless kv_type_v says otherwise) are
                                 stored: PYKV_TYPE_F16 (default, half the memory, as llama.cpp),
                                 PYKV_TYPE_F32 (the exact path) or PYKV_TYPE_Q8_0 (34 bytes per
                                 32 values, as llama.cpp's -ctk q8_0; needs a head size
                                 divisible by 32) */
    int32_t     kv_type_v;    /* how values are stored, as kv_type (llama.cpp's -ctv); -1
                                 (default) = as kv_type */
    float       rope_freq_base;  /* RoPE base frequency (theta) instead of the model's; 0
                                    (default) = the model's */
    float       rope_freq_scale; /* RoPE linear position scaling: a token at position p is
                                    rotated as if at p * rope_freq_scale (0.5 spreads the
                                    model's positions over twice the length); 0 (default)
                                    = 1, none */
};

PYKV_API void        pykv_context_default_params(struct pykv_context_params *params);
PYKV_API pykv_status pykv_context_init(pykv_model *model, const struct pykv_context_params *params,
                                       pykv_context **out);
/* A context is used by one thread at a time: a call from another thread while pykv_decode
 * or pykv_decode_step runs is refused with PYKV_ERR_INVALID_ARG (pykv_cancel excepted).
 * pykv_context_free may come from any thread: while another thread's pykv_decode or
 * pykv_decode_step runs on ctx it cancels that call and waits for it to return before
 * freeing, so the model may be freed next. From ctx's own progress callback the free is
 * deferred: the running call stops (pykv_decode at the next chunk, pykv_decode_step at once)
 * and frees ctx as it returns PYKV_ERR_CANCELLED. Between two steps of a begun decode nothing
 * runs and the free is immediate. No call on ctx may start once pykv_context_free has been
 * called. */
PYKV_API void        pykv_context_free(pykv_context *ctx);
PYKV_API pykv_status pykv_context_set_threads(pykv_context *ctx, int32_t n_threads);

/* Append n tokens to the context and run them through the model in chunks of n_ubatch.
 * A call with several tokens is a prefill, one with a single token a decode step. On error
 * the tokens of completed chunks stay in the cache (pykv_n_past tells how many). It is
 * pykv_decode_begin followed by pykv_decode_step until the end, in one call. */
PYKV_API pykv_status pykv_decode(pykv_context *ctx, const pykv_token *tokens, int32_t n_tokens);
/* pykv_decode one chunk at a time, so that the caller runs between the chunks of a long
 * prompt (to show progress, to stop it) with no callback into its code. pykv_decode_begin
 * checks the tokens as pykv_decode does (the same errors, and then nothing is begun), copies
 * them and prepares the chunks; it runs none. Each pykv_decode_step runs the next chunk and
 * sets *n_done (may be NULL) to the call's tokens evaluated so far: it returns PYKV_PENDING
 * while chunks remain, PYKV_OK after the last (*n_done == n_tokens; the logits are those of
 * the last token), or an error, which ends the decode as it ends pykv_decode: the chunk it
 * failed in is rolled back and the chunks before stay. The chunks, and so the results, are
 * exactly pykv_decode's. A step is a call on ctx (the threading rules of pykv_context_free
 * apply to it); between two steps the context is idle but mid-prompt: pykv_cancel then makes
 * the next step return PYKV_ERR_CANCELLED at once, with nothing more evaluated, which ends the
 * decode (the way to stop one early); pykv_reset ends it and forgets every token; the other
 * calls that change the context, pykv_decode and pykv_decode_begin included, are refused with
 * PYKV_ERR_INVALID_ARG until the decode has ended. The progress callback, when set, is also
 * called by the steps. A step with no begun decode is PYKV_ERR_INVALID_ARG.
 *
 *     if (pykv_decode_begin(ctx, tokens, n) != PYKV_OK) fail();
 *     int32_t done;
 *     pykv_status st;
 *     while ((st = pykv_decode_step(ctx, &done)) == PYKV_PENDING) show(done, n);
 *     if (st != PYKV_OK) fail();
 */
PYKV_API pykv_status pykv_decode_begin(pykv_context *ctx, const pykv_token *tokens, int32_t n_tokens);
PYKV_API pykv_status pykv_decode_step(pykv_context *ctx, int32_t *n_done);
/* Nonzero while a decode begun with pykv_decode_begin has not ended (a step has not yet
 * returned PYKV_OK or an error, and no pykv_reset came). */
PYKV_API int32_t     pykv_decode_pending(const pykv_context *ctx);
/* The task probe for policies that score during chunked prefill (TAKE): its tokens are
 * run after every prefill chunk but the last, to score the cache, and never kept. Applies
 * to the following pykv_decode calls; n_tokens = 0 goes back to the default (the last
 * tokens of each call). Policies without a probe ignore it. */
PYKV_API pykv_status pykv_set_probe(pykv_context *ctx, const pykv_token *tokens, int32_t n_tokens);
/* Logits of the last token evaluated (n_vocab floats), owned by ctx, valid until the next
 * decode or reset; NULL before the first decode. */
PYKV_API const float *pykv_get_logits(pykv_context *ctx);
/* Per-token outputs, off by default. With logits_all on, each pykv_decode keeps the logits
 * of every token it evaluates (n_vocab floats per token: perplexity, the log-probabilities
 * of a prompt); with embeddings on, each token's hidden state after the output norm (n_embd
 * floats per token: the input of the output layer, llama.cpp's embeddings). The getters
 * return the rows of the last pykv_decode call, one per token in order (*n_rows of them),
 * owned by ctx and valid until the next decode, reset, truncate or switch; NULL (and
 * *n_rows = 0) when the output is off or that call failed. The memory grows to the longest
 * call's tokens and is returned when the output is switched off. */
PYKV_API pykv_status pykv_set_logits_all(pykv_context *ctx, int32_t on);
PYKV_API pykv_status pykv_set_embeddings(pykv_context *ctx, int32_t on);
PYKV_API const float *pykv_get_logits_all(const pykv_context *ctx, int32_t *n_rows);
PYKV_API const float *pykv_get_embeddings(const pykv_context *ctx, int32_t *n_rows);
/* Tokens evaluated so far (the next position). */
PYKV_API int32_t     pykv_n_past(const pykv_context *ctx);
PYKV_API int32_t     pykv_n_ctx(const pykv_context *ctx);
/* Nonzero when the cache is what a single pykv_decode() of its pykv_n_past tokens on an empty
 * context would leave, so that the context can stand for a fresh evaluation of exactly those
 * tokens: always with the `full` policy; with an evicting policy only when they came in one
 * call (or a state saved from such a context was loaded), as a later call, a decode step
 * included, meets a cache the earlier ones already compressed. */
PYKV_API int32_t     pykv_is_single_run(const pykv_context *ctx);
/* Forget every token; the cache's memory is returned. */
PYKV_API void        pykv_reset(pykv_context *ctx);
/* Forget the tokens from position n_keep on (0 <= n_keep <= pykv_n_past), so that the next
 * pykv_decode continues after the first n_keep: the cache then holds what a fresh run over
 * those tokens would leave. Only the `full` policy allows it (PYKV_ERR_INVALID_ARG otherwise,
 * even for n_keep = pykv_n_past, and nothing changes): an evicting policy chose what to keep
 * with the later tokens in view. n_keep = 0 is pykv_reset (any policy). The logits are gone
 * unless n_keep is pykv_n_past; as pykv_reset, it forgets a pending cancel. */
PYKV_API pykv_status pykv_truncate(pykv_context *ctx, int32_t n_keep);
/* Save and restore a context's state: its tokens' keys, values and positions (merged
 * entries too), pykv_n_past, the last logits and the policy's own state (per-entry scores,
 * budgets fixed by the last prefill), as bytes (native byte order) that pykv_state_load puts
 * back into a context of the same model shape and KV type whose n_ctx holds them, made with
 * the same policy and settings (budget, window, sink, policy arguments, probe); the context
 * then continues exactly as the saved one would. A load checks the whole buffer (lengths,
 * positions, finite keys and values, the policy's part) before it changes anything; a
 * refused one leaves the context as it was, and one that runs out of
 * memory leaves it empty. States of earlier pykv versions (format 1) are refused. */
PYKV_API pykv_status pykv_state_size(const pykv_context *ctx, size_t *size);
PYKV_API pykv_status pykv_state_save(const pykv_context *ctx, void *dst, size_t size, size_t *written);
PYKV_API pykv_status pykv_state_load(pykv_context *ctx, const void *src, size_t size);
/* The number of tokens (pykv_n_past) a saved state holds, read from its header alone. */
PYKV_API pykv_status pykv_state_n_tokens(const void *src, size_t size, int32_t *n_tokens);
/* Ask a running pykv_decode (or pykv_decode_step) to stop (callable from any thread); it
 * returns PYKV_ERR_CANCELLED. It stops at the next layer boundary, or, with a policy that works
 * layer by layer (every evicting policy), at the next chunk boundary: the chunk it stops in
 * is rolled back exactly, the chunks already done stay (pykv_n_past counts them). A cancel
 * that arrives during the call's last chunk (a decode step is one) lets it finish and is
 * reported all the same. A cancel stays pending until a pykv_decode or pykv_decode_step
 * reports it (one that arrives between two calls, or between two steps, stops the next at its
 * start, before it evaluates anything) or pykv_reset or pykv_truncate clears it. */
PYKV_API void        pykv_cancel(pykv_context *ctx);
/* Progress of a long prompt, for C programs that call pykv_decode (pykv_decode_begin and
 * pykv_decode_step report it without a callback; bindings should use them): pykv_decode (or
 * the step) calls it on the calling thread after each chunk of a multi-token call, with the
 * call's tokens evaluated so far and its total (the last call has n_done == n_total).
 * Returning 0 asks the call to stop, as pykv_cancel does; any other value lets it go on.
 * NULL removes it. It may read the context and call pykv_cancel; the calls that would change
 * the context (pykv_decode, pykv_decode_begin, pykv_decode_step, pykv_reset, pykv_truncate,
 * pykv_state_load, pykv_set_probe, the output switches, pykv_context_set_threads) refuse
 * with PYKV_ERR_INVALID_ARG while the call runs (pykv_reset does nothing and sets the
 * error). */
typedef int (*pykv_progress_callback)(int32_t n_done, int32_t n_total, void *user_data);
PYKV_API void        pykv_set_progress_callback(pykv_context *ctx, pykv_progress_callback callback,
                                                void *user_data);

struct pykv_kv_stats {
    size_t      struct_size;
    int64_t     entries;      /* resident entries over all layers and KV heads */
    int64_t     bytes;        /* bytes allocated for K, V and positions now (with EMS merges, also
                                 each merged list's member counts, offsets and key-norm pool) */
    int64_t     peak_bytes;   /* the most bytes allocated since init or reset */
    int64_t     evicted;      /* entries removed by the policy */
    int64_t     merged;       /* entries folded into others by the policy */
    int32_t     n_layer;
    int32_t     n_head_kv;
    const char *policy;       /* owned by ctx */
    int32_t     kv_type;      /* the keys': PYKV_TYPE_F16, PYKV_TYPE_F32 or PYKV_TYPE_Q8_0 */
    int32_t     kv_type_v;    /* the values' */
    int64_t     device_bytes; /* GPU memory holding the offloaded layers' K and V (rows in steps of 256) */
};
PYKV_API pykv_status pykv_kv_stats(const pykv_context *ctx, struct pykv_kv_stats *stats);
/* Resident entries of (layer, KV head). */
PYKV_API int32_t     pykv_kv_head_entries(const pykv_context *ctx, int32_t layer, int32_t head);
/* The original positions of the entries of (layer, KV head), in cache order. */
PYKV_API pykv_status pykv_kv_head_positions(const pykv_context *ctx, int32_t layer, int32_t head,
                                            pykv_pos *out, int32_t cap, int32_t *n_out);

struct pykv_timings {
    size_t  struct_size;
    double  t_prefill_ms;
    double  t_decode_ms;
    int32_t n_prefill;     /* tokens evaluated in multi-token calls */
    int32_t n_decode;      /* tokens evaluated in single-token calls */
};
PYKV_API void        pykv_get_timings(const pykv_context *ctx, struct pykv_timings *t);
PYKV_API void        pykv_reset_timings(pykv_context *ctx);

/* ---- eviction policies ---- */

PYKV_API int32_t     pykv_policy_count(void);
PYKV_API const char *pykv_policy_name(int32_t i);         /* NULL when out of range */
PYKV_API const char *pykv_policy_description(int32_t i);

/* What a policy does by default. With no budget given, an evicting policy keeps
 * default_budget_frac of the prompt, at least default_budget_min entries per (layer, KV head)
 * (so a short prompt keeps everything); a budget given as a share of the prompt is raised to
 * at least budget_floor entries (or the policy's window or sinks when larger), with one
 * warning (pykv_take_warning). The strings are static. */
struct pykv_policy_info {
    size_t      struct_size;
    const char *name;
    const char *description;
    const char *options;              /* its policy arguments and their defaults, "key=default, ..." */
    const char *choose;               /* one line on when to choose it */
    float       default_budget_frac;
    int32_t     default_budget_min;
    int32_t     budget_floor;
    int32_t     evicts;               /* 0 for `full` (a budget is an error) */
    int32_t     evicts_while_reading; /* 1: evicts after every prefill chunk by itself (take) */
    int32_t     evicts_every_step;    /* 1: decode steps evict too (the cache stays at the budget) */
    int32_t     runs_on_gpu;          /* 1: scores and evicts with the layers on a GPU (n_gpu_layers);
                                         0: a context with it runs every layer on the CPU */
};
PYKV_API pykv_status pykv_policy_get_info(int32_t i, struct pykv_policy_info *info);

/* Nonzero when n_ctx bounds the context's cache rather than its positions: the policy evicts
 * after every prefill chunk (take, or any evicting policy given the policy argument
 * evict_every_chunk=1), so a prompt longer than n_ctx goes through while each (layer, KV
 * head) holds at most n_ctx entries. Decode steps then stop (PYKV_ERR_CONTEXT_FULL) only
 * when a list is full. Other policies: a call's tokens must fit in n_ctx positions. */
PYKV_API int32_t     pykv_cache_bounded(const pykv_context *ctx);
/* The next warning the context gave (a share budget raised to the policy's floor, a budget
 * cut to n_ctx, positions past the model's training context; each kind once per context,
 * also logged at level 2), or NULL when none is left. Owned by ctx. */
PYKV_API const char *pykv_take_warning(pykv_context *ctx);

/* ---- sampling ---- */

struct pykv_sampler_params {
    size_t   struct_size;
    float    temperature;     /* 0 = greedy (default 0.8) */
    int32_t  top_k;           /* 0 = off (default 40) */
    float    top_p;           /* 1 = off (default 0.95) */
    float    min_p;           /* 0 = off (default 0.05) */
    float    repeat_penalty;  /* 1 = off (default 1.0) */
    int32_t  repeat_last_n;   /* tokens the penalties look back over (default 64; -1 = all) */
    float    frequency_penalty; /* subtracted once per occurrence in that window (0 = off) */
    float    presence_penalty;  /* subtracted once if the token occurs there (0 = off) */
    uint32_t seed;            /* PYKV_DEFAULT_SEED = random */
    int32_t  mirostat;        /* 0 = off (default); 1 or 2: Mirostat 1 or 2.0 instead of top-k, top-p, min-p */
    float    mirostat_tau;    /* its target surprise in bits (default 5) */
    float    mirostat_eta;    /* its learning rate (default 0.1) */
    float    typical_p;       /* locally typical sampling, after top-k: 1 = off (default) */
};

PYKV_API void        pykv_sampler_default_params(struct pykv_sampler_params *params);
PYKV_API pykv_status pykv_sampler_init(const struct pykv_sampler_params *params, pykv_sampler **out);
PYKV_API void        pykv_sampler_free(pykv_sampler *smpl);
/* Pick a token from n_vocab logits (not modified). Does not record it: call accept. */
PYKV_API pykv_status pykv_sampler_sample(pykv_sampler *smpl, const float *logits, int32_t n_vocab,
                                         pykv_token *out);
/* Add bias[i] to the logit of tokens[i] before anything else (llama.cpp's logit bias;
   -INFINITY bans a token). Replaces the previous set; n = 0 clears it. A token outside the
   vocabulary is reported by pykv_sampler_sample. */
PYKV_API pykv_status pykv_sampler_set_logit_bias(pykv_sampler *smpl, int32_t n, const pykv_token *tokens,
                                                 const float *bias);
/* Record a token for the penalties. */
PYKV_API void        pykv_sampler_accept(pykv_sampler *smpl, pykv_token token);
PYKV_API void        pykv_sampler_reset(pykv_sampler *smpl);
/* Allow only the tokens the grammar allows now (pykv_grammar_allowed), before anything else.
   The grammar is borrowed: it must outlive the sampler or be cleared (NULL). The sampler
   does not advance it: call pykv_grammar_accept with each token taken. */
PYKV_API pykv_status pykv_sampler_set_grammar(pykv_sampler *smpl, pykv_grammar *grammar);

/* ---- grammars (llama.cpp's GBNF) ---- */

/* Parse GBNF text (rules `name ::= ...`; root: the start rule, "root" when NULL) for the
   model's vocabulary. Errors give the line and column, an undefined or left-recursive rule.
   Groups nest at most 256 deep and a {m,n} count is at most 4096 (PYKV_ERR_INVALID_ARG past
   either); parsing is linear in the grammar's size and recurses only per open group.
   model NULL only checks the text: allowed and accept then refuse. */
PYKV_API pykv_status pykv_grammar_init(const pykv_model *model, const char *text, const char *root,
                                       pykv_grammar **out);
PYKV_API void        pykv_grammar_free(pykv_grammar *grammar);
/* allowed[t] = 1 for each token that can come next: its text continues a match of the grammar,
   or it ends generation and the text so far is a complete match. */
PYKV_API pykv_status pykv_grammar_allowed(pykv_grammar *grammar, uint8_t *allowed, int32_t n_vocab);
/* Advance past a generated token; an error (and no change) when the grammar does not allow it. */
PYKV_API pykv_status pykv_grammar_accept(pykv_grammar *grammar, pykv_token token);
/* 1 when the text accepted so far is a complete match of the start rule. */
PYKV_API int32_t     pykv_grammar_is_complete(const pykv_grammar *grammar);
/* Back to the start, nothing accepted. */
PYKV_API pykv_status pykv_grammar_reset(pykv_grammar *grammar);

/* --- cffi end --- */

#ifdef __cplusplus
}
#endif

#endif /* PYKV_H */
