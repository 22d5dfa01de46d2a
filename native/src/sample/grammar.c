// grammar.c - following a GBNF grammar through generated text, token by token.
//
// The matcher's state is a set of stacks of grammar positions. A stack's top is the character
// element to match next and the positions below it are where to go on once the top's rule is
// done; the empty stack means the text so far is a complete match. Each rule reference on top
// is expanded at once into its alternatives, so every top is a character element.
//
// A token is allowed when its text (UTF-8, possibly ending inside a character) can follow
// some stack. Candidates are checked together: every token whose first character matches a
// stack's top leads to the same next stacks, so those are computed once per stack and level,
// not once per token.
#include "sample/grammar.h"

#include "core/error.h"
#include "model/model.h"
#include "vocab/unicode.h"
#include "vocab/vocab.h"

#include <stdlib.h>
#include <string.h>

#define GRAMMAR_MAX_STACKS 8192   // alive alternatives at one point: beyond it, an error, not a stall
#define GRAMMAR_MAX_EXPANSION (1 << 20)   // alternatives visited to expand one stack: beyond it, an error

struct stack {
    int32_t  n;
    int32_t *pos;
};

struct stack_set {
    struct stack *s;
    int32_t n, cap;
    int32_t *index;      // hash table of the stacks: s's index or -1; at most half full
    int32_t  cap_index;  // 0 or a power of two
};

// Token t's text decoded: code points cps[off[t] .. off[t+1]), then possibly the first bytes of
// one more character, which could be any code point in [tail_lo, tail_hi] (has_tail).
struct decoded {
    uint32_t *cps;
    int32_t  *off;
    uint32_t *tail_lo, *tail_hi;
    uint8_t  *has_tail;
    uint8_t  *invalid;   // not UTF-8 (or no text at all)
};

struct pykv_grammar {
    struct grammar_rules rules;
    struct stack_set stacks;
    uint8_t pending[4];     // the start of a character the last accepted token ended inside
    int32_t n_pending;

    int32_t  n_tokens;      // 0 when made without a model
    char    *pieces;
    int32_t *piece_off;
    uint8_t *eog;
    struct decoded alone;   // each token decoded with nothing pending
};

// ---- stacks ----

static void set_free(struct stack_set *S) {
    for (int32_t i = 0; i < S->n; i++) free(S->s[i].pos);
    free(S->s);
    free(S->index);
    memset(S, 0, sizeof(*S));
}

static uint32_t stack_hash(const int32_t *pos, int32_t n) {   // FNV-1a over the positions
    uint32_t h = 2166136261u ^ (uint32_t)n;
    for (int32_t i = 0; i < n; i++) h = (h ^ (uint32_t)pos[i]) * 16777619u;
    return h;
}

// The slot of stack pos[0..n) in S's table: where it is, or the empty slot it would take.
static int32_t set_slot(const struct stack_set *S, const int32_t *pos, int32_t n) {
    uint32_t mask = (uint32_t)S->cap_index - 1;
    for (uint32_t i = stack_hash(pos, n) & mask;; i = (i + 1) & mask) {
        int32_t k = S->index[i];
        if (k < 0 || (S->s[k].n == n && (n == 0 || memcmp(S->s[k].pos, pos, (size_t)n * sizeof(*pos)) == 0)))
            return (int32_t)i;
    }
}

// Room in the table for one more stack (rebuilt at twice the size when it would pass half full).
static pykv_status set_reserve(struct stack_set *S) {
    if (2 * (S->n + 1) <= S->cap_index) return PYKV_OK;
    int32_t cap = S->cap_index ? 2 * S->cap_index : 16;
    int32_t *index = malloc((size_t)cap * sizeof(*index));
    if (!index) return pykv_error(PYKV_ERR_NOMEM, "grammar: out of memory");
    free(S->index);
    S->index = index;
    S->cap_index = cap;
    for (int32_t i = 0; i < cap; i++) S->index[i] = -1;
    for (int32_t k = 0; k < S->n; k++) S->index[set_slot(S, S->s[k].pos, S->s[k].n)] = k;
    return PYKV_OK;
}

