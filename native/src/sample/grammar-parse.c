// grammar-parse.c - GBNF text to grammar_rules: rules `name ::= alternatives`, string literals,
// character classes, `.`, groups, and the repetitions *, +, ?, {m}, {m,}, {m,n}, which become
// generated rules. Checks that every rule used is defined and none is left-recursive (the
// matcher would expand it forever).
//
// Parsing is linear in the text and the grammar it makes: rule names are found through a hash
// table, generated rules are never looked up, and the checks after parsing visit each element
// a bounded number of times. Groups may nest GRAMMAR_MAX_NESTING deep: each level is a few
// frames of recursion, and the bound keeps a parse well inside a small thread's stack.
#include "sample/grammar.h"

#include "core/error.h"
#include "vocab/unicode.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GRAMMAR_MAX_REPEAT 4096      // bound of {m,n}: each copy is expanded in place
#define GRAMMAR_MAX_ELEMS  (1 << 24)
#define GRAMMAR_MAX_NESTING 256      // groups inside groups; real grammars stay within a few dozen

struct elem_vec {
    struct grammar_elem *v;
    int32_t n, cap;
};

struct rule_def {
    char           *name;
    struct elem_vec body;       // alternatives, each ended by GRAMMAR_END
    const char     *defined_at; // NULL while only referenced
    const char     *used_at;    // first reference, for "not defined"
};

struct parser {
    const char *src, *p, *end;   // end: the text's terminating NUL
    struct rule_def *rules;
    int32_t n_rules, cap_rules;
    int32_t *named;              // hash table of the rules named in the text: rule index or -1
    int32_t n_named, cap_named;  // cap_named: 0 or a power of two
    int nesting;                 // groups open around ps->p
    int64_t work;                // see grammar_rules.parse_work
    struct grammar_range *ranges;
    int32_t n_ranges, cap_ranges;
    int32_t n_elems_total;
};

static pykv_status fail_at(const struct parser *ps, const char *at, const char *what) {
    int line = 1, col = 1;
    for (const char *q = ps->src; q < at && *q; q++) {
        if (*q == '\n') { line++; col = 1; } else col++;
    }
    return pykv_error(PYKV_ERR_INVALID_ARG, "grammar: line %d, column %d: %s", line, col, what);
}

static pykv_status nomem(void) {
    return pykv_error(PYKV_ERR_NOMEM, "grammar: out of memory");
}

pykv_status grammar_grow(void **v, int32_t *cap, int32_t need, size_t size) {
    if (need <= *cap) return PYKV_OK;
    int32_t c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    void *nv = realloc(*v, (size_t)c * size);
    if (!nv) return nomem();
    *v = nv;
    *cap = c;
    return PYKV_OK;
}

static pykv_status push_elem(struct parser *ps, struct elem_vec *e, uint8_t type, int32_t a, int32_t b) {
    if (ps->n_elems_total >= GRAMMAR_MAX_ELEMS) {
        return pykv_error(PYKV_ERR_INVALID_ARG, "grammar: more than %d elements once repetitions are expanded",
                          GRAMMAR_MAX_ELEMS);
    }
    PYKV_TRY(grammar_grow((void **)&e->v, &e->cap, e->n + 1, sizeof(*e->v)));
    e->v[e->n++] = (struct grammar_elem){ type, a, b };
    ps->n_elems_total++;
    return PYKV_OK;
}

static pykv_status push_range(struct parser *ps, uint32_t lo, uint32_t hi) {
    PYKV_TRY(grammar_grow((void **)&ps->ranges, &ps->cap_ranges, ps->n_ranges + 1, sizeof(*ps->ranges)));
    ps->ranges[ps->n_ranges++] = (struct grammar_range){ lo, hi };
    return PYKV_OK;
}

// A new rule named name[0..len), undefined.
static pykv_status new_rule(struct parser *ps, const char *name, size_t len, int32_t *id) {
    PYKV_TRY(grammar_grow((void **)&ps->rules, &ps->cap_rules, ps->n_rules + 1, sizeof(*ps->rules)));
    struct rule_def *r = &ps->rules[ps->n_rules];
    memset(r, 0, sizeof(*r));
    r->name = malloc(len + 1);
    if (!r->name) return nomem();
    memcpy(r->name, name, len);
    r->name[len] = '\0';
    *id = ps->n_rules++;
    return PYKV_OK;
}

