// fuzz_inputs.c - damaged inputs through the public API, for AddressSanitizer and
// UndefinedBehaviorSanitizer (tests/run.sh runs it on the ASan build with tiny models written
// by the Python fixtures). Each mode mutates a valid input a few bytes at a time with a seeded
// generator, so a run is repeatable, and uses whatever still loads:
//
//   fuzz_inputs model MODEL.gguf HEADER_BYTES ITERS SEED   mutated metadata and tensor infos
//       (the first HEADER_BYTES), then tokenize, a context for each policy in turn, a prefill
//       and a decode step
//   fuzz_inputs state MODEL.gguf ITERS SEED               every policy's saved state, mutated
//       or cut short, loaded into a second context that then decodes
//   fuzz_inputs grammar MODEL.gguf ITERS SEED             GBNF texts with pieces inserted,
//       deleted or overwritten, then a random walk through the tokens they allow
//
// A clean error is the expected outcome of most iterations; a sanitizer report, a crash, or an
// allowed token that accept refuses is a failure.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pykv.h"

static uint64_t rng_state;
static uint64_t rnd(void) {   // xorshift64
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static const char *const policies[] = { "full", "streamingllm", "h2o", "snapkv", "pyramidkv", "adakv",
                                        "cake", "lava", "ems", "take" };
#define N_POLICIES (int)(sizeof(policies) / sizeof(policies[0]))

// One to four changes in bytes [0, n): a flipped bit, a random byte, a boundary integer or an
// odd float written over 1..8 bytes, or a small step added to a 32-bit field.
static void mutate(unsigned char *b, size_t n) {
    static const int64_t ints[] = { 0, 1, -1, 2, 7, 8, 31, 32, 33, 64, 127, 128, 255, 256, 4096, 65535, 65536,
                                    0x7fffffff, -0x7fffffffLL - 1, 0xffffffffLL, 0x100000000LL, INT64_MAX };
    static const float floats[] = { 0.0f, -1.0f, 1e30f, -1e30f, 1e-30f, INFINITY, NAN };
    static const int widths[] = { 1, 2, 4, 8 };
    if (n == 0) return;
    for (int k = 1 + (int)(rnd() % 4); k-- > 0;) {
        const size_t at = rnd() % n;
        switch (rnd() % 5) {
        case 0: b[at] ^= (unsigned char)(1u << (rnd() % 8)); break;
        case 1: b[at] = (unsigned char)rnd(); break;
        case 2: {
            const int64_t v = ints[rnd() % (sizeof(ints) / sizeof(ints[0]))];
            const size_t w = (size_t)widths[rnd() % 4];
            if (at + w <= n) memcpy(b + at, &v, w);   // little-endian: the low bytes
            break;
        }
        case 3:
            if (at + 4 <= n) {
                uint32_t v;
                memcpy(&v, b + at, 4);
                v += (uint32_t)(rnd() % 33) - 16u;
                memcpy(b + at, &v, 4);
            }
            break;
        default: {
            const float v = floats[rnd() % (sizeof(floats) / sizeof(floats[0]))];
            if (at + 4 <= n) memcpy(b + at, &v, 4);
        }
        }
    }
}

static unsigned char *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc(*n ? *n : 1);
    if (b && fread(b, 1, *n, f) != *n) { free(b); b = NULL; }
    fclose(f);
    return b;
}

static void random_tokens(pykv_token *t, int n, int32_t n_vocab) {
    for (int i = 0; i < n; i++) t[i] = n_vocab > 0 ? (pykv_token)(rnd() % (uint64_t)n_vocab) : 0;
}

// ---- model: mutated metadata and tensor infos -------------------------------------------

static void use_model(pykv_model *m, int policy) {
    pykv_token toks[64], in[60];
    int32_t n = 0;
    char piece[64];
    pykv_tokenize(m, "Hello world, the cat and the dog", 32, 1, 1, toks, 64, &n);
    for (int32_t i = 0; i < pykv_vocab_n_tokens(m) && i < 300; i++) pykv_token_to_piece(m, i, 1, piece, 64, &n);
    struct pykv_context_params cp;
    pykv_context_default_params(&cp);
    cp.n_ctx = 96;
    cp.n_threads = 1;
    cp.policy = policies[policy];
    cp.budget = policy == 0 ? 0 : 40;   // policies[0] is full: a budget with it is an error
    pykv_context *ctx = NULL;
    if (pykv_context_init(m, &cp, &ctx) != PYKV_OK) return;
    random_tokens(in, 60, pykv_vocab_n_tokens(m));   // past the budget: the policy evicts
    if (pykv_decode(ctx, in, 60) == PYKV_OK && pykv_decode(ctx, in, 1) == PYKV_OK) pykv_get_logits(ctx);
    pykv_context_free(ctx);
}