// Add stack pos[0..n) to S unless it is there already (found through the hash table, so
// building a set of many stacks costs linear time, not quadratic).
static pykv_status set_add(struct stack_set *S, const int32_t *pos, int32_t n) {
    PYKV_TRY(set_reserve(S));
    int32_t slot = set_slot(S, pos, n);
    if (S->index[slot] >= 0) return PYKV_OK;
    if (S->n == GRAMMAR_MAX_STACKS) {
        return pykv_error(PYKV_ERR_INVALID_ARG, "grammar: more than %d ways to continue at once "
                          "(the grammar is too ambiguous)", GRAMMAR_MAX_STACKS);
    }
    PYKV_TRY(grammar_grow((void **)&S->s, &S->cap, S->n + 1, sizeof(*S->s)));
    int32_t *copy = malloc((size_t)(n ? n : 1) * sizeof(*copy));
    if (!copy) return pykv_error(PYKV_ERR_NOMEM, "grammar: out of memory");
    if (n) memcpy(copy, pos, (size_t)n * sizeof(*pos));
    S->index[slot] = S->n;
    S->s[S->n++] = (struct stack){ n, copy };
    return PYKV_OK;
}

// One rule reference being expanded on top of a stack of n positions: the reference's position
// (restored in pos[n-1] when done), the positions below its alternatives, the next alternative.
struct expand_frame {
    int32_t n, top, base, alt;
};

// Scratch of expand: the stack being built and the references being expanded on it. Both grow
// on the heap, so a grammar whose rules nest deep costs memory, not the thread's stack.
struct expansion {
    int32_t *pos;
    int32_t  cap_pos;
    struct expand_frame *frames;
    int32_t  cap_frames;
};

static void expansion_free(struct expansion *x) {
    free(x->pos);
    free(x->frames);
    memset(x, 0, sizeof(*x));
}

static int tops_rule(const struct grammar_rules *g, const int32_t *pos, int32_t n) {
    return n > 0 && g->elems[pos[n - 1]].type == GRAMMAR_RULE_REF;
}

// Start expanding the rule reference on top of x->pos[0..n): its alternatives go where it is,
// above where to go on once the rule is done.
static pykv_status push_frame(const struct grammar_rules *g, struct expansion *x, int32_t n, int32_t *depth) {
    PYKV_TRY(grammar_grow((void **)&x->frames, &x->cap_frames, *depth + 1, sizeof(*x->frames)));
    int32_t top = x->pos[n - 1], base = n - 1;
    if (!grammar_is_end(g, top + 1)) x->pos[base++] = top + 1;
    x->frames[(*depth)++] = (struct expand_frame){ n, top, base, g->rule_alt[g->elems[top].a] };
    return PYKV_OK;
}

// Add the stack x->pos[0..n) to out with any rule reference on top replaced by each of its
// alternatives, again until every top is a character (or the stack is empty). Depth first, as
// a recursion would, but its frames are on the heap; the positions are left as they were found.
// GRAMMAR_MAX_EXPANSION bounds the alternatives visited: a grammar that reaches the same stacks
// along exponentially many paths (r1 ::= r2 | r2, r2 ::= r3 | r3, ...) fails instead of stalling.
static pykv_status expand(const struct grammar_rules *g, struct expansion *x, int32_t n, struct stack_set *out) {
    if (!tops_rule(g, x->pos, n)) return set_add(out, x->pos, n);
    int32_t depth = 0, visited = 0;
    PYKV_TRY(push_frame(g, x, n, &depth));
    while (depth > 0) {
        struct expand_frame *f = &x->frames[depth - 1];
        if (f->alt == g->rule_alt[g->elems[f->top].a + 1]) {
            x->pos[f->n - 1] = f->top;
            depth--;
            continue;
        }
        if (++visited > GRAMMAR_MAX_EXPANSION) {
            return pykv_error(PYKV_ERR_INVALID_ARG, "grammar: more than %d rule alternatives to expand at one point "
                              "(the grammar is too ambiguous or its rules nest too deep)", GRAMMAR_MAX_EXPANSION);
        }
        int32_t m = f->base, start = g->alt_start[f->alt++];
        PYKV_TRY(grammar_grow((void **)&x->pos, &x->cap_pos, m + 1, sizeof(*x->pos)));
        if (!grammar_is_end(g, start)) x->pos[m++] = start;
        if (tops_rule(g, x->pos, m)) PYKV_TRY(push_frame(g, x, m, &depth));   // f may have moved
        else PYKV_TRY(set_add(out, x->pos, m));
    }
    return PYKV_OK;
}

