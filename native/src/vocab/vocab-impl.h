// vocab-impl.h - the inside of struct vocab, shared by vocab.c, vocab-bpe.c and vocab-spm.c.
#pragma once
#include <stdint.h>
#include "pykv.h"
#include "vocab/vocab.h"

enum vocab_kind { VOCAB_SPM = 0, VOCAB_BPE = 1 };

// Pre-tokenizers of BPE vocabularies (tokenizer.ggml.pre), as llama.cpp groups them.
enum vocab_pre {
    VOCAB_PRE_DEFAULT = 0,  // llama.cpp's fallback: punctuation runs, GPT-2, digit runs, 3 digits
    VOCAB_PRE_GPT2,         // the GPT-2 regex alone
    VOCAB_PRE_LLAMA3,       // the Llama 3 regex (\p{N}{1,3})
    VOCAB_PRE_QWEN2,        // the Llama 3 regex with single digits
    VOCAB_PRE_SMOLLM,       // single digits, then the GPT-2 regex (smollm, starcoder, ...)
};

// GGUF token types (llama.cpp's llama_token_type).
enum vocab_token_type {
    TOKEN_UNDEFINED = 0, TOKEN_NORMAL = 1, TOKEN_UNKNOWN = 2, TOKEN_CONTROL = 3,
    TOKEN_USER_DEFINED = 4, TOKEN_UNUSED = 5, TOKEN_BYTE = 6,
};

struct vocab_token {
    const char *text;   // into vocab->arena, not NUL-terminated
    int32_t     len;
    int32_t     type;   // enum vocab_token_type
    float       score;
    int32_t     byte;   // TOKEN_BYTE: the byte value of "<0xXX>"; -1 otherwise
};

// Open-addressing hash from token text to the first id with that text.
struct vocab_text_map {
    uint32_t mask;      // capacity - 1 (a power of two)
    int32_t *slots;     // token ids; -1 empty
};

// Open-addressing hash from a BPE pair (left id, right id) to its rank and result.
struct vocab_merge_slot {
    uint64_t key;       // (left << 32 | right) + 1; 0 empty
    int32_t  rank;
    int32_t  merged;
};
struct vocab_merge_map {
    uint32_t                 mask;
    struct vocab_merge_slot *slots;
};

struct vocab {
    int32_t             kind;       // enum vocab_kind
    int32_t             pre;        // enum vocab_pre (BPE)
    int32_t             n_tokens;
    struct vocab_token *tokens;
    char               *arena;      // every token's text
    struct vocab_text_map text_map;

    pykv_token bos, eos, eot, eom, unk, pad;   // -1 when none
    int        add_bos, add_eos, add_space_prefix, ignore_merges;
    pykv_token *eog;                           // end-of-generation ids
    int32_t     n_eog;

    // Tokens matched whole in the text (control, user-defined, unknown), sorted by first
    // byte then by length, longest first; special_start[b] indexes the run of byte b.
    int32_t *special;
    int32_t  n_special;
    int32_t  special_start[257];

    // SPM: the token of each byte ("<0xXX>", else the byte itself as text, else unk).
    // BPE: the token of each byte's GPT-2 character; -1 when the vocabulary lacks it.
    pykv_token byte_token[256];
    struct vocab_merge_map merges;   // BPE only
};

// A growable list of tokens the tokenizers append to.
struct vocab_tokvec {
    pykv_token *data;
    int32_t     n, cap;
};
pykv_status vocab_tokvec_push(struct vocab_tokvec *tv, pykv_token t);

pykv_token  vocab_text_to_token(const struct vocab *v, const char *text, int32_t len);

// Tokenize one stretch of plain text (no special tokens in it), appending to out.
pykv_status vocab_bpe_tokenize(const struct vocab *v, const char *text, int32_t len,
                               struct vocab_tokvec *out);
// SPM: add_prefix puts a space before the text (the SentencePiece dummy prefix).
pykv_status vocab_spm_tokenize(const struct vocab *v, const char *text, int32_t len, int add_prefix,
                               struct vocab_tokvec *out);

// BPE load step: pre-tokenizer from its name, byte tokens, merges.
pykv_status vocab_bpe_init(struct vocab *v, const struct gguf_file *f);
// SPM load step: byte tokens.
pykv_status vocab_spm_init(struct vocab *v);

// Decode a BPE token's text (GPT-2 characters) into bytes; returns the byte count written
// (at most cap) and stores the full length in *need.
int32_t vocab_bpe_decode_text(const char *text, int32_t len, char *buf, int32_t cap, int32_t *need);