static uint32_t name_hash(const char *name, size_t len) {   // FNV-1a
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < len; i++) h = (h ^ (uint8_t)name[i]) * 16777619u;
    return h;
}

// The slot of name[0..len) in the named-rule table: where it is, or the empty slot it would take.
static int32_t named_slot(struct parser *ps, const char *name, size_t len) {
    uint32_t mask = (uint32_t)ps->cap_named - 1, i = name_hash(name, len) & mask;
    for (;; i = (i + 1) & mask) {
        ps->work++;
        int32_t r = ps->named[i];
        if (r < 0 || (strlen(ps->rules[r].name) == len && memcmp(ps->rules[r].name, name, len) == 0)) return (int32_t)i;
    }
}

// Keep the named-rule table at most half full (a power of two, so the probe can mask).
static pykv_status named_reserve(struct parser *ps) {
    if (2 * (ps->n_named + 1) <= ps->cap_named) return PYKV_OK;
    if (ps->cap_named > (1 << 29)) return nomem();
    int32_t cap = ps->cap_named ? 2 * ps->cap_named : 64, *old = ps->named, old_cap = ps->cap_named;
    ps->named = malloc((size_t)cap * sizeof(*ps->named));
    if (!ps->named) {
        ps->named = old;
        return nomem();
    }
    ps->cap_named = cap;
    for (int32_t i = 0; i < cap; i++) ps->named[i] = -1;
    for (int32_t i = 0; i < old_cap; i++) {
        if (old[i] >= 0) ps->named[named_slot(ps, ps->rules[old[i]].name, strlen(ps->rules[old[i]].name))] = old[i];
    }
    free(old);
    return PYKV_OK;
}

// The rule named name[0..len) in the text, added (undefined) when new.
static pykv_status rule_id(struct parser *ps, const char *name, size_t len, int32_t *id) {
    PYKV_TRY(named_reserve(ps));
    int32_t slot = named_slot(ps, name, len);
    if (ps->named[slot] >= 0) {
        *id = ps->named[slot];
        return PYKV_OK;
    }
    PYKV_TRY(new_rule(ps, name, len, id));
    ps->named[slot] = *id;
    ps->n_named++;
    return PYKV_OK;
}

// A rule for a group or repetition inside rule `parent`: named parent~N, which no GBNF name can
// be, so it is made without a look-up.
static pykv_status generated_rule(struct parser *ps, int32_t parent, int32_t *id) {
    char name[256];
    int len = snprintf(name, sizeof(name), "%.200s~%d", ps->rules[parent].name, (int)ps->n_rules);
    PYKV_TRY(new_rule(ps, name, (size_t)len, id));
    ps->rules[*id].defined_at = ps->p;
    return PYKV_OK;
}

static int is_name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

// Spaces, tabs and # comments; line ends too where newline_ok (inside groups, after ::= and |).
static void skip_space(struct parser *ps, int newline_ok) {
    for (;;) {
        char c = *ps->p;
        if (c == ' ' || c == '\t') ps->p++;
        else if (c == '#') { while (*ps->p && *ps->p != '\n' && *ps->p != '\r') ps->p++; }
        else if ((c == '\n' || c == '\r') && newline_ok) ps->p++;
        else return;
    }
}

// One UTF-8 code point at ps->p (unicode_decode's strict UTF-8).
static pykv_status parse_utf8(struct parser *ps, uint32_t *cp) {
    int len = 1;
    *cp = unicode_decode(ps->p, (size_t)(ps->end - ps->p), &len);
    if (*cp == UNICODE_INVALID) return fail_at(ps, ps->p, "invalid UTF-8");
    ps->p += len;
    return PYKV_OK;
}