static int fuzz_model(const char *path, size_t header, long iters) {
    size_t n;
    unsigned char *orig = read_file(path, &n), *b = orig ? malloc(n) : NULL;
    char copy[4096];
    snprintf(copy, sizeof(copy), "%s.fuzz.gguf", path);
    if (!b) { fprintf(stderr, "fuzz_inputs: cannot read %s\n", path); free(orig); return 1; }
    if (header > n) header = n;
    long loaded = 0;
    for (long it = 0; it < iters; it++) {
        memcpy(b, orig, n);
        mutate(b, header);
        FILE *f = fopen(copy, "wb");
        if (!f || fwrite(b, 1, n, f) != n) { fprintf(stderr, "fuzz_inputs: cannot write %s\n", copy); return 1; }
        fclose(f);
        struct pykv_model_params mp;
        pykv_model_default_params(&mp);
        mp.use_mmap = (int32_t)(it & 1);
        pykv_model *m = NULL;
        if (pykv_model_load(copy, &mp, &m) != PYKV_OK) continue;
        loaded++;
        use_model(m, (int)(it % N_POLICIES));
        pykv_model_free(m);
    }
    remove(copy);
    printf("fuzz_inputs model: %ld iterations, %ld loaded\n", iters, loaded);
    free(orig); free(b);
    return 0;
}

// ---- state: every policy's saved state, damaged --------------------------------------------

static int fuzz_states(pykv_model *m, const char *policy, int32_t kv_type, int32_t kv_type_v, long iters,
                       long *loaded) {
    struct pykv_context_params cp;
    pykv_context_default_params(&cp);
    cp.n_ctx = 160;
    cp.n_threads = 2;
    cp.policy = policy;
    cp.budget = strcmp(policy, "full") == 0 ? 0 : 40;   // a budget with full is an error
    cp.kv_type = kv_type;
    cp.kv_type_v = kv_type_v;
    pykv_context *src = NULL, *dst = NULL;
    if (pykv_context_init(m, &cp, &src) != PYKV_OK) return 0;   // a q8_0 cache needs head size % 32 == 0
    if (pykv_context_init(m, &cp, &dst) != PYKV_OK) { pykv_context_free(src); return 0; }
    pykv_token in[100];
    random_tokens(in, 100, pykv_vocab_n_tokens(m));
    int rc = pykv_decode(src, in, 100) != PYKV_OK;
    for (int i = 0; i < 5 && !rc; i++) rc = pykv_decode(src, in + i, 1) != PYKV_OK;
    size_t size = 0, written = 0;
    unsigned char *state = NULL, *b = NULL;
    if (!rc) rc = pykv_state_size(src, &size) != PYKV_OK || !(state = malloc(size)) || !(b = malloc(size)) ||
                  pykv_state_save(src, state, size, &written) != PYKV_OK;
    if (rc) fprintf(stderr, "fuzz_inputs state %s: %s\n", policy, pykv_last_error());
    for (long it = 0; it < iters && !rc; it++) {
        size_t len = written;
        if (rnd() % 8 == 0) len = rnd() % written;   // cut short
        memcpy(b, state, written);
        mutate(b, rnd() % 2 && len > 256 ? 256 : len);   // half the time in the header
        int32_t n_tokens;
        pykv_state_n_tokens(b, len, &n_tokens);
        if (pykv_state_load(dst, b, len) != PYKV_OK) continue;
        (*loaded)++;
        pykv_decode(dst, in, 1);
        pykv_decode(dst, in + 1, 3);
        pykv_reset(dst);
    }
    free(state); free(b);
    pykv_context_free(src); pykv_context_free(dst);
    return rc;
}

// ---- grammar: damaged GBNF ------------------------------------------------------------------

static const char *const grammars[] = {
    "root ::= object\n"
    "value ::= object | array | string | number | (\"true\" | \"false\" | \"null\") ws\n"
    "object ::= \"{\" ws (string \":\" ws value (\",\" ws string \":\" ws value)*)? \"}\" ws\n"
    "array ::= \"[\" ws (value (\",\" ws value)*)? \"]\" ws\n"
    "string ::= \"\\\"\" ([^\"\\\\\\x7F\\x00-\\x1F] | \"\\\\\" ([\"\\\\bfnrt] | \"u\" [0-9a-fA-F]{4}))* \"\\\"\" ws\n"
    "number ::= (\"-\"? ([0-9] | [1-9] [0-9]{0,15})) (\".\" [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws\n"
    "ws ::= | \" \" | \"\\n\" [ \\t]{0,20}\n",
    "root ::= (\"yes\" | \"no\" | [a-z]{2,5} | [^\\n\\x00-\\x1f]* \"!\")+ ws\nws ::= [ \\t\\n]*\n",
    "root ::= item (\", \" item){0,3} \".\"\nitem ::= \"the \" (\"cat\" | \"dog\" | [A-Z] [a-z]+)  # a comment\n",
};

