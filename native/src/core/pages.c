// pages.c - see pages.h. Why: glibc's malloc raises its mmap threshold each time it frees a
// mapped block, so once a policy has freed a large temporary, the KV lists' blocks up to
// that size come from the heap, where lists that grow and shrink with every prefill chunk
// leave holes the process keeps (~11 MiB of the peak resident set of an 8K-token TAKE
// prefill). Blocks of PAGES_MIN bytes or more are therefore mapped directly. Each block
// starts with a header giving its size and kind, so the calls take what realloc and free
// take. Under AddressSanitizer everything is plain malloc, so the sanitizer sees every access.
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE   // mremap
#endif
#include "core/pages.h"

#include <stdlib.h>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PAGES_UNDER_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define PAGES_UNDER_ASAN 1
#endif

#ifndef PAGES_MAPPED   // tests/c/test_pages.c forces the mapped path, sanitizers or not
#if !defined(PAGES_UNDER_ASAN) && (defined(__unix__) || defined(__APPLE__))
#define PAGES_MAPPED 1
#else
#define PAGES_MAPPED 0
#endif
#endif

#if PAGES_MAPPED
#include <string.h>
#include <sys/mman.h>

#define PAGES_MIN    ((size_t)64 << 10)
#define PAGES_HEADER ((size_t)64)   // keeps the block cache-line aligned in a mapping

struct pages_header {
    size_t total;    // bytes of the allocation, header included
    int    mapped;   // 1: mmap, 0: malloc
};

static struct pages_header *header_of(void *p) { return (struct pages_header *)((char *)p - PAGES_HEADER); }

static void release(struct pages_header *h) {
    if (h->mapped) munmap(h, h->total);
    else free(h);
}

static struct pages_header *acquire(size_t total, int mapped) {
    struct pages_header *h;
    if (mapped) {
        void *m = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        h = m == MAP_FAILED ? NULL : m;
    } else {
        h = malloc(total);
    }
    if (h) {
        h->total = total;
        h->mapped = mapped;
    }
    return h;
}

static void *body(struct pages_header *h) { return (char *)h + PAGES_HEADER; }

void *pages_realloc(void *p, size_t bytes) {
    if (bytes > (size_t)-1 - PAGES_HEADER) return NULL;
    const size_t total = bytes + PAGES_HEADER;
    const int mapped = bytes >= PAGES_MIN;
    if (!p) {
        struct pages_header *h = acquire(total, mapped);
        return h ? body(h) : NULL;
    }
    struct pages_header *old = header_of(p), *h;
    if (!old->mapped && !mapped) {   // both from malloc
        h = realloc(old, total);
        if (!h) return NULL;
        h->total = total;
        return body(h);
    }
#ifdef __linux__
    if (old->mapped && mapped) {     // grown or shrunk in place where the pages allow
        void *m = mremap(old, old->total, total, MREMAP_MAYMOVE);
        if (m == MAP_FAILED) return NULL;
        h = m;
        h->total = total;
        return body(h);
    }
#endif
    h = acquire(total, mapped);
    if (!h) return NULL;
    memcpy(body(h), p, (old->total < total ? old->total : total) - PAGES_HEADER);
    release(old);
    return body(h);
}

void pages_free(void *p) {
    if (p) release(header_of(p));
}
#else
void *pages_realloc(void *p, size_t bytes) { return realloc(p, bytes ? bytes : 1); }
void  pages_free(void *p) { free(p); }
#endif