// The stacks after s's top character matched: pop it, go on in its sequence, expand.
static pykv_status advance(const struct grammar_rules *g, const struct stack *s, struct stack_set *out) {
    struct expansion x = { 0 };
    PYKV_TRY(grammar_grow((void **)&x.pos, &x.cap_pos, s->n, sizeof(*x.pos)));
    int32_t top = s->pos[s->n - 1], n = s->n - 1;
    memcpy(x.pos, s->pos, (size_t)n * sizeof(*x.pos));
    if (!grammar_is_end(g, top + 1)) x.pos[n++] = top + 1;
    pykv_status st = expand(g, &x, n, out);
    expansion_free(&x);
    return st;
}

static pykv_status initial_stacks(const struct grammar_rules *g, struct stack_set *out) {
    struct expansion x = { 0 };
    pykv_status st = grammar_grow((void **)&x.pos, &x.cap_pos, 1, sizeof(*x.pos));
    for (int32_t a = g->rule_alt[g->root]; a < g->rule_alt[g->root + 1] && st == PYKV_OK; a++) {
        int32_t n = 0, start = g->alt_start[a];
        if (!grammar_is_end(g, start)) x.pos[n++] = start;
        st = expand(g, &x, n, out);
    }
    expansion_free(&x);
    return st;
}

// A character that may still be any code point in [lo, hi] can match the element at pos.
static int partial_matches(const struct grammar_rules *g, int32_t pos, uint32_t lo, uint32_t hi) {
    const struct grammar_elem *e = &g->elems[pos];
    for (int32_t i = e->a; i < e->a + e->b; i++) {
        const struct grammar_range *r = &g->ranges[i];
        if (e->type == GRAMMAR_CHARS && r->lo <= hi && r->hi >= lo) return 1;
        if (e->type == GRAMMAR_CHARS_NOT && r->lo <= lo && r->hi >= hi) return 0;
    }
    return e->type == GRAMMAR_CHARS_NOT;
}

// ---- UTF-8 ----