static int fuzz_grammar(pykv_model *m, long iters) {
    static const char *const pieces[] = { "(", ")", "|", "*", "+", "?", "{", "}", "{0,", "{1000000}", "{3,2}", "[", "]",
                                          "[^", "\"", "\\", "\\x", "\\u", "\\U0010FFFF", "::=", "\n", " ", "root",
                                          "x ::= x", "-", "\xc3", "\xff", "#", "." };
    const int32_t n_vocab = pykv_vocab_n_tokens(m);
    uint8_t *allowed = malloc((size_t)n_vocab);
    long parsed = 0;
    for (long it = 0; it < iters; it++) {
        const char *g = grammars[rnd() % (sizeof(grammars) / sizeof(grammars[0]))];
        size_t n = strlen(g);
        char *t = malloc(n + 64);
        memcpy(t, g, n);
        for (int k = rnd() % 4 ? 1 : 2 + (int)(rnd() % 2); k-- > 0;) {
            const size_t at = n ? rnd() % n : 0;
            const char *p = pieces[rnd() % (sizeof(pieces) / sizeof(pieces[0]))];
            const size_t pl = strlen(p);
            switch (rnd() % 3) {
            case 0:
                if (n + pl < strlen(g) + 64) { memmove(t + at + pl, t + at, n - at); memcpy(t + at, p, pl); n += pl; }
                break;
            case 1: {
                size_t del = 1 + rnd() % 8;
                if (at + del > n) del = n - at;
                memmove(t + at, t + at + del, n - at - del);
                n -= del;
                break;
            }
            default:
                if (n) t[at] = (char)rnd();
            }
        }
        t[n] = '\0';
        pykv_grammar *gr = NULL;
        if (pykv_grammar_init(m, t, NULL, &gr) == PYKV_OK) {
            parsed++;
            for (int step = 0; step < 12; step++) {
                if (pykv_grammar_allowed(gr, allowed, n_vocab) != PYKV_OK) break;
                int32_t count = 0, pick, tok = 0;
                for (int32_t i = 0; i < n_vocab; i++) count += allowed[i];
                if (!count) break;
                pick = (int32_t)(rnd() % (uint64_t)count);
                for (int32_t i = 0; i < n_vocab; i++)
                    if (allowed[i] && pick-- == 0) { tok = i; break; }
                if (pykv_grammar_accept(gr, tok) != PYKV_OK) {
                    fprintf(stderr, "fuzz_inputs grammar: allowed token %d refused: %s\n%s\n", tok, pykv_last_error(), t);
                    free(t); free(allowed); pykv_grammar_free(gr);
                    return 1;
                }
                pykv_grammar_accept(gr, (pykv_token)(rnd() % (uint64_t)n_vocab));   // may be refused, cleanly
            }
            pykv_grammar_is_complete(gr);
            pykv_grammar_reset(gr);
            pykv_grammar_free(gr);
        }
        free(t);
    }
    printf("fuzz_inputs grammar: %ld iterations, %ld parsed\n", iters, parsed);
    free(allowed);
    return 0;
}

int main(int argc, char **argv) {
    const int is_model = argc == 6 && strcmp(argv[1], "model") == 0;
    if (!is_model && (argc != 5 || (strcmp(argv[1], "state") && strcmp(argv[1], "grammar")))) {
        fprintf(stderr, "usage: fuzz_inputs model MODEL.gguf HEADER_BYTES ITERS SEED\n"
                        "       fuzz_inputs state|grammar MODEL.gguf ITERS SEED\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IONBF, 0);   // a sanitizer report ends the process with _exit
    rng_state = 0x9E3779B97F4A7C15ull * (strtoull(argv[argc - 1], NULL, 10) + 1);
    const long iters = atol(argv[argc - 2]);
    if (is_model) return fuzz_model(argv[2], strtoull(argv[3], NULL, 10), iters);
    struct pykv_model_params mp;
    pykv_model_default_params(&mp);
    pykv_model *m = NULL;
    if (pykv_model_load(argv[2], &mp, &m) != PYKV_OK) {
        fprintf(stderr, "fuzz_inputs: %s\n", pykv_last_error());
        return 1;
    }
    int rc = 0;
    if (strcmp(argv[1], "grammar") == 0) {
        rc = fuzz_grammar(m, iters);
    } else {
        long loaded = 0;
        const int32_t kv_types[][2] = { { PYKV_TYPE_F16, PYKV_TYPE_F16 }, { PYKV_TYPE_F32, PYKV_TYPE_F32 },
                                        { PYKV_TYPE_Q8_0, PYKV_TYPE_Q8_0 }, { PYKV_TYPE_Q8_0, PYKV_TYPE_F16 },
                                        { PYKV_TYPE_F16, PYKV_TYPE_Q8_0 } };   // keys, values
        const int n_types = (int)(sizeof(kv_types) / sizeof(kv_types[0]));
        for (int p = 0; p < N_POLICIES && !rc; p++)
            for (int k = 0; k < n_types && !rc; k++)
                rc = fuzz_states(m, policies[p], kv_types[k][0], kv_types[k][1], iters / (n_types * N_POLICIES), &loaded);
        printf("fuzz_inputs state: %ld iterations, %ld loaded\n", iters, loaded);
    }
    pykv_model_free(m);
    return rc;
}
