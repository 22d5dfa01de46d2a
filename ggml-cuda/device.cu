// device.cu - device discovery, memory and streams, with CUDA's errors turned into pykv's.
#include "common.cuh"

#include <stdio.h>
#include <string.h>

// cudaGetDeviceCount is asked once: without a driver it fails quickly but every call would
// fail again, and the answer does not change while the process runs.
static int g_count = -1;
static char g_reason[160];

extern "C" int cuda_device_count(void) {
    if (g_count >= 0) return g_count;
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        snprintf(g_reason, sizeof(g_reason), "%s", e == cudaErrorNoDevice ? "no CUDA GPU found"
                 : e == cudaErrorInsufficientDriver ? "the NVIDIA driver is missing or older than this build's CUDA runtime"
                 : cudaGetErrorString(e));
        cudaGetLastError();   // not sticky: clear it
        n = 0;
    } else if (n == 0) {
        snprintf(g_reason, sizeof(g_reason), "no CUDA GPU found");
    }
    g_count = n;
    return n;
}

extern "C" const char *cuda_unavailable_reason(void) {
    cuda_device_count();
    return g_reason;
}

static pykv_status fail(cudaError_t e, const char *what) {
    cudaGetLastError();
    return pykv_error(e == cudaErrorMemoryAllocation ? PYKV_ERR_NOMEM : PYKV_ERR_INTERNAL, "CUDA: %s: %s", what,
                      cudaGetErrorString(e));
}
#define CUDA_TRY(call, what) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) return fail(e_, what); } while (0)

extern "C" pykv_status cuda_device_describe(int dev, char *buf, size_t cap) {
    if (dev < 0 || dev >= cuda_device_count()) return pykv_error(PYKV_ERR_INVALID_ARG, "no CUDA device %d", dev);
    cudaDeviceProp p;
    CUDA_TRY(cudaGetDeviceProperties(&p, dev), "reading the device's properties");
    size_t free_b = 0, total_b = 0;
    int cur = 0;
    CUDA_TRY(cudaGetDevice(&cur), "cudaGetDevice");
    CUDA_TRY(cudaSetDevice(dev), "selecting the device");
    const cudaError_t e = cudaMemGetInfo(&free_b, &total_b);
    cudaSetDevice(cur);
    if (e != cudaSuccess) return fail(e, "reading the device's memory");
    snprintf(buf, cap, "%s (sm_%d%d, %.1f GiB free of %.1f GiB)", p.name, p.major, p.minor,
             (double)free_b / (1 << 30), (double)total_b / (1 << 30));
    return PYKV_OK;
}

extern "C" pykv_status cuda_set_device(int dev) {
    CUDA_TRY(cudaSetDevice(dev), "selecting the device");
    return PYKV_OK;
}

extern "C" pykv_status cuda_mem_info(size_t *free_bytes, size_t *total_bytes) {
    CUDA_TRY(cudaMemGetInfo(free_bytes, total_bytes), "reading the device's memory");
    return PYKV_OK;
}

static pykv_status out_of_memory(size_t bytes, const char *what) {
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    return pykv_error(PYKV_ERR_NOMEM, "out of GPU memory for %s: %.1f MiB needed, %.1f MiB free of %.1f MiB", what,
                      (double)bytes / (1 << 20), (double)free_b / (1 << 20), (double)total_b / (1 << 20));
}

extern "C" pykv_status cuda_alloc(void **d_ptr, size_t bytes, const char *what) {
    *d_ptr = NULL;
    if (bytes == 0) return PYKV_OK;
    const cudaError_t e = cudaMalloc(d_ptr, bytes);
    if (e == cudaErrorMemoryAllocation) {
        cudaGetLastError();
        *d_ptr = NULL;
        return out_of_memory(bytes, what);
    }
    if (e != cudaSuccess) {
        *d_ptr = NULL;
        return fail(e, what);
    }
    return PYKV_OK;
}

extern "C" void cuda_free(void *d_ptr) {
    if (d_ptr) cudaFree(d_ptr);
}


// The current device's default pool keeps what is freed into it (the default gives it back at
// every synchronisation, which would make a growing list map memory again each chunk).
static void keep_pool_memory(void) {
    int dev = 0;
    cudaMemPool_t pool;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetDefaultMemPool(&pool, dev) != cudaSuccess) {
        cudaGetLastError();
        return;
    }
    uint64_t keep = UINT64_MAX;
    if (cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess) cudaGetLastError();
}

extern "C" pykv_status cuda_alloc_async(void **d_ptr, size_t bytes, cuda_stream s, const char *what) {
    *d_ptr = NULL;
    if (bytes == 0) return PYKV_OK;
    keep_pool_memory();
    const cudaError_t e = cudaMallocAsync(d_ptr, bytes, s);
    if (e != cudaSuccess) {
        *d_ptr = NULL;
        cudaGetLastError();
        return e == cudaErrorMemoryAllocation ? out_of_memory(bytes, what) : fail(e, what);
    }
    return PYKV_OK;
}