static pykv_status parse_hex(struct parser *ps, int digits, uint32_t *cp) {
    uint32_t v = 0;
    for (int i = 0; i < digits; i++) {
        char c = ps->p[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return fail_at(ps, ps->p + i, "expected a hexadecimal digit in the escape");
        v = v * 16 + (uint32_t)d;
    }
    if (v > 0x10FFFF) return fail_at(ps, ps->p, "escape beyond U+10FFFF");
    ps->p += digits;
    *cp = v;
    return PYKV_OK;
}

// A character of a literal or class: an escape (\n \r \t \\ \" \[ \] \- \xHH \uHHHH \UHHHHHHHH) or UTF-8.
static pykv_status parse_char(struct parser *ps, uint32_t *cp) {
    if (*ps->p != '\\') return parse_utf8(ps, cp);
    const char *at = ps->p++;
    char c = *ps->p++;
    switch (c) {
    case 'n': *cp = '\n'; return PYKV_OK;
    case 'r': *cp = '\r'; return PYKV_OK;
    case 't': *cp = '\t'; return PYKV_OK;
    case '\\': case '"': case '[': case ']': case '-': case '/': *cp = (uint32_t)c; return PYKV_OK;
    case 'x': return parse_hex(ps, 2, cp);
    case 'u': return parse_hex(ps, 4, cp);
    case 'U': return parse_hex(ps, 8, cp);
    default: return fail_at(ps, at, c ? "unknown escape" : "escape at the end of the text");
    }
}

static pykv_status parse_literal(struct parser *ps, struct elem_vec *body) {
    const char *start = ps->p++;
    while (*ps->p != '"') {
        if (!*ps->p) return fail_at(ps, start, "unterminated string literal");
        uint32_t cp;
        PYKV_TRY(parse_char(ps, &cp));
        PYKV_TRY(push_range(ps, cp, cp));
        PYKV_TRY(push_elem(ps, body, GRAMMAR_CHARS, ps->n_ranges - 1, 1));
    }
    ps->p++;
    return PYKV_OK;
}

static pykv_status parse_class(struct parser *ps, struct elem_vec *body) {
    const char *start = ps->p++;
    uint8_t type = GRAMMAR_CHARS;
    if (*ps->p == '^') {
        type = GRAMMAR_CHARS_NOT;
        ps->p++;
    }
    int32_t first = ps->n_ranges;
    while (*ps->p != ']') {
        if (!*ps->p) return fail_at(ps, start, "unterminated character class");
        uint32_t lo, hi;
        PYKV_TRY(parse_char(ps, &lo));
        hi = lo;
        if (ps->p[0] == '-' && ps->p[1] && ps->p[1] != ']') {
            const char *at = ps->p++;
            PYKV_TRY(parse_char(ps, &hi));
            if (hi < lo) return fail_at(ps, at, "character range with its end before its start");
        }
        PYKV_TRY(push_range(ps, lo, hi));
    }
    ps->p++;
    return push_elem(ps, body, type, first, ps->n_ranges - first);
}

static pykv_status append_copy(struct parser *ps, struct elem_vec *dst, const struct grammar_elem *src, int32_t n) {
    for (int32_t i = 0; i < n; i++) PYKV_TRY(push_elem(ps, dst, src[i].type, src[i].a, src[i].b));
    return PYKV_OK;
}

// A new rule `item ref(self) | ` (item*, or `item ref(next) | ` chained for a bounded count).
// `tail` < 0 refers to the new rule itself.
static pykv_status optional_rule(struct parser *ps, int32_t parent, const struct grammar_elem *item, int32_t n,
                                 int32_t tail, int32_t *id) {
    PYKV_TRY(generated_rule(ps, parent, id));
    struct elem_vec *b = &ps->rules[*id].body;
    PYKV_TRY(append_copy(ps, b, item, n));
    if (tail != -2) PYKV_TRY(push_elem(ps, b, GRAMMAR_RULE_REF, tail < 0 ? *id : tail, 0));
    PYKV_TRY(push_elem(ps, b, GRAMMAR_END, 0, 0));
    return push_elem(ps, b, GRAMMAR_END, 0, 0);   // the empty alternative
}

static pykv_status parse_count(struct parser *ps, int32_t *v) {
    if (*ps->p < '0' || *ps->p > '9') return fail_at(ps, ps->p, "expected a number in {m,n}");
    long n = 0;
    while (*ps->p >= '0' && *ps->p <= '9') {
        n = n * 10 + (*ps->p++ - '0');
        if (n > GRAMMAR_MAX_REPEAT) return fail_at(ps, ps->p, "repetition count above 4096");
    }
    *v = (int32_t)n;
    return PYKV_OK;
}

// Apply the postfix at ps->p to the item body->v[item .. n): *, +, ?, {m}, {m,}, {m,n}.
static pykv_status parse_repeat(struct parser *ps, int32_t rule, int32_t item) {
    const char *at = ps->p;
    int32_t min = 0, max = -1;   // max -1: unbounded
    char c = *ps->p++;
    if (c == '+') min = 1;
    else if (c == '?') max = 1;
    else if (c == '{') {
        skip_space(ps, 1);
        PYKV_TRY(parse_count(ps, &min));
        skip_space(ps, 1);
        if (*ps->p == ',') {
            ps->p++;
            skip_space(ps, 1);
            if (*ps->p != '}') PYKV_TRY(parse_count(ps, &max));
        } else max = min;
        skip_space(ps, 1);
        if (*ps->p++ != '}') return fail_at(ps, ps->p - 1, "expected '}' to close the repetition");
        if (max >= 0 && max < min) return fail_at(ps, at, "repetition {m,n} with n < m");
    }
    struct elem_vec *body = &ps->rules[rule].body;
    int32_t n = body->n - item;
    struct grammar_elem *copy = malloc((size_t)n * sizeof(*copy));
    if (!copy) return nomem();
    memcpy(copy, body->v + item, (size_t)n * sizeof(*copy));
    body->n = item;
    ps->n_elems_total -= n;
    pykv_status st = PYKV_OK;
    for (int32_t i = 0; i < min && st == PYKV_OK; i++) st = append_copy(ps, &ps->rules[rule].body, copy, n);
    int32_t ref = -1;
    if (st == PYKV_OK && max < 0) st = optional_rule(ps, rule, copy, n, -1, &ref);
    for (int32_t i = min; i < max && st == PYKV_OK; i++)   // (item (item (...)?)?)?, innermost first
        st = optional_rule(ps, rule, copy, n, ref < 0 ? -2 : ref, &ref);
    if (st == PYKV_OK && ref >= 0) st = push_elem(ps, &ps->rules[rule].body, GRAMMAR_RULE_REF, ref, 0);
    free(copy);
    return st;
}

static pykv_status parse_alternatives(struct parser *ps, int32_t rule, int nested);

// Whether a rule definition (`name ::=`) starts at p.
static int starts_rule(const char *p) {
    while (is_name_char(*p)) p++;
    while (*p == ' ' || *p == '\t') p++;
    return strncmp(p, "::=", 3) == 0;
}

// Whether only spaces separate p from the start of its line.
static int at_line_start(const struct parser *ps, const char *p) {
    while (p > ps->src && (p[-1] == ' ' || p[-1] == '\t')) p--;
    return p == ps->src || p[-1] == '\n' || p[-1] == '\r';
}

static pykv_status parse_sequence(struct parser *ps, int32_t rule, int nested) {
    for (;;) {
        int32_t item = ps->rules[rule].body.n;
        char c = *ps->p;
        if (c == '"') PYKV_TRY(parse_literal(ps, &ps->rules[rule].body));
        else if (c == '[') PYKV_TRY(parse_class(ps, &ps->rules[rule].body));
        else if (c == '.') {
            ps->p++;
            PYKV_TRY(push_elem(ps, &ps->rules[rule].body, GRAMMAR_CHARS_NOT, 0, 0));
        } else if (is_name_char(c)) {
            if (starts_rule(ps->p)) return PYKV_OK;   // `a ::= "x" |` then the next rule: an empty last alternative
            const char *name = ps->p;
            while (is_name_char(*ps->p)) ps->p++;
            int32_t ref;
            PYKV_TRY(rule_id(ps, name, (size_t)(ps->p - name), &ref));
            if (!ps->rules[ref].used_at) ps->rules[ref].used_at = name;
            PYKV_TRY(push_elem(ps, &ps->rules[rule].body, GRAMMAR_RULE_REF, ref, 0));
        } else if (c == '(') {
            const char *open = ps->p++;
            if (ps->nesting == GRAMMAR_MAX_NESTING) return fail_at(ps, open, "groups nested more than 256 deep");
            skip_space(ps, 1);
            int32_t group;
            PYKV_TRY(generated_rule(ps, rule, &group));
            ps->nesting++;
            PYKV_TRY(parse_alternatives(ps, group, 1));
            ps->nesting--;
            if (*ps->p != ')') return fail_at(ps, *ps->p ? ps->p : open, *ps->p ? "expected ')'" : "unclosed '('");
            ps->p++;
            PYKV_TRY(push_elem(ps, &ps->rules[rule].body, GRAMMAR_RULE_REF, group, 0));
        } else if (c == '*' || c == '+' || c == '?' || c == '{') {
            return fail_at(ps, ps->p, "a repetition with nothing before it to repeat");
        } else {
            return PYKV_OK;   // |, ), a line end or the end: the caller decides
        }
        skip_space(ps, nested);
        while (*ps->p == '*' || *ps->p == '+' || *ps->p == '?' || *ps->p == '{') {
            PYKV_TRY(parse_repeat(ps, rule, item));
            skip_space(ps, nested);
        }
    }
}

static pykv_status parse_alternatives(struct parser *ps, int32_t rule, int nested) {
    for (;;) {
        PYKV_TRY(parse_sequence(ps, rule, nested));
        PYKV_TRY(push_elem(ps, &ps->rules[rule].body, GRAMMAR_END, 0, 0));
        if (*ps->p != '|') return PYKV_OK;
        ps->p++;
        skip_space(ps, 1);
    }
}

static pykv_status parse_rule(struct parser *ps) {
    const char *name = ps->p;
    while (is_name_char(*ps->p)) ps->p++;
    if (ps->p == name) return fail_at(ps, name, "expected a rule name");
    int32_t rule;
    PYKV_TRY(rule_id(ps, name, (size_t)(ps->p - name), &rule));
    if (ps->rules[rule].defined_at) return fail_at(ps, name, "rule defined twice");
    ps->rules[rule].defined_at = name;
    skip_space(ps, 0);
    if (strncmp(ps->p, "::=", 3) != 0) return fail_at(ps, ps->p, "expected '::=' after the rule name");
    ps->p += 3;
    skip_space(ps, 1);
    PYKV_TRY(parse_alternatives(ps, rule, 0));
    if (*ps->p == ')') return fail_at(ps, ps->p, "')' without '('");
    if (*ps->p && *ps->p != '\n' && *ps->p != '\r' && !(starts_rule(ps->p) && at_line_start(ps, ps->p)))
        return fail_at(ps, ps->p, "unexpected character");
    skip_space(ps, 1);
    return PYKV_OK;
}

// nullable[r] = whether rule r can match the empty text. A worklist: an alternative made only of
// rule references waits for that many of them to become nullable (each occurrence counted), and
// when a rule becomes nullable only the alternatives that refer to it are revisited, so the work
// is linear in the grammar's size however the rules nest.
static pykv_status find_nullable(const struct grammar_rules *g, uint8_t *nullable, int64_t *work) {
    int32_t n = g->n_rules, n_alts = g->rule_alt[n];
    int32_t *waiting = malloc((size_t)(n_alts + 1) * sizeof(*waiting));   // per alternative: refs not yet nullable, -1 never
    int32_t *alt_rule = malloc((size_t)(n_alts + 1) * sizeof(*alt_rule));
    int32_t *users_at = calloc((size_t)n + 1, sizeof(*users_at));          // rule s's occurrences: users[users_at[s] .. users_at[s+1])
    int32_t *queue = malloc((size_t)(n + 1) * sizeof(*queue));
    int32_t *users = NULL;
    pykv_status st = PYKV_OK;
    if (!waiting || !alt_rule || !users_at || !queue) st = nomem();
    int32_t n_users = 0;
    for (int32_t r = 0; r < n && st == PYKV_OK; r++) {
        for (int32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1]; a++) {
            int32_t pos = g->alt_start[a], refs = 0;
            for (; g->elems[pos].type == GRAMMAR_RULE_REF; pos++) refs++;
            *work += refs + 1;
            alt_rule[a] = r;
            waiting[a] = grammar_is_end(g, pos) ? refs : -1;
            if (waiting[a] <= 0) continue;
            for (pos = g->alt_start[a]; !grammar_is_end(g, pos); pos++) users_at[g->elems[pos].a + 1]++;
            n_users += refs;
        }
    }
    if (st == PYKV_OK && !(users = malloc((size_t)(n_users + 1) * sizeof(*users)))) st = nomem();
    if (st == PYKV_OK) {
        for (int32_t s = 0; s < n; s++) users_at[s + 1] += users_at[s];
        for (int32_t a = 0; a < n_alts; a++) {   // users_at[s] runs ahead while filling, then is shifted back
            if (waiting[a] <= 0) continue;
            for (int32_t pos = g->alt_start[a]; !grammar_is_end(g, pos); pos++) users[users_at[g->elems[pos].a]++] = a;
        }
        for (int32_t s = n; s > 0; s--) users_at[s] = users_at[s - 1];
        users_at[0] = 0;
        int32_t head = 0, tail = 0;
        for (int32_t a = 0; a < n_alts; a++) {
            if (waiting[a] == 0 && !nullable[alt_rule[a]]) nullable[queue[tail++] = alt_rule[a]] = 1;
        }
        while (head < tail) {
            int32_t s = queue[head++];
            for (int32_t u = users_at[s]; u < users_at[s + 1]; u++) {
                int32_t a = users[u];
                ++*work;
                if (--waiting[a] == 0 && !nullable[alt_rule[a]]) nullable[queue[tail++] = alt_rule[a]] = 1;
            }
        }
    }
    free(waiting); free(alt_rule); free(users_at); free(queue); free(users);
    return st;
}