// The code points a character cut off after its first n bytes may still become, [*lo, *hi];
// 0 when s[0..n) is no such start: n reaches the lead byte's length (a whole character, which
// unicode_decode has refused), a bad lead or continuation byte, or no completion is valid
// UTF-8 (overlong, a surrogate, beyond U+10FFFF).
static int cut_off_range(const uint8_t *s, int32_t n, uint32_t *lo, uint32_t *hi) {
    static const uint32_t least[5] = { 0, 0, 0x80, 0x800, 0x10000 };   // shorter forms are overlong
    uint8_t b = s[0];
    int len = (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    if (!len || n >= len) return 0;
    uint32_t v = b & (0x7Fu >> len);
    for (int32_t j = 1; j < n; j++) {
        if ((s[j] & 0xC0) != 0x80) return 0;
        v = (v << 6) | (s[j] & 0x3F);
    }
    int missing = 6 * (len - n);   // the missing continuation bytes may hold anything
    uint32_t first = v << missing, last = first | ((1u << missing) - 1);
    if (first < least[len]) first = least[len];
    if (last > 0x10FFFF) last = 0x10FFFF;
    if (first > last || (first >= 0xD800 && last <= 0xDFFF)) return 0;
    *lo = first;
    *hi = last;
    return 1;
}

// Decode s[0..n) into cps (unicode_decode's strict UTF-8); a character cut off at the end
// gives the code points it may still become, [lo, hi]. Returns 0 when the bytes are not UTF-8.
static int decode_utf8(const uint8_t *s, int32_t n, uint32_t *cps, int32_t *n_cps, uint32_t *lo, uint32_t *hi,
                       uint8_t *has_tail, int32_t *n_whole) {
    int32_t i = 0, k = 0;
    *has_tail = 0;
    while (i < n) {
        int len = 1;
        uint32_t cp = unicode_decode((const char *)s + i, (size_t)(n - i), &len);
        if (cp == UNICODE_INVALID) {
            if (!cut_off_range(s + i, n - i, lo, hi)) return 0;
            *has_tail = 1;
            break;
        }
        cps[k++] = cp;
        i += len;
    }
    *n_cps = k;
    if (n_whole) *n_whole = i;   // bytes of the whole characters
    return 1;
}

static void decoded_free(struct decoded *d) {
    free(d->cps); free(d->off); free(d->tail_lo); free(d->tail_hi); free(d->has_tail); free(d->invalid);
    memset(d, 0, sizeof(*d));
}

// The text of tokens[0..n) (every token when tokens is NULL) after the pending bytes
// prefix[0..n_prefix), decoded; entry i is tokens[i]'s.
static pykv_status decode_tokens(const pykv_grammar *g, const uint8_t *prefix, int32_t n_prefix,
                                 const pykv_token *tokens, int32_t n, struct decoded *d) {
    int32_t total = 0, longest = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t t = tokens ? tokens[i] : i, len = g->piece_off[t + 1] - g->piece_off[t];
        total += len + n_prefix;
        if (len > longest) longest = len;
    }
    memset(d, 0, sizeof(*d));
    d->cps = malloc((size_t)(total + 1) * sizeof(*d->cps));
    d->off = malloc((size_t)(n + 1) * sizeof(*d->off));
    d->tail_lo = malloc((size_t)n * sizeof(*d->tail_lo) + 1);
    d->tail_hi = malloc((size_t)n * sizeof(*d->tail_hi) + 1);
    d->has_tail = malloc((size_t)n + 1);
    d->invalid = malloc((size_t)n + 1);
    uint8_t *bytes = malloc((size_t)(n_prefix + longest) + 1);
    if (!d->cps || !d->off || !d->tail_lo || !d->tail_hi || !d->has_tail || !d->invalid || !bytes) {
        free(bytes);
        decoded_free(d);
        return pykv_error(PYKV_ERR_NOMEM, "grammar: out of memory for the vocabulary's text");
    }
    int32_t at = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t t = tokens ? tokens[i] : i, len = g->piece_off[t + 1] - g->piece_off[t], n_cps = 0;
        if (n_prefix) memcpy(bytes, prefix, (size_t)n_prefix);
        memcpy(bytes + n_prefix, g->pieces + g->piece_off[t], (size_t)len);
        d->off[i] = at;
        d->invalid[i] = len == 0 || !decode_utf8(bytes, n_prefix + len, d->cps + at, &n_cps, &d->tail_lo[i],
                                                 &d->tail_hi[i], &d->has_tail[i], NULL);
        if (!d->invalid[i]) at += n_cps;
    }
    d->off[n] = at;
    free(bytes);
    return PYKV_OK;
}

// ---- candidates ----

// A token being checked: its text is entry `slot` of the decoded texts, its answer allowed[slot].
struct cand {
    int32_t slot;
    int32_t i;   // next code point to match
};

// allowed[slot] = 1 for each candidate whose remaining text some stack of S can take.
static pykv_status allow_candidates(const pykv_grammar *g, const struct decoded *d, const struct stack_set *S,
                                    const struct cand *c, int32_t n, uint8_t *allowed) {
    struct cand *next = malloc((size_t)(n ? n : 1) * sizeof(*next));
    if (!next) return pykv_error(PYKV_ERR_NOMEM, "grammar: out of memory");
    pykv_status st = PYKV_OK;
    for (int32_t k = 0; k < S->n && st == PYKV_OK; k++) {
        const struct stack *s = &S->s[k];
        int32_t top = s->n ? s->pos[s->n - 1] : -1, n_next = 0;
        for (int32_t j = 0; j < n; j++) {
            int32_t t = c[j].slot;
            if (allowed[t]) continue;
            int at_end = d->off[t] + c[j].i == d->off[t + 1];
            if (at_end) {
                if (!d->has_tail[t] || (top >= 0 && partial_matches(&g->rules, top, d->tail_lo[t], d->tail_hi[t])))
                    allowed[t] = 1;
            } else if (top >= 0 && grammar_char_matches(&g->rules, top, d->cps[d->off[t] + c[j].i])) {
                next[n_next++] = (struct cand){ t, c[j].i + 1 };
            }
        }
        if (n_next == 0) continue;
        struct stack_set after = { 0 };
        st = advance(&g->rules, s, &after);
        if (st == PYKV_OK) st = allow_candidates(g, d, &after, next, n_next, allowed);
        set_free(&after);
    }
    free(next);
    return st;
}

