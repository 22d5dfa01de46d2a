// test_pages.c - the KV lists' allocator: blocks that move between malloc and their own
// mapping as they cross PAGES_MIN keep their bytes, mapped blocks are aligned and give their
// pages back when they shrink, and the calls keep realloc's contract. pages.c is compiled
// in here with its mapped path forced on, so the sanitized build tests it too (the library
// itself uses plain malloc under AddressSanitizer).
#define PAGES_MAPPED 1
#include "core/pages.c"

#include "check.h"

#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

static void fill(unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(i * 131u + seed);
}

static int same(const unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != (unsigned char)(i * 131u + seed)) return 0;
    return 1;
}

// Whether [p, p + n) is mapped (Linux: mincore fails with ENOMEM where it is not); -1
// where it cannot be asked.
static int is_mapped(void *p, size_t n) {
#ifdef __linux__
    unsigned char vec[1024];
    if ((n + 4095) / 4096 > sizeof(vec) || (uintptr_t)p % 4096) return -1;
    return mincore(p, n, vec) == 0;
#else
    (void)p; (void)n;
    return -1;
#endif
}

static void check_kinds(void) {
    const size_t small = 1000, big = PAGES_MIN * 3, bigger = PAGES_MIN * 7;
    unsigned char *p = pages_realloc(NULL, small);
    CHECK(p != NULL && !header_of(p)->mapped);
    fill(p, small, 1);

    p = pages_realloc(p, big);   // malloc -> its own mapping
    CHECK(p != NULL && header_of(p)->mapped);
    CHECK((uintptr_t)p % 64 == 0);
    CHECK(same(p, small, 1));
    fill(p, big, 2);

    p = pages_realloc(p, bigger);   // mapping grown
    CHECK(p != NULL && header_of(p)->mapped && header_of(p)->total == bigger + PAGES_HEADER);
    CHECK(same(p, big, 2));
    fill(p, bigger, 3);

    unsigned char *was = p;
    p = pages_realloc(p, big);   // mapping shrunk: the tail's pages are given back
    CHECK(p != NULL && header_of(p)->mapped && same(p, big, 3));
    if (p == was) {   // shrunk in place, as mremap does
        char *tail = (char *)header_of(p) + (big + PAGES_HEADER + 4095) / 4096 * 4096;
        CHECK(is_mapped(tail, 4096 * 4) != 1);
        CHECK(is_mapped(header_of(p), 4096) != 0);
    }

    p = pages_realloc(p, small);   // back to malloc
    CHECK(p != NULL && !header_of(p)->mapped && same(p, small, 3));
    p = pages_realloc(p, small / 2);   // malloc shrunk
    CHECK(p != NULL && same(p, small / 2, 3));
    pages_free(p);

    pages_free(NULL);   // as free(NULL)
    CHECK(pages_realloc(NULL, (size_t)-1) == NULL);   // size overflow, not a wrapped tiny block
    unsigned char *q = pages_realloc(NULL, big);
    fill(q, big, 4);
    CHECK(pages_realloc(q, (size_t)-1 - 8) == NULL);   // refused: the block is still there
    CHECK(same(q, big, 4));
    pages_free(q);
}

// Many blocks growing by an eighth and shrinking, as prefill chunks make a policy's lists do.
static void check_churn(void) {
    enum { N = 12 };
    unsigned char *b[N] = { 0 };
    size_t n[N] = { 0 };
    for (int round = 0; round < 40; round++)
        for (int i = 0; i < N; i++) {
            const size_t want = round % 5 == 4 ? n[i] / 3 + 16 : n[i] + n[i] / 8 + 4096 * (size_t)(i + 1);
            unsigned char *p = pages_realloc(b[i], want);
            CHECK(p != NULL);
            if (!p) continue;
            const size_t kept = n[i] < want ? n[i] : want;
            CHECK(same(p, kept, (unsigned)(i + round)));
            fill(p, want, (unsigned)(i + round + 1));
            b[i] = p;
            n[i] = want;
        }
    for (int i = 0; i < N; i++) pages_free(b[i]);
}

int main(void) {
    check_kinds();
    check_churn();
    return check_report("test_pages");
}
