// test_unicode.c - UTF-8 decoding/encoding and the generated Unicode class tables.
#include <string.h>

#include "check.h"
#include "vocab/unicode.h"

static uint32_t dec(const char *s, size_t len, int *n) { return unicode_decode(s, len, n); }

static void test_decode_valid(void) {
    int n;
    CHECK(dec("A", 1, &n) == 'A' && n == 1);
    CHECK(dec("\xc3\xa9", 2, &n) == 0xE9 && n == 2);              // é
    CHECK(dec("\xe2\x96\x81", 3, &n) == 0x2581 && n == 3);         // ▁
    CHECK(dec("\xf0\x9f\x98\x80", 4, &n) == 0x1F600 && n == 4);    // 😀
    CHECK(dec("\xf4\x8f\xbf\xbf", 4, &n) == 0x10FFFF && n == 4);
}

static void test_decode_invalid(void) {
    int n;
    CHECK(dec("\x80", 1, &n) == UNICODE_INVALID && n == 1);            // lone continuation
    CHECK(dec("\xc3", 1, &n) == UNICODE_INVALID && n == 1);            // truncated
    CHECK(dec("\xc3(", 2, &n) == UNICODE_INVALID && n == 1);           // bad continuation
    CHECK(dec("\xc0\x80", 2, &n) == UNICODE_INVALID && n == 1);        // overlong NUL
    CHECK(dec("\xe0\x80\xaf", 3, &n) == UNICODE_INVALID && n == 1);    // overlong '/'
    CHECK(dec("\xed\xa0\x80", 3, &n) == UNICODE_INVALID && n == 1);    // surrogate
    CHECK(dec("\xf4\x90\x80\x80", 4, &n) == UNICODE_INVALID && n == 1); // > U+10FFFF
    CHECK(dec("\xff", 1, &n) == UNICODE_INVALID && n == 1);
    CHECK(dec("\xe2\x96", 2, &n) == UNICODE_INVALID && n == 1);        // truncated at the end
    CHECK(unicode_seq_len("\xf0\x9f\x98\x80", 4) == 4);
    CHECK(unicode_seq_len("\xf0\x9f\x98", 3) == 1);
}

static void test_roundtrip(void) {
    static const uint32_t cps[] = {0, 0x41, 0x7F, 0x80, 0x7FF, 0x800, 0xFFFD, 0xFFFF, 0x10000, 0x1F600, 0x10FFFF};
    for (size_t i = 0; i < sizeof(cps) / sizeof(cps[0]); i++) {
        char buf[4];
        int len = unicode_encode(cps[i], buf), n = 0;
        CHECK(dec(buf, (size_t)len, &n) == cps[i]);
        CHECK(n == len);
    }
}

static void test_classes(void) {
    CHECK(unicode_is_letter('a') && unicode_is_letter('Z'));
    CHECK(unicode_is_letter(0xE9));      // é
    CHECK(unicode_is_letter(0x65E5));    // 日
    CHECK(unicode_is_letter(0x0645));    // Arabic meem
    CHECK(unicode_is_letter(0x0928));    // Devanagari na
    CHECK(unicode_class_of(0x093F) == UCLASS_M);  // Devanagari vowel sign i (a mark, not a letter)
    CHECK(unicode_is_number('7') && unicode_is_number(0x0663) && unicode_is_number(0x00BD));  // ٣ ½
    CHECK(!unicode_is_number('a'));
    CHECK(unicode_is_punct('.') && unicode_is_punct(',') && unicode_is_punct(0x3002));  // 。
    CHECK(!unicode_is_punct('$') && unicode_class_of('$') == UCLASS_S);
    CHECK(unicode_class_of(0x1F600) == UCLASS_S);   // emoji
    CHECK(unicode_class_of(0x200D) == UCLASS_C);    // ZWJ is a format character
    CHECK(unicode_class_of(0x0378) == UCLASS_C);    // unassigned
    CHECK(unicode_class_of(UNICODE_INVALID) == UCLASS_S);
    CHECK(unicode_is_space(' ') && unicode_is_space('\t') && unicode_is_space('\n') && unicode_is_space('\r'));
    CHECK(unicode_is_space(0x0B) && unicode_is_space(0x0C) && unicode_is_space(0x85));
    CHECK(unicode_is_space(0xA0) && unicode_is_space(0x2003) && unicode_is_space(0x3000));
    CHECK(!unicode_is_space(0x200B) && !unicode_is_space('x') && !unicode_is_space(0x1C));
}

static void test_tables_sorted(void) {
    int ok = 1;
    for (int i = 0; i < unicode_class_n_ranges; i++) {
        if (unicode_class_ranges[i].lo > unicode_class_ranges[i].hi) ok = 0;
        if (i > 0 && unicode_class_ranges[i - 1].hi >= unicode_class_ranges[i].lo) ok = 0;
    }
    CHECK(ok);
    CHECK(unicode_class_n_ranges > 1000);
}

int main(void) {
    test_decode_valid();
    test_decode_invalid();
    test_roundtrip();
    test_classes();
    test_tables_sorted();
    return check_report("test_unicode");
}
