// membw.c - streaming read bandwidth of this machine, for one thread and for several.
//
//     cc -O2 -pthread -o /tmp/membw bench/membw.c
//     /tmp/membw                       # 4 GiB buffer, 1 and 2 threads, 7 passes each
//     /tmp/membw --size-mib 100        # a buffer of the model's size (repeated passes)
//     /tmp/membw --prefetch 8192 --hint nta    # each load asks for the line 8 KiB ahead
//
// Each thread sums its own contiguous share of one buffer with 256-bit loads (four
// independent accumulators, so the adds never limit the loads); a pass starts and ends at a
// barrier, and its time is the slowest thread's. The figure is the median pass in GB/s
// (1e9 bytes per second) with the spread (min..max). Each thread reads its own clock around
// its share, so a main thread the OS deschedules between barriers does not skew a pass. The buffer is written once before the
// passes, so every page is resident and none is shared with the zero page. --prefetch and
// --hint try the decode kernels' software prefetch on a plain stream: it shows whether the
// distance or the hint changes what the memory delivers on this CPU. --json prints one JSON
// object per thread count instead of the table.
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_THREADS 64
#define MAX_PASSES 101

enum hint { HINT_NONE, HINT_NTA, HINT_T0 };

struct config {
    size_t   bytes;
    int      passes;
    int      thread_counts[MAX_THREADS];
    int      n_counts;
    long     prefetch;   // bytes ahead of each load; 0: no software prefetch
    enum hint hint;
    int      json;
};

struct worker {
    const struct config *cfg;
    const uint8_t       *begin, *end;
    pthread_barrier_t   *start, *stop;
    double               sink;
    double               t0[MAX_PASSES + 1], t1[MAX_PASSES + 1];
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

// Sum [p, end) as floats, 128 bytes (two cache lines) per step; `ahead` > 0 also prefetches.
__attribute__((target("avx2"))) static double read_stream(const uint8_t *p, const uint8_t *end, long ahead,
                                                         enum hint hint) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; p + 128 <= end; p += 128) {
        if (ahead > 0 && hint == HINT_NTA) {
            _mm_prefetch((const char *)p + ahead, _MM_HINT_NTA);
            _mm_prefetch((const char *)p + ahead + 64, _MM_HINT_NTA);
        } else if (ahead > 0 && hint == HINT_T0) {
            _mm_prefetch((const char *)p + ahead, _MM_HINT_T0);
            _mm_prefetch((const char *)p + ahead + 64, _MM_HINT_T0);
        }
        a0 = _mm256_add_ps(a0, _mm256_load_ps((const float *)p));
        a1 = _mm256_add_ps(a1, _mm256_load_ps((const float *)(p + 32)));
        a2 = _mm256_add_ps(a2, _mm256_load_ps((const float *)(p + 64)));
        a3 = _mm256_add_ps(a3, _mm256_load_ps((const float *)(p + 96)));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    double s = 0;
    for (int i = 0; i < 8; i++) s += lanes[i];
    return s;
}

