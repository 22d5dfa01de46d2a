// grammar.h - llama.cpp's GBNF grammars: the parsed rules (grammar-parse.c) and the matcher
// that follows them through generated text (grammar.c). Internal; pykv.h has the public part.
#pragma once
#include "pykv.h"

#include <stdint.h>

// One grammar element. A rule is its alternatives one after another, each ended by
// GRAMMAR_END, so a position (an index into grammar_rules.elems) always sits in one sequence.
enum grammar_elem_type {
    GRAMMAR_END,        // end of an alternative
    GRAMMAR_RULE_REF,   // a: the rule's index
    GRAMMAR_CHARS,      // one code point in ranges[a .. a+b)
    GRAMMAR_CHARS_NOT,  // one code point outside them ([^...]; `.` is CHARS_NOT with no range)
};

struct grammar_elem {
    uint8_t type;
    int32_t a, b;
};

struct grammar_range {
    uint32_t lo, hi;  // inclusive code points
};

struct grammar_rules {
    struct grammar_elem  *elems;
    int32_t               n_elems;
    struct grammar_range *ranges;
    int32_t               n_ranges;
    int32_t              *alt_start;  // position of each alternative's first element
    int32_t              *rule_alt;   // rule r's alternatives: alt_start[rule_alt[r] .. rule_alt[r+1])
    int32_t               n_rules;
    int32_t               root;
    int64_t               parse_work;  // name probes and the checks' steps: tests see it grow linearly
};

// Make room for `need` items of `size` bytes in *v (capacity *cap, doubled as needed).
pykv_status grammar_grow(void **v, int32_t *cap, int32_t need, size_t size);

// Parse GBNF text (root: the start rule's name). On failure the error names the line and
// column, an undefined rule, a missing root or a left-recursive rule.
pykv_status grammar_parse(const char *text, const char *root, struct grammar_rules *out);
void        grammar_rules_free(struct grammar_rules *r);

static inline int grammar_is_end(const struct grammar_rules *r, int32_t pos) {
    return r->elems[pos].type == GRAMMAR_END;
}

// Whether code point cp matches the character element at pos.
int grammar_char_matches(const struct grammar_rules *r, int32_t pos, uint32_t cp);

// The matcher behind pykv_grammar, for tests without a model: token t's text is
// pieces[offsets[t] .. offsets[t+1]); eog[t] marks end-of-generation tokens (allowed once the
// grammar is complete). Copies what it needs.
pykv_status grammar_init_tokens(const char *text, const char *root, int32_t n_tokens, const char *pieces,
                                const int32_t *offsets, const uint8_t *eog, pykv_grammar **out);

// Whether the grammar allows token now (pykv_grammar_allowed for one token; made with tokens).
pykv_status grammar_token_allowed(pykv_grammar *g, pykv_token token, int *allowed);

// PYKV_OK when g was made with a model of n_vocab tokens; else an error naming fn.
pykv_status grammar_check_vocab(const pykv_grammar *g, const char *fn, int32_t n_vocab);