static int is_complete(const pykv_grammar *g) {
    for (int32_t i = 0; i < g->stacks.n; i++) if (g->stacks.s[i].n == 0) return 1;
    return 0;
}

// ---- the public API ----

static pykv_status make(const char *text, const char *root, pykv_grammar **out) {
    pykv_grammar *g = calloc(1, sizeof(*g));
    if (!g) return pykv_error(PYKV_ERR_NOMEM, "grammar: out of memory");
    pykv_status st = grammar_parse(text, root, &g->rules);
    if (st == PYKV_OK) st = initial_stacks(&g->rules, &g->stacks);
    if (st != PYKV_OK) {
        pykv_grammar_free(g);
        return st;
    }
    *out = g;
    return PYKV_OK;
}

pykv_status grammar_init_tokens(const char *text, const char *root, int32_t n_tokens, const char *pieces,
                                const int32_t *offsets, const uint8_t *eog, pykv_grammar **out) {
    *out = NULL;
    pykv_grammar *g = NULL;
    PYKV_TRY(make(text, root, &g));
    int32_t bytes = offsets[n_tokens];
    g->n_tokens = n_tokens;
    g->pieces = malloc((size_t)bytes + 1);
    g->piece_off = malloc((size_t)(n_tokens + 1) * sizeof(*g->piece_off));
    g->eog = malloc((size_t)n_tokens + 1);
    pykv_status st = PYKV_OK;
    if (!g->pieces || !g->piece_off || !g->eog) st = pykv_error(PYKV_ERR_NOMEM, "grammar: out of memory");
    if (st == PYKV_OK) {
        memcpy(g->pieces, pieces, (size_t)bytes);
        memcpy(g->piece_off, offsets, (size_t)(n_tokens + 1) * sizeof(*offsets));
        memcpy(g->eog, eog, (size_t)n_tokens);
        st = decode_tokens(g, NULL, 0, NULL, n_tokens, &g->alone);
    }
    if (st != PYKV_OK) {
        pykv_grammar_free(g);
        return st;
    }
    *out = g;
    return PYKV_OK;
}

// Each token's text as it is generated (special tokens have none), end-of-generation marks.
static pykv_status model_tokens(const pykv_model *model, char **pieces, int32_t **offsets, uint8_t **eog,
                                int32_t *n_out) {
    const struct vocab *v = model_vocab(model);
    int32_t n = vocab_n_tokens(v), cap = 1 << 16, used = 0;
    *pieces = malloc((size_t)cap);
    *offsets = malloc((size_t)(n + 1) * sizeof(**offsets));
    *eog = malloc((size_t)n + 1);
    if (!*pieces || !*offsets || !*eog) return pykv_error(PYKV_ERR_NOMEM, "grammar: out of memory");
    for (int32_t t = 0; t < n; t++) {
        (*offsets)[t] = used;
        (*eog)[t] = (uint8_t)(vocab_is_eog(v, t) != 0);
        int32_t len = 0;
        pykv_status st = vocab_token_to_piece(v, t, 0, *pieces + used, cap - used, &len);
        if (st == PYKV_ERR_BUFFER_TOO_SMALL) {
            while (cap - used < len) cap *= 2;
            char *p = realloc(*pieces, (size_t)cap);
            if (!p) return pykv_error(PYKV_ERR_NOMEM, "grammar: out of memory");
            *pieces = p;
            st = vocab_token_to_piece(v, t, 0, *pieces + used, cap - used, &len);
        }
        PYKV_TRY(st);
        used += len;
    }
    (*offsets)[n] = used;
    *n_out = n;
    return PYKV_OK;
}