extern "C" void cuda_free_async(void *d_ptr, cuda_stream s) {
    if (d_ptr && cudaFreeAsync(d_ptr, s) != cudaSuccess) cudaGetLastError();
}

extern "C" void cuda_pool_trim(void) {
    int dev = 0;
    cudaMemPool_t pool;
    if (cudaGetDevice(&dev) == cudaSuccess && cudaDeviceGetDefaultMemPool(&pool, dev) == cudaSuccess)
        cudaMemPoolTrimTo(pool, 0);
    cudaGetLastError();
}

extern "C" pykv_status cuda_upload(void *d_dst, const void *src, size_t bytes) {
    if (bytes) CUDA_TRY(cudaMemcpy(d_dst, src, bytes, cudaMemcpyHostToDevice), "copying to the GPU");
    return PYKV_OK;
}
extern "C" pykv_status cuda_download(void *dst, const void *d_src, size_t bytes) {
    if (bytes) CUDA_TRY(cudaMemcpy(dst, d_src, bytes, cudaMemcpyDeviceToHost), "copying from the GPU");
    return PYKV_OK;
}
extern "C" pykv_status cuda_copy_d2d(void *d_dst, const void *d_src, size_t bytes, cuda_stream s) {
    if (bytes) CUDA_TRY(cudaMemcpyAsync(d_dst, d_src, bytes, cudaMemcpyDeviceToDevice, s), "copying on the GPU");
    return PYKV_OK;
}
extern "C" pykv_status cuda_upload_async(void *d_dst, const void *src, size_t bytes, cuda_stream s) {
    if (bytes) CUDA_TRY(cudaMemcpyAsync(d_dst, src, bytes, cudaMemcpyHostToDevice, s), "copying to the GPU");
    return PYKV_OK;
}
extern "C" pykv_status cuda_download_async(void *dst, const void *d_src, size_t bytes, cuda_stream s) {
    if (bytes) CUDA_TRY(cudaMemcpyAsync(dst, d_src, bytes, cudaMemcpyDeviceToHost, s), "copying from the GPU");
    return PYKV_OK;
}
extern "C" pykv_status cuda_memset(void *d_ptr, int value, size_t bytes, cuda_stream s) {
    if (bytes) CUDA_TRY(cudaMemsetAsync(d_ptr, value, bytes, s), "clearing GPU memory");
    return PYKV_OK;
}

extern "C" pykv_status cuda_host_alloc(void **p, size_t bytes) {
    *p = NULL;
    const cudaError_t e = cudaMallocHost(p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        *p = NULL;
        return fail(e, "allocating pinned host memory");
    }
    return PYKV_OK;
}
extern "C" void cuda_host_free(void *p) {
    if (p) cudaFreeHost(p);
}

extern "C" pykv_status cuda_graph_capture_begin(cuda_stream s) {
    // relaxed: other threads' allocations and frees (another context's cache) stay legal
    CUDA_TRY(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed), "starting a CUDA graph capture");
    return PYKV_OK;
}

extern "C" pykv_status cuda_graph_capture_end(cuda_stream s, cuda_graph *exec) {
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamEndCapture(s, &graph);
    if (e != cudaSuccess) {
        if (graph) cudaGraphDestroy(graph);
        return fail(e, "recording a CUDA graph");
    }
    cudaGraphExec_t old = (cudaGraphExec_t)*exec;
    if (old) {
        cudaGraphExecUpdateResultInfo info;
        if (cudaGraphExecUpdate(old, graph, &info) == cudaSuccess) {
            cudaGraphDestroy(graph);
            return PYKV_OK;
        }
        cudaGetLastError();
    }
    cudaGraphExec_t made = NULL;
    e = cudaGraphInstantiate(&made, graph, 0);
    cudaGraphDestroy(graph);
    if (e != cudaSuccess) return fail(e, "instantiating a CUDA graph");
    if (old) cudaGraphExecDestroy(old);
    *exec = (cuda_graph)made;
    return PYKV_OK;
}

extern "C" pykv_status cuda_graph_launch(cuda_graph exec, cuda_stream s) {
    CUDA_TRY(cudaGraphLaunch((cudaGraphExec_t)exec, s), "launching a CUDA graph");
    return PYKV_OK;
}

extern "C" void cuda_graph_free(cuda_graph exec) {
    if (exec) cudaGraphExecDestroy((cudaGraphExec_t)exec);
}

extern "C" pykv_status cuda_stream_create(cuda_stream *s) {
    cudaStream_t st;
    // non-blocking: no implicit order with the legacy default stream, which another thread
    // may use (loading a model) while this stream records a graph
    CUDA_TRY(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "creating a stream");
    *s = st;
    return PYKV_OK;
}
extern "C" void cuda_stream_destroy(cuda_stream s) {
    if (s) cudaStreamDestroy(s);
}
extern "C" pykv_status cuda_stream_sync(cuda_stream s) {
    CUDA_TRY(cudaStreamSynchronize(s), "running the GPU's work");
    return PYKV_OK;
}

extern "C" pykv_status cuda_check(const char *what) {
    CUDA_TRY(cudaGetLastError(), what);
    return PYKV_OK;
}
