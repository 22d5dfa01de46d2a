// unicode.c - UTF-8 and class lookups over the generated tables of unicode-data.c.
#include "vocab/unicode.h"

uint32_t unicode_decode(const char *str, size_t len, int *n) {
    const unsigned char *s = (const unsigned char *)str;
    unsigned char b = s[0];
    *n = 1;
    if (b < 0x80) return b;
    int need;
    uint32_t cp, min;
    if (b >= 0xC2 && b <= 0xDF)      { need = 1; cp = b & 0x1F; min = 0x80; }
    else if (b >= 0xE0 && b <= 0xEF) { need = 2; cp = b & 0x0F; min = 0x800; }
    else if (b >= 0xF0 && b <= 0xF4) { need = 3; cp = b & 0x07; min = 0x10000; }
    else return UNICODE_INVALID;
    if ((size_t)need >= len) return UNICODE_INVALID;
    for (int i = 1; i <= need; i++) {
        if ((s[i] & 0xC0) != 0x80) return UNICODE_INVALID;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return UNICODE_INVALID;
    *n = need + 1;
    return cp;
}

int unicode_seq_len(const char *s, size_t len) {
    int n;
    unicode_decode(s, len, &n);
    return n;
}

int unicode_encode(uint32_t cp, char *out) {
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) { o[0] = (unsigned char)cp; return 1; }
    if (cp < 0x800) {
        o[0] = (unsigned char)(0xC0 | (cp >> 6));
        o[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | (cp >> 18));
    o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

static const struct unicode_range *find_range(const struct unicode_range *r, int n, uint32_t cp) {
    int lo = 0, hi = n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        if (cp < r[mid].lo) hi = mid - 1;
        else if (cp > r[mid].hi) lo = mid + 1;
        else return &r[mid];
    }
    return NULL;
}

// ASCII answers come from a small table so the hot path of English text skips the search.
static const unsigned char ascii_class[128] = {
    ['0'] = UCLASS_N, ['1'] = UCLASS_N, ['2'] = UCLASS_N, ['3'] = UCLASS_N, ['4'] = UCLASS_N,
    ['5'] = UCLASS_N, ['6'] = UCLASS_N, ['7'] = UCLASS_N, ['8'] = UCLASS_N, ['9'] = UCLASS_N,
};

enum unicode_class unicode_class_of(uint32_t cp) {
    if (cp == UNICODE_INVALID) return UCLASS_S;
    if (cp < 128) {
        if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return UCLASS_L;
        if (ascii_class[cp]) return (enum unicode_class)ascii_class[cp];
    }
    const struct unicode_range *r = find_range(unicode_class_ranges, unicode_class_n_ranges, cp);
    return r ? (enum unicode_class)r->cls : UCLASS_C;
}

int unicode_is_space(uint32_t cp) {
    if (cp < 128) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D);
    if (cp == UNICODE_INVALID) return 0;
    return find_range(unicode_space_ranges, unicode_space_n_ranges, cp) != NULL;
}