pykv_status pykv_grammar_init(const pykv_model *model, const char *text, const char *root, pykv_grammar **out) {
    if (!out) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_grammar_init: out is NULL");
    *out = NULL;
    if (!text) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_grammar_init: text is NULL");
    if (!model) return make(text, root, out);
    char *pieces = NULL;
    int32_t *offsets = NULL, n = 0;
    uint8_t *eog = NULL;
    pykv_status st = model_tokens(model, &pieces, &offsets, &eog, &n);
    if (st == PYKV_OK) st = grammar_init_tokens(text, root, n, pieces, offsets, eog, out);
    free(pieces);
    free(offsets);
    free(eog);
    return st;
}

void pykv_grammar_free(pykv_grammar *g) {
    if (!g) return;
    grammar_rules_free(&g->rules);
    set_free(&g->stacks);
    free(g->pieces);
    free(g->piece_off);
    free(g->eog);
    decoded_free(&g->alone);
    free(g);
}

pykv_status pykv_grammar_reset(pykv_grammar *g) {
    if (!g) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_grammar_reset: grammar is NULL");
    struct stack_set fresh = { 0 };
    PYKV_TRY(initial_stacks(&g->rules, &fresh));
    set_free(&g->stacks);
    g->stacks = fresh;
    g->n_pending = 0;
    return PYKV_OK;
}

int32_t pykv_grammar_is_complete(const pykv_grammar *g) {
    return g && is_complete(g) && g->n_pending == 0;
}

pykv_status grammar_check_vocab(const pykv_grammar *g, const char *fn, int32_t n_vocab) {
    if (!g) return pykv_error(PYKV_ERR_INVALID_ARG, "%s: grammar is NULL", fn);
    if (!g->n_tokens) return pykv_error(PYKV_ERR_INVALID_ARG, "%s: the grammar was made without a model", fn);
    if (n_vocab != g->n_tokens) {
        return pykv_error(PYKV_ERR_INVALID_ARG, "%s: %d tokens given, the grammar's vocabulary has %d", fn,
                          (int)n_vocab, (int)g->n_tokens);
    }
    return PYKV_OK;
}

pykv_status pykv_grammar_allowed(pykv_grammar *g, uint8_t *allowed, int32_t n_vocab) {
    PYKV_TRY(grammar_check_vocab(g, "pykv_grammar_allowed", n_vocab));
    if (!allowed) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_grammar_allowed: allowed is NULL");
    memset(allowed, 0, (size_t)n_vocab);
    struct decoded with_pending = { 0 };
    const struct decoded *d = &g->alone;
    if (g->n_pending) {
        PYKV_TRY(decode_tokens(g, g->pending, g->n_pending, NULL, n_vocab, &with_pending));
        d = &with_pending;
    }
    struct cand *c = calloc((size_t)n_vocab, sizeof(*c));
    if (!c) {
        decoded_free(&with_pending);
        return pykv_error(PYKV_ERR_NOMEM, "grammar: out of memory");
    }
    int32_t n = 0;
    for (int32_t t = 0; t < n_vocab; t++) {
        if (!g->eog[t] && !d->invalid[t]) c[n++] = (struct cand){ t, 0 };
    }
    pykv_status st = allow_candidates(g, d, &g->stacks, c, n, allowed);
    int end_ok = pykv_grammar_is_complete(g);
    for (int32_t t = 0; t < n_vocab; t++) {
        if (g->eog[t]) allowed[t] = (uint8_t)end_ok;
    }
    free(c);
    decoded_free(&with_pending);
    return st;
}

pykv_status grammar_token_allowed(pykv_grammar *g, pykv_token token, int *allowed) {
    *allowed = 0;
    if (g->eog[token]) {
        *allowed = pykv_grammar_is_complete(g);
        return PYKV_OK;
    }
    struct decoded own = { 0 }, view = { 0 };
    if (g->n_pending) {
        PYKV_TRY(decode_tokens(g, g->pending, g->n_pending, &token, 1, &own));
        view = own;
    } else {   // entry 0 of a view into every token's decoding
        view = (struct decoded){ g->alone.cps, g->alone.off + token, g->alone.tail_lo + token,
                                 g->alone.tail_hi + token, g->alone.has_tail + token, g->alone.invalid + token };
    }
    uint8_t ok = 0;
    struct cand c = { 0, 0 };
    pykv_status st = view.invalid[0] ? PYKV_OK : allow_candidates(g, &view, &g->stacks, &c, 1, &ok);
    *allowed = ok;
    decoded_free(&own);
    return st;
}

