// staged-upload.cu - small uploads from pageable host memory that do not wait for the stream
// (cuda_upload_staged). A copy from pageable memory makes the host wait until the stream has
// run everything queued before it, so a policy's small uploads (a compaction's keep list, a
// window's row limits) would drain the GPU's queue each time. Here the bytes go through a ring
// of pinned memory per device instead: each piece's copy is followed by an event, and a piece
// of the ring is written again only once the event of the copy that last read it has passed
// (the ring is used in order, so those are always the oldest pending copies).
#include "common.cuh"

#include <pthread.h>
#include <string.h>

#define RING_BYTES ((size_t)4 << 20)
#define RING_PENDING 256     // copies in flight per ring
#define RING_DEVICES 16
#define RING_ALIGN 16

struct pending { size_t lo, hi; cudaEvent_t done; };

struct ring {
    char          *h;        // pinned, RING_BYTES; NULL until first used (or when that failed)
    int            tried;
    size_t         head;
    struct pending q[RING_PENDING];   // in the order the copies were queued
    int            first, count;
};

static struct ring g_rings[RING_DEVICES];
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

// Waits for the oldest pending copy and frees its piece (its event too).
static void retire_oldest(struct ring *r) {
    struct pending *p = &r->q[r->first];
    cudaEventSynchronize(p->done);
    cudaEventDestroy(p->done);
    r->first = (r->first + 1) % RING_PENDING;
    r->count--;
}

// Bytes [lo, hi) of the ring become free for a new copy: the pending copies reading them done.
static void make_room(struct ring *r, size_t lo, size_t hi) {
    while (r->count > 0) {
        const struct pending *p = &r->q[r->first];
        if (r->count < RING_PENDING && (p->hi <= lo || p->lo >= hi)) break;
        retire_oldest(r);
    }
}

extern "C" pykv_status cuda_upload_staged(void *d_dst, const void *src, size_t bytes, cuda_stream s) {
    if (bytes == 0) return PYKV_OK;
    int dev = 0;
    if (bytes > RING_BYTES / 4 || cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= RING_DEVICES)
        return cuda_upload_async(d_dst, src, bytes, s);
    pthread_mutex_lock(&g_lock);
    struct ring *r = &g_rings[dev];
    if (!r->h && !r->tried) {
        r->tried = 1;
        if (cudaMallocHost((void **)&r->h, RING_BYTES) != cudaSuccess) {
            cudaGetLastError();
            r->h = NULL;
        }
    }
    cudaEvent_t done = NULL;
    if (!r->h || cudaEventCreateWithFlags(&done, cudaEventDisableTiming) != cudaSuccess) {
        cudaGetLastError();
        pthread_mutex_unlock(&g_lock);
        return cuda_upload_async(d_dst, src, bytes, s);   // the plain way: correct, and waits
    }
    size_t at = (r->head + RING_ALIGN - 1) / RING_ALIGN * RING_ALIGN;
    if (at + bytes > RING_BYTES) at = 0;
    make_room(r, at, at + bytes);
    memcpy(r->h + at, src, bytes);
    cudaError_t e = cudaMemcpyAsync(d_dst, r->h + at, bytes, cudaMemcpyHostToDevice, s);
    if (e == cudaSuccess) e = cudaEventRecord(done, s);
    if (e != cudaSuccess) {   // nothing reads the piece: wait for the stream rather than track it
        cudaEventDestroy(done);
        cudaStreamSynchronize(s);
        pthread_mutex_unlock(&g_lock);
        cudaGetLastError();
        return pykv_error(PYKV_ERR_INTERNAL, "CUDA: copying to the GPU: %s", cudaGetErrorString(e));
    }
    r->q[(r->first + r->count) % RING_PENDING] = (struct pending){ at, at + bytes, done };
    r->count++;
    r->head = at + bytes;
    pthread_mutex_unlock(&g_lock);
    return PYKV_OK;
}