static void *worker_main(void *arg) {
    struct worker *w = arg;
    for (int pass = 0; pass < w->cfg->passes + 1; pass++) {   // pass 0 warms up
        pthread_barrier_wait(w->start);
        w->t0[pass] = now_s();
        w->sink += read_stream(w->begin, w->end, w->cfg->prefetch, w->cfg->hint);
        w->t1[pass] = now_s();
        pthread_barrier_wait(w->stop);
    }
    return NULL;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// GB/s of each pass with n threads, sorted.
static int measure(const struct config *cfg, const uint8_t *buf, int n, double *gbps) {
    pthread_barrier_t start, stop;
    pthread_barrier_init(&start, NULL, (unsigned)n + 1);
    pthread_barrier_init(&stop, NULL, (unsigned)n + 1);
    struct worker workers[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    const size_t share = cfg->bytes / (size_t)n / 128 * 128;
    for (int i = 0; i < n; i++) {
        workers[i] = (struct worker){ .cfg = cfg, .begin = buf + (size_t)i * share,
                                      .end = buf + (size_t)(i + 1) * share, .start = &start, .stop = &stop };
        if (pthread_create(&threads[i], NULL, worker_main, &workers[i]) != 0) {
            fprintf(stderr, "membw: could not start thread %d\n", i);
            exit(1);
        }
    }
    for (int pass = 0; pass < cfg->passes + 1; pass++) {
        pthread_barrier_wait(&start);
        pthread_barrier_wait(&stop);
    }
    double sink = 0;
    for (int i = 0; i < n; i++) {
        pthread_join(threads[i], NULL);
        sink += workers[i].sink;
    }
    for (int pass = 1; pass < cfg->passes + 1; pass++) {   // first start to last finish
        double t0 = workers[0].t0[pass], t1 = workers[0].t1[pass];
        for (int i = 1; i < n; i++) {
            if (workers[i].t0[pass] < t0) t0 = workers[i].t0[pass];
            if (workers[i].t1[pass] > t1) t1 = workers[i].t1[pass];
        }
        gbps[pass - 1] = (double)share * n / (t1 - t0) / 1e9;
    }
    pthread_barrier_destroy(&start);
    pthread_barrier_destroy(&stop);
    qsort(gbps, (size_t)cfg->passes, sizeof(double), cmp_double);
    return sink == 12345.0;   // keeps the sums alive; never true for the buffer's contents
}

static const char *hint_name(enum hint h) { return h == HINT_NTA ? "nta" : h == HINT_T0 ? "t0" : "none"; }

static void usage(void) {
    fprintf(stderr, "usage: membw [--size-mib N] [--passes N] [--threads 1,2] [--prefetch BYTES] "
                    "[--hint nta|t0] [--json]\n");
    exit(2);
}

static void parse(int argc, char **argv, struct config *cfg) {
    *cfg = (struct config){ .bytes = (size_t)4096 << 20, .passes = 7, .thread_counts = { 1, 2 }, .n_counts = 2,
                            .hint = HINT_NONE };
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--json")) { cfg->json = 1; continue; }
        if (!v) usage();
        i++;
        if (!strcmp(a, "--size-mib")) cfg->bytes = (size_t)strtoull(v, NULL, 10) << 20;
        else if (!strcmp(a, "--passes")) cfg->passes = atoi(v);
        else if (!strcmp(a, "--prefetch")) cfg->prefetch = strtol(v, NULL, 10);
        else if (!strcmp(a, "--hint")) {
            if (!strcmp(v, "nta")) cfg->hint = HINT_NTA;
            else if (!strcmp(v, "t0")) cfg->hint = HINT_T0;
            else usage();
        } else if (!strcmp(a, "--threads")) {
            cfg->n_counts = 0;
            for (char *s = strtok(strdup(v), ","); s && cfg->n_counts < MAX_THREADS; s = strtok(NULL, ","))
                cfg->thread_counts[cfg->n_counts++] = atoi(s);
        } else usage();
    }
    if (cfg->bytes < ((size_t)1 << 20) || cfg->passes < 1 || cfg->passes > MAX_PASSES || cfg->prefetch < 0) usage();
    for (int i = 0; i < cfg->n_counts; i++)
        if (cfg->thread_counts[i] < 1 || cfg->thread_counts[i] > MAX_THREADS) usage();
    if (cfg->prefetch > 0 && cfg->hint == HINT_NONE) cfg->hint = HINT_NTA;
}

int main(int argc, char **argv) {
    struct config cfg;
    parse(argc, argv, &cfg);
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2")) {
        fprintf(stderr, "membw: this CPU has no AVX2\n");
        return 1;
    }
    uint8_t *buf = aligned_alloc(4096, cfg.bytes);
    if (!buf) {
        fprintf(stderr, "membw: could not allocate %zu MiB\n", cfg.bytes >> 20);
        return 1;
    }
    for (size_t i = 0; i < cfg.bytes / sizeof(float); i++) ((float *)buf)[i] = (float)(i & 1023) * 1e-3f;
    if (!cfg.json) {
        printf("buffer %zu MiB, %d passes, prefetch %ld (%s)\n", cfg.bytes >> 20, cfg.passes, cfg.prefetch,
               hint_name(cfg.hint));
        printf("| threads | GB/s median | min..max |\n|---|---:|---|\n");
    }
    for (int c = 0; c < cfg.n_counts; c++) {
        double gbps[MAX_PASSES];
        const int n = cfg.thread_counts[c];
        if (measure(&cfg, buf, n, gbps)) printf(" ");
        const double median = cfg.passes % 2 ? gbps[cfg.passes / 2]
                                             : (gbps[cfg.passes / 2 - 1] + gbps[cfg.passes / 2]) / 2;
        if (cfg.json)
            printf("{\"threads\": %d, \"size_mib\": %zu, \"prefetch\": %ld, \"hint\": \"%s\", \"passes\": %d, "
                   "\"gbps_median\": %.2f, \"gbps_min\": %.2f, \"gbps_max\": %.2f}\n",
                   n, cfg.bytes >> 20, cfg.prefetch, hint_name(cfg.hint), cfg.passes, median, gbps[0],
                   gbps[cfg.passes - 1]);
        else
            printf("| %d | %.2f | %.2f..%.2f |\n", n, median, gbps[0], gbps[cfg.passes - 1]);
        fflush(stdout);
    }
    free(buf);
    return 0;
}