pykv_status pykv_grammar_accept(pykv_grammar *g, pykv_token token) {
    PYKV_TRY(grammar_check_vocab(g, "pykv_grammar_accept", g ? g->n_tokens : 0));
    if (token < 0 || token >= g->n_tokens) {
        return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_grammar_accept: token %d is outside the vocabulary (%d tokens)",
                          (int)token, (int)g->n_tokens);
    }
    if (g->eog[token]) {
        if (pykv_grammar_is_complete(g)) return PYKV_OK;
        return pykv_error(PYKV_ERR_INVALID_ARG, "grammar: end of generation (token %d) before the grammar is "
                          "complete", (int)token);
    }
    int32_t len = g->piece_off[token + 1] - g->piece_off[token], n_bytes = g->n_pending + len, n_cps = 0, whole = 0;
    uint8_t *bytes = malloc((size_t)n_bytes + 1);
    uint32_t *cps = malloc(((size_t)n_bytes + 1) * sizeof(*cps));
    uint32_t lo = 0, hi = 0;
    uint8_t has_tail = 0;
    pykv_status st = PYKV_OK;
    struct stack_set cur = { 0 }, next = { 0 };
    if (!bytes || !cps) st = pykv_error(PYKV_ERR_NOMEM, "grammar: out of memory");
    if (st == PYKV_OK) {
        memcpy(bytes, g->pending, (size_t)g->n_pending);
        memcpy(bytes + g->n_pending, g->pieces + g->piece_off[token], (size_t)len);
        if (len == 0 || !decode_utf8(bytes, n_bytes, cps, &n_cps, &lo, &hi, &has_tail, &whole))
            st = pykv_error(PYKV_ERR_INVALID_ARG, "grammar: token %d has no text the grammar can match", (int)token);
    }
    // Walk the characters through a copy of the stacks; the grammar changes only on success.
    for (int32_t i = 0; i < g->stacks.n && st == PYKV_OK; i++) st = set_add(&cur, g->stacks.s[i].pos, g->stacks.s[i].n);
    for (int32_t i = 0; i < n_cps && st == PYKV_OK; i++) {
        for (int32_t k = 0; k < cur.n && st == PYKV_OK; k++) {
            const struct stack *s = &cur.s[k];
            if (s->n && grammar_char_matches(&g->rules, s->pos[s->n - 1], cps[i])) st = advance(&g->rules, s, &next);
        }
        set_free(&cur);
        cur = next;
        memset(&next, 0, sizeof(next));
        if (st == PYKV_OK && cur.n == 0) {
            st = pykv_error(PYKV_ERR_INVALID_ARG, "grammar: token %d does not continue the grammar (character %d "
                            "of its text is not allowed there)", (int)token, (int)i + 1);
        }
    }
    if (st == PYKV_OK && has_tail) {
        int ok = 0;
        for (int32_t k = 0; k < cur.n && !ok; k++) {
            ok = cur.s[k].n && partial_matches(&g->rules, cur.s[k].pos[cur.s[k].n - 1], lo, hi);
        }
        if (!ok) st = pykv_error(PYKV_ERR_INVALID_ARG, "grammar: token %d ends in a character the grammar does "
                                 "not allow there", (int)token);
    }
    if (st == PYKV_OK) {
        set_free(&g->stacks);
        g->stacks = cur;
        memset(&cur, 0, sizeof(cur));
        g->n_pending = n_bytes - whole;   // the start of a character the next token ends
        memcpy(g->pending, bytes + whole, (size_t)g->n_pending);
    }
    set_free(&cur);
    set_free(&next);
    free(bytes);
    free(cps);
    return st;
}