// Where a depth-first search over first references stands in one rule: the alternative it is in
// and the next element of it to look at (-1: that alternative is done).
struct first_ref_cursor {
    int32_t rule, alt, pos;
};

static struct first_ref_cursor first_ref_start(const struct grammar_rules *g, int32_t rule) {
    int32_t alt = g->rule_alt[rule];
    return (struct first_ref_cursor){ rule, alt, alt < g->rule_alt[rule + 1] ? g->alt_start[alt] : -1 };
}

// The next rule reference that may come first in cursor's rule (each looked at once), or -1.
static int32_t next_first_ref(const struct grammar_rules *g, const uint8_t *nullable, struct first_ref_cursor *c,
                              int64_t *work) {
    int32_t end = g->rule_alt[c->rule + 1];
    while (c->alt < end) {
        ++*work;
        if (c->pos >= 0 && g->elems[c->pos].type == GRAMMAR_RULE_REF) {
            int32_t at = c->pos;
            c->pos = nullable[g->elems[at].a] ? at + 1 : -1;   // what follows comes first too when this may be empty
            return at;
        }
        if (++c->alt < end) c->pos = g->alt_start[c->alt];
    }
    return -1;
}

// Left recursion: a rule reaching itself before any character, through rules that may match
// nothing. nullable[] is computed first; then an iterative depth-first search over those first
// references.
static pykv_status check_left_recursion(struct parser *ps, const struct grammar_rules *g) {
    int32_t n = g->n_rules;
    uint8_t *nullable = calloc((size_t)n, 1), *state = calloc((size_t)n, 1);
    struct first_ref_cursor *stack = malloc((size_t)n * sizeof(*stack));
    if (!nullable || !state || !stack) {
        free(nullable); free(state); free(stack);
        return nomem();
    }
    pykv_status st = find_nullable(g, nullable, &ps->work);
    // state: 1 open (on the search's stack), 2 done.
    for (int32_t start = 0; start < n && st == PYKV_OK; start++) {
        if (state[start]) continue;
        int32_t depth = 0;
        stack[0] = first_ref_start(g, start);
        state[start] = 1;
        while (depth >= 0 && st == PYKV_OK) {
            struct first_ref_cursor *c = &stack[depth];
            int32_t next = next_first_ref(g, nullable, c, &ps->work);
            if (next < 0) {
                state[c->rule] = 2;
                depth--;
                continue;
            }
            int32_t s = g->elems[next].a;
            if (state[s] == 1) {
                st = pykv_error(PYKV_ERR_INVALID_ARG, "grammar: rule '%s' is left-recursive (it can reach itself "
                                "before matching any character)", ps->rules[s].name);
            } else if (state[s] == 0) {
                state[s] = 1;
                stack[++depth] = first_ref_start(g, s);
            }
        }
    }
    free(nullable); free(state); free(stack);
    return st;
}

