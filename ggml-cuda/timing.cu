// timing.cu - stage timings of a stream (timing.h). Each stream timed has a list of the marks
// queued since its last cuda_timing_end (an event and a stage name each); cuda_timing_end
// queues one more event, waits for it and adds each mark's time to the next event to its
// stage's total. The time from the last end to the next batch's first mark is the GPU idle
// between the host's calls (sampling, the caller's own work): it is a stage of its own.
#include "common.cuh"
#include "timing.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#define TIMED_STREAMS 16
#define TIMED_STAGES 64
#define BETWEEN_CALLS "(GPU idle between calls)"

struct stage_total {
    const char *name;
    double      ms;
    long        calls;
};

struct stream_timing {
    int          used;
    cuda_stream  s;
    cudaEvent_t *events;   // pool; events[0 .. n) are this batch's marks
    const char **names;
    int          n, cap;
    cudaEvent_t  ends[2];    // this batch's end is ends[cur], the one before ends[1 - cur]
    int          cur, has_end;
    int          failed;     // a CUDA call failed: this stream is timed no more
    struct stage_total totals[TIMED_STAGES];
    int          n_totals;
};

static struct stream_timing g_streams[TIMED_STREAMS];
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

extern "C" int cuda_timings_on(void) {
    static int on = -1;
    if (on < 0) {
        const char *v = getenv("PYKV_CUDA_TIMINGS");
        on = v && *v && strcmp(v, "0") != 0;
    }
    return on;
}

static struct stream_timing *find(cuda_stream s, int create) {
    for (int i = 0; i < TIMED_STREAMS; i++)
        if (g_streams[i].used && g_streams[i].s == s) return &g_streams[i];
    if (!create) return NULL;
    for (int i = 0; i < TIMED_STREAMS; i++)
        if (!g_streams[i].used) {
            memset(&g_streams[i], 0, sizeof(g_streams[i]));
            g_streams[i].used = 1;
            g_streams[i].s = s;
            return &g_streams[i];
        }
    return NULL;   // more streams than are timed: this one is not
}

static void add(struct stream_timing *t, const char *name, float ms) {
    int i = 0;
    while (i < t->n_totals && strcmp(t->totals[i].name, name) != 0) i++;
    if (i == t->n_totals) {
        if (t->n_totals == TIMED_STAGES) return;
        t->totals[t->n_totals++] = (struct stage_total){ name, 0.0, 0 };
    }
    t->totals[i].ms += ms;
    t->totals[i].calls++;
}

// A CUDA call of the timing failed: its error must not reach cuda_check as a kernel's.
static void give_up(struct stream_timing *t) {
    cudaGetLastError();
    t->failed = 1;
}

static int is_capturing(cuda_stream s) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(s, &st) != cudaSuccess) {
        cudaGetLastError();
        return 1;
    }
    return st != cudaStreamCaptureStatusNone;
}

// Queues the event of a mark.
static void record(struct stream_timing *t, const char *stage) {
    if (t->n == t->cap) {
        const int cap = t->cap ? 2 * t->cap : 256;
        cudaEvent_t *ev = (cudaEvent_t *)realloc(t->events, (size_t)cap * sizeof(*ev));
        if (ev) t->events = ev;
        const char **nm = ev ? (const char **)realloc(t->names, (size_t)cap * sizeof(*nm)) : NULL;
        if (nm) t->names = nm;
        if (!ev || !nm) {
            t->failed = 1;
            return;
        }
        for (int i = t->cap; i < cap; i++) {
            if (cudaEventCreate(&t->events[i]) != cudaSuccess) {
                t->cap = i;
                give_up(t);
                return;
            }
        }
        t->cap = cap;
    }
    if (cudaEventRecord(t->events[t->n], (cudaStream_t)t->s) != cudaSuccess) {
        give_up(t);
        return;
    }
    t->names[t->n++] = stage;
}

extern "C" void cuda_timing_mark(cuda_stream s, const char *stage) {
    if (!cuda_timings_on() || is_capturing(s)) return;
    pthread_mutex_lock(&g_lock);
    struct stream_timing *t = find(s, 1);
    if (t && !t->failed) record(t, stage);
    pthread_mutex_unlock(&g_lock);
}

// Waits for the batch's end and adds up its marks.
static void end_batch(struct stream_timing *t) {
    if (t->n == 0 || t->failed) return;
    if (!t->ends[0] && (cudaEventCreate(&t->ends[0]) != cudaSuccess || cudaEventCreate(&t->ends[1]) != cudaSuccess)) {
        give_up(t);
        return;
    }
    const cudaEvent_t end = t->ends[t->cur];
    if (cudaEventRecord(end, (cudaStream_t)t->s) != cudaSuccess || cudaEventSynchronize(end) != cudaSuccess) {
        give_up(t);
        return;
    }
    float ms = 0.0f;
    if (t->has_end && cudaEventElapsedTime(&ms, t->ends[1 - t->cur], t->events[0]) == cudaSuccess)
        add(t, BETWEEN_CALLS, ms);
    for (int i = 0; i < t->n; i++) {
        if (cudaEventElapsedTime(&ms, t->events[i], i + 1 < t->n ? t->events[i + 1] : end) != cudaSuccess) {
            give_up(t);
            return;
        }
        add(t, t->names[i], ms);
    }
    t->n = 0;
    t->has_end = 1;
    t->cur ^= 1;
}

extern "C" void cuda_timing_end(cuda_stream s) {
    if (!cuda_timings_on() || is_capturing(s)) return;
    pthread_mutex_lock(&g_lock);
    struct stream_timing *t = find(s, 0);
    if (t) end_batch(t);
    pthread_mutex_unlock(&g_lock);
}

static int by_time(const void *a, const void *b) {
    const double x = ((const struct stage_total *)a)->ms, y = ((const struct stage_total *)b)->ms;
    return (x < y) - (x > y);
}

extern "C" void cuda_timing_report(cuda_stream s, const char *title) {
    if (!cuda_timings_on()) return;
    pthread_mutex_lock(&g_lock);
    struct stream_timing *t = find(s, 0);
    if (t) {
        end_batch(t);
        double all = 0.0;
        for (int i = 0; i < t->n_totals; i++) all += t->totals[i].ms;
        qsort(t->totals, (size_t)t->n_totals, sizeof(t->totals[0]), by_time);
        fprintf(stderr, "pykv: GPU time by stage, %s%s\n", title,
                t->failed ? " (incomplete: a CUDA event call failed)" : "");
        fprintf(stderr, "  %-34s %8s %12s %10s %7s\n", "stage", "calls", "total ms", "ms/call", "share");
        for (int i = 0; i < t->n_totals; i++) {
            const struct stage_total *st = &t->totals[i];
            fprintf(stderr, "  %-34s %8ld %12.3f %10.4f %6.1f%%\n", st->name, st->calls, st->ms, st->ms / st->calls,
                    all > 0.0 ? 100.0 * st->ms / all : 0.0);
        }
        fprintf(stderr, "  %-34s %8s %12.3f\n", "all", "", all);
        for (int i = 0; i < t->cap; i++) cudaEventDestroy(t->events[i]);
        if (t->ends[0]) cudaEventDestroy(t->ends[0]);
        if (t->ends[1]) cudaEventDestroy(t->ends[1]);
        cudaGetLastError();
        free(t->events);
        free(t->names);
        memset(t, 0, sizeof(*t));
    }
    pthread_mutex_unlock(&g_lock);
}
