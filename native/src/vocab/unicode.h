// unicode.h - UTF-8 decoding/encoding and the Unicode classes the pre-tokenizers need.
#pragma once
#include <stddef.h>
#include <stdint.h>

// Major general-category classes (the first letter of the category).
enum unicode_class {
    UCLASS_C = 0,  // control, format, unassigned, private use, surrogate
    UCLASS_L = 1,  // letters
    UCLASS_M = 2,  // marks
    UCLASS_N = 3,  // numbers
    UCLASS_P = 4,  // punctuation
    UCLASS_S = 5,  // symbols
    UCLASS_Z = 6,  // separators
};

struct unicode_range {
    uint32_t lo, hi;
    uint32_t cls;
};

// Returned by unicode_decode for a byte that does not start a valid UTF-8 sequence.
#define UNICODE_INVALID 0xFFFFFFFFu

// Decode one code point from s[0..len) (len >= 1). Returns the code point and stores its
// length in *n. Overlong forms, surrogates, values above U+10FFFF and truncated sequences
// are invalid: UNICODE_INVALID with *n = 1 (the offending byte alone).
uint32_t unicode_decode(const char *s, size_t len, int *n);
// Length of the valid UTF-8 sequence starting at s (1 for an invalid byte).
int      unicode_seq_len(const char *s, size_t len);
// Encode cp (<= 0x10FFFF) into out (4 bytes of room); returns the byte count.
int      unicode_encode(uint32_t cp, char *out);

enum unicode_class unicode_class_of(uint32_t cp);  // UNICODE_INVALID is class S (like U+FFFD)
int unicode_is_space(uint32_t cp);                 // Unicode White_Space (regex \s)
static inline int unicode_is_letter(uint32_t cp) { return unicode_class_of(cp) == UCLASS_L; }
static inline int unicode_is_number(uint32_t cp) { return unicode_class_of(cp) == UCLASS_N; }
static inline int unicode_is_punct(uint32_t cp)  { return unicode_class_of(cp) == UCLASS_P; }

// Generated tables (unicode-data.c).
extern const struct unicode_range unicode_class_ranges[];
extern const int unicode_class_n_ranges;
extern const struct unicode_range unicode_space_ranges[];
extern const int unicode_space_n_ranges;