// Lay the rules out in one element array with their alternatives' starts.
static pykv_status flatten(const struct parser *ps, struct grammar_rules *g) {
    int32_t n_elems = 0, n_alts = 0;
    for (int32_t r = 0; r < ps->n_rules; r++) {
        n_elems += ps->rules[r].body.n;
        for (int32_t i = 0; i < ps->rules[r].body.n; i++) n_alts += ps->rules[r].body.v[i].type == GRAMMAR_END;
    }
    g->elems = malloc((size_t)(n_elems + 1) * sizeof(*g->elems));
    g->alt_start = malloc((size_t)(n_alts + 1) * sizeof(*g->alt_start));
    g->rule_alt = malloc((size_t)(ps->n_rules + 1) * sizeof(*g->rule_alt));
    g->ranges = malloc((size_t)(ps->n_ranges + 1) * sizeof(*g->ranges));
    if (!g->elems || !g->alt_start || !g->rule_alt || !g->ranges) return nomem();
    if (ps->n_ranges) memcpy(g->ranges, ps->ranges, (size_t)ps->n_ranges * sizeof(*g->ranges));
    g->n_ranges = ps->n_ranges;
    g->n_rules = ps->n_rules;
    int32_t e = 0, a = 0;
    for (int32_t r = 0; r < ps->n_rules; r++) {
        g->rule_alt[r] = a;
        const struct elem_vec *b = &ps->rules[r].body;
        for (int32_t i = 0; i < b->n; i++) {
            if (i == 0 || b->v[i - 1].type == GRAMMAR_END) g->alt_start[a++] = e;
            g->elems[e++] = b->v[i];
        }
    }
    g->rule_alt[ps->n_rules] = a;
    g->elems[e] = (struct grammar_elem){ GRAMMAR_END, 0, 0 };
    g->n_elems = e;
    return PYKV_OK;
}

static pykv_status finish(struct parser *ps, const char *root, struct grammar_rules *out) {
    if (ps->n_rules == 0) return pykv_error(PYKV_ERR_INVALID_ARG, "grammar: no rules");
    for (int32_t r = 0; r < ps->n_rules; r++) {
        if (!ps->rules[r].defined_at) {
            char what[300];
            snprintf(what, sizeof(what), "rule '%.200s' is used but not defined", ps->rules[r].name);
            return fail_at(ps, ps->rules[r].used_at, what);
        }
    }
    out->root = -1;
    for (int32_t r = 0; r < ps->n_rules; r++) {
        if (strcmp(ps->rules[r].name, root) == 0) out->root = r;
    }
    if (out->root < 0) return pykv_error(PYKV_ERR_INVALID_ARG, "grammar: no rule named '%.200s' to start from", root);
    PYKV_TRY(flatten(ps, out));
    PYKV_TRY(check_left_recursion(ps, out));
    out->parse_work = ps->work;
    return PYKV_OK;
}

pykv_status grammar_parse(const char *text, const char *root, struct grammar_rules *out) {
    memset(out, 0, sizeof(*out));
    if (!text) return pykv_error(PYKV_ERR_INVALID_ARG, "grammar: text is NULL");
    struct parser ps = { .src = text, .p = text, .end = text + strlen(text) };
    skip_space(&ps, 1);
    pykv_status st = PYKV_OK;
    while (*ps.p && st == PYKV_OK) st = parse_rule(&ps);
    if (st == PYKV_OK) st = finish(&ps, root ? root : "root", out);
    for (int32_t r = 0; r < ps.n_rules; r++) {
        free(ps.rules[r].name);
        free(ps.rules[r].body.v);
    }
    free(ps.rules);
    free(ps.named);
    free(ps.ranges);
    if (st != PYKV_OK) grammar_rules_free(out);
    return st;
}

void grammar_rules_free(struct grammar_rules *r) {
    free(r->elems);
    free(r->ranges);
    free(r->alt_start);
    free(r->rule_alt);
    memset(r, 0, sizeof(*r));
}

int grammar_char_matches(const struct grammar_rules *r, int32_t pos, uint32_t cp) {
    const struct grammar_elem *e = &r->elems[pos];
    int in = 0;
    for (int32_t i = e->a; i < e->a + e->b && !in; i++) in = cp >= r->ranges[i].lo && cp <= r->ranges[i].hi;
    return e->type == GRAMMAR_CHARS ? in : !in;
}
