/*
 * libascendcl.so of moegrad's CANN simulator: the runtime half of CANN's C ABI.
 *
 * "Device" memory is host memory that only this library hands out; every block, stream and
 * launched kernel is tracked so a test can ask what is still alive (moegradSimCounts). The rules a
 * real device enforces and that a binding most easily gets wrong are enforced here too:
 *   - the current context is per thread: a runtime call from a thread that never called
 *     aclrtSetDevice (or whose device was reset to zero references) fails with 107002;
 *   - aclrtSetDevice / aclrtResetDevice are reference counted; at zero the device releases
 *     whatever the process left on it (counted as "reclaimed", so a test can insist on zero);
 *   - a kernel is asynchronous: one that hangs keeps its memory busy until a stream sync or query
 *     observes its completion. aclrtFree releases memory at once, as CANN's does (it neither
 *     synchronises nor waits for the kernels using it): freeing busy memory is counted as a
 *     violation. aclrtDestroyStream and the last aclrtResetDevice wait for the stream's kernels, as
 *     CANN's do; on a kernel that hangs for good they would block forever, so here the wait is cut
 *     short after MOEGRAD_SIM_BLOCK_CAP_MS (default 3000) and counted as "blocked" and a violation.
 *     aclrtDestroyStreamForce does not wait: it discards the stream's kernels unrun;
 *   - aclrtSynchronizeStreamWithTimeout accepts -1 or a timeout > 0 ms only (0 and < -1: 107000),
 *     as CANN's runtime checks; aclrtStreamQuery is the poll;
 *   - aclInit / aclFinalizeReference are reference counted (a repeated aclInit counts and answers
 *     100002); aclFinalize drops every reference.
 * Faults are injected with moegradSimInjectFault or MOEGRAD_SIM_FAULTS (read by aclInit), e.g.
 * "launch@3,hang@1:250": the 3rd launch from now fails; the next launched kernel hangs 250 ms.
 * Kinds: malloc, memcpy, launch, sync, hang, health (aclrtGetMemInfo), tiling and kernel (phase one).
 * MOEGRAD_SIM_DEVICE_COUNT (default 1) and MOEGRAD_SIM_SOC_NAME (default Ascend910B3) shape the device.
 * The package versions (aclsysGetVersionStr) are in sysinfo.c, linked into this library.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sim.h"

#define SIM_MAX_DEVICES 16
#define SIM_HBM_BYTES (64ULL << 30)
#define STREAM_MAGIC 0x53545245414d5f31ULL /* "STREAM_1" */

typedef struct Alloc {
    void *base;
    uint64_t size;
    int device;
    int busy; /* pending kernels that use this block */
    struct Alloc *next;
} Alloc;

typedef struct Stream {
    uint64_t magic;
    int device;
    SimJob *head, *tail;
    struct Stream *next;
} Stream;

typedef struct {
    int64_t countdown; /* 0: disarmed; fires when it reaches 0 from 1 */
    int64_t arg;
    int64_t seen;      /* calls of this kind since load */
} Fault;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cond;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_initialized;
static int64_t g_refs[SIM_MAX_DEVICES];
static uint64_t g_generation[SIM_MAX_DEVICES];
static Alloc *g_allocs;
static Stream *g_streams;
static int64_t g_counts[SIM_COUNT__N];
static Fault g_faults[SIM_FAULT__N];

static __thread int t_device = -1;
static __thread uint64_t t_generation;
static __thread int64_t t_sets;
static __thread char t_error[1024];
static __thread char t_error_out[1024];

static const char *const FAULT_NAMES[SIM_FAULT__N] = {"malloc", "memcpy", "launch", "sync",
                                                      "hang",   "health", "tiling", "kernel"};

static void init_once(void) {
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&g_cond, &attr);
    pthread_condattr_destroy(&attr);
    for (int d = 0; d < SIM_MAX_DEVICES; d++) g_generation[d] = 1;
}

static void lock(void) {
    pthread_once(&g_once, init_once);
    pthread_mutex_lock(&g_lock);
}

static void unlock(void) { pthread_mutex_unlock(&g_lock); }

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- errors, counters, faults (callable from the other two libraries) ---------------------- */

SIM_EXPORT void moegradSimSetError(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t_error, sizeof t_error, fmt, ap);
    va_end(ap);
}

SIM_EXPORT void moegradSimTrack(int counter, int64_t delta) {
    if (counter < 0 || counter >= SIM_COUNT__N) return;
    lock();
    g_counts[counter] += delta;
    unlock();
}

static int fault_fires_locked(int kind, int64_t *arg, int64_t *serial) {
    Fault *f = &g_faults[kind];
    f->seen++;
    if (serial) *serial = f->seen;
    if (f->countdown > 0 && --f->countdown == 0) {
        if (arg) *arg = f->arg;
        return 1;
    }
    return 0;
}

SIM_EXPORT int moegradSimFaultFires(int kind, int64_t *arg, int64_t *serial) {
    if (kind < 0 || kind >= SIM_FAULT__N) return 0;
    lock();
    int fires = fault_fires_locked(kind, arg, serial);
    unlock();
    return fires;
}

static int has_context_locked(void) {
    return t_device >= 0 && t_sets > 0 && g_refs[t_device] > 0 && t_generation == g_generation[t_device];
}

static int check_context_locked(const char *api) {
    if (!g_initialized) {
        moegradSimSetError("EH0001: [moegrad-sim] %s: aclInit has not been called", api);
        return SIM_ACL_ERROR_UNINITIALIZE;
    }
    if (!has_context_locked()) {
        g_counts[SIM_COUNT_CONTEXT_ERRORS]++;
        moegradSimSetError("EE1001: [moegrad-sim] %s: the calling thread has no current context "
                           "(call aclrtSetDevice on this thread first)", api);
        return SIM_RT_CONTEXT_NULL;
    }
    return SIM_ACL_SUCCESS;
}

SIM_EXPORT int moegradSimCheckContext(const char *api) {
    lock();
    int rc = check_context_locked(api);
    unlock();
    return rc;
}

static Alloc *find_block_locked(const void *ptr, uint64_t bytes) {
    const char *p = ptr;
    for (Alloc *a = g_allocs; a; a = a->next) {
        const char *base = a->base;
        if (p >= base && p <= base + a->size && (uint64_t)(base + a->size - p) >= bytes) return a;
    }
    return NULL;
}

SIM_EXPORT int moegradSimRangeLive(const void *ptr, uint64_t bytes) {
    lock();
    int live = ptr != NULL && find_block_locked(ptr, bytes) != NULL;
    unlock();
    return live;
}

static Stream *find_stream_locked(const void *handle) {
    for (Stream *s = g_streams; s; s = s->next)
        if (s == handle && s->magic == STREAM_MAGIC) return s;
    return NULL;
}

/* Run the stream's kernels as they complete, waiting for hung ones until `deadline_ms` (-1: no
 * limit). DRAIN_IDLE: the stream is empty; DRAIN_TIMEOUT: a kernel still runs; DRAIN_GONE: the stream
 * was released (a device reset) while waiting. */
enum { DRAIN_IDLE = 0, DRAIN_TIMEOUT = 1, DRAIN_GONE = 2 };
static int drain_stream_locked(Stream *s, int64_t deadline_ms);
static int64_t block_cap_deadline(void);

static void mark_busy_locked(SimJob *job, int delta) {
    for (int i = 0; i < job->nranges; i++) {
        Alloc *a = find_block_locked(job->ranges[i].ptr, job->ranges[i].bytes);
        if (a && (delta > 0 || a->busy > 0)) a->busy += delta; /* (a freed block may have been reused) */
    }
}

/* Run a completed kernel: its memory must still be live (anything else is a violation). */
static void complete_job_locked(SimJob *job, int run) {
    int ok = 1;
    for (int i = 0; i < job->nranges; i++)
        if (!find_block_locked(job->ranges[i].ptr, job->ranges[i].bytes)) ok = 0;
    if (!ok) g_counts[SIM_COUNT_VIOLATIONS]++;
    if (ok && run) job->run(job->ctx);
    job->release(job->ctx);
    free(job);
}

static SimJob *pop_job_locked(Stream *s) {
    SimJob *job = s->head;
    s->head = job->next;
    if (!s->head) s->tail = NULL;
    mark_busy_locked(job, -1);
    g_counts[SIM_COUNT_PENDING]--;
    return job;
}

SIM_EXPORT int moegradSimEnqueue(void *stream, SimJob *job) {
    lock();
    int rc = check_context_locked("aclnnMoeInitRoutingV2Grad");
    if (rc != SIM_ACL_SUCCESS) {
        unlock();
        return rc;
    }
    Stream *s = NULL;
    if (stream != NULL) {
        s = find_stream_locked(stream);
        if (!s) {
            moegradSimSetError("EE1002: [moegrad-sim] launch on %p, which is not a live stream", stream);
            unlock();
            return SIM_RT_PARAM_INVALID;
        }
        if (s->device != t_device) {
            moegradSimSetError("EE1003: [moegrad-sim] stream %p belongs to device %d, not the current device %d",
                               stream, s->device, t_device);
            unlock();
            return SIM_RT_STREAM_CONTEXT;
        }
    }
    for (int i = 0; i < job->nranges; i++) {
        if (!find_block_locked(job->ranges[i].ptr, job->ranges[i].bytes)) {
            g_counts[SIM_COUNT_VIOLATIONS]++;
            moegradSimSetError("EZ9999: [moegrad-sim] the kernel would access %llu bytes at %p, which is not live "
                               "device memory", (unsigned long long)job->ranges[i].bytes, job->ranges[i].ptr);
            unlock();
            return SIM_RT_INTERNAL_ERROR;
        }
    }
    int64_t hang_ms = 0;
    if (fault_fires_locked(SIM_FAULT_HANG, &hang_ms, NULL)) {
        job->hung = 1;
        job->hang_until_ms = hang_ms < 0 ? -1 : now_ms() + hang_ms;
    }
    job->next = NULL;
    if (s == NULL || (!job->hung && s->head == NULL)) {
        complete_job_locked(job, 1); /* nothing ahead of it: the kernel is done at once */
    } else {
        if (s->tail) s->tail->next = job; else s->head = job;
        s->tail = job;
        mark_busy_locked(job, +1);
        g_counts[SIM_COUNT_PENDING]++;
    }
    unlock();
    return SIM_ACL_SUCCESS;
}

/* Release everything left on `device` (a reset to zero references, or aclFinalize). */
static void reclaim_device_locked(int device) {
    for (Stream **sp = &g_streams; *sp;) {
        Stream *s = *sp;
        if (s->device != device) {
            sp = &s->next;
            continue;
        }
        while (s->head) {
            SimJob *job = pop_job_locked(s);
            job->release(job->ctx);
            free(job);
            g_counts[SIM_COUNT_RECLAIMED]++;
        }
        *sp = s->next;
        s->magic = 0;
        free(s);
        g_counts[SIM_COUNT_STREAMS]--;
        g_counts[SIM_COUNT_RECLAIMED]++;
    }
    for (Alloc **ap = &g_allocs; *ap;) {
        Alloc *a = *ap;
        if (a->device != device) {
            ap = &a->next;
            continue;
        }
        *ap = a->next;
        g_counts[SIM_COUNT_ALLOCATIONS]--;
        g_counts[SIM_COUNT_ALLOCATED_BYTES] -= (int64_t)a->size;
        g_counts[SIM_COUNT_RECLAIMED]++;
        free(a->base);
        free(a);
    }
    g_generation[device]++;
    pthread_cond_broadcast(&g_cond);
}

static void parse_fault_env(void) {
    const char *spec = getenv("MOEGRAD_SIM_FAULTS");
    if (!spec || !*spec) return;
    char buf[512];
    snprintf(buf, sizeof buf, "%s", spec);
    char *save = NULL;
    for (char *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char kind[32] = {0};
        long long nth = 0, arg = 0;
        if (sscanf(item, " %31[a-z]@%lld:%lld", kind, &nth, &arg) < 2 || nth < 1) continue;
        for (int k = 0; k < SIM_FAULT__N; k++) {
            if (strcmp(kind, FAULT_NAMES[k]) == 0) {
                g_faults[k].countdown = nth;
                g_faults[k].arg = arg;
            }
        }
    }
}

/* ---- acl/acl.h, acl/acl_base.h ---------------------------------------------------------------- */

SIM_EXPORT int32_t aclInit(const char *configPath) {
    (void)configPath;
    lock();
    if (g_initialized) { /* CANN counts a repeated aclInit too, and answers 100002 */
        g_counts[SIM_COUNT_ACL_REFS]++;
        unlock();
        moegradSimSetError("EH0002: [moegrad-sim] aclInit: already initialized");
        return SIM_ACL_ERROR_REPEAT_INITIALIZE;
    }
    g_initialized = 1;
    g_counts[SIM_COUNT_INITIALIZED] = 1;
    g_counts[SIM_COUNT_ACL_REFS] = 1;
    parse_fault_env();
    unlock();
    return SIM_ACL_SUCCESS;
}

static void finalize_locked(void);

SIM_EXPORT int32_t aclFinalize(void) {
    lock();
    if (!g_initialized) {
        unlock();
        moegradSimSetError("EH0003: [moegrad-sim] aclFinalize: not initialized");
        return SIM_ACL_ERROR_REPEAT_FINALIZE;
    }
    finalize_locked(); /* every reference, whoever holds it */
    unlock();
    return SIM_ACL_SUCCESS;
}

SIM_EXPORT int32_t aclFinalizeReference(uint64_t *refCount) {
    lock();
    if (g_counts[SIM_COUNT_ACL_REFS] < 1) {
        if (refCount) *refCount = 0;
        unlock();
        moegradSimSetError("EH0003: [moegrad-sim] aclFinalizeReference: not initialized");
        return SIM_ACL_ERROR_REPEAT_FINALIZE;
    }
    if (--g_counts[SIM_COUNT_ACL_REFS] == 0) finalize_locked();
    if (refCount) *refCount = (uint64_t)g_counts[SIM_COUNT_ACL_REFS];
    unlock();
    return SIM_ACL_SUCCESS;
}

static void finalize_locked(void) {
    for (int d = 0; d < SIM_MAX_DEVICES; d++) {
        if (g_refs[d] > 0) {
            g_refs[d] = 0;
            reclaim_device_locked(d);
        }
    }
    g_counts[SIM_COUNT_DEVICE_REFS] = 0;
    g_initialized = 0;
    g_counts[SIM_COUNT_INITIALIZED] = 0;
    g_counts[SIM_COUNT_ACL_REFS] = 0;
}

SIM_EXPORT const char *aclGetRecentErrMsg(void) {
    if (!t_error[0]) return NULL;
    memcpy(t_error_out, t_error, sizeof t_error_out);
    t_error[0] = 0; /* CANN clears the message once read */
    return t_error_out;
}

SIM_EXPORT const char *aclrtGetSocName(void) {
    lock();
    int up = g_initialized;
    unlock();
    if (!up) return NULL;
    const char *name = getenv("MOEGRAD_SIM_SOC_NAME");
    return name && *name ? name : "Ascend910B3";
}

/* ---- acl/acl_rt.h: devices ---------------------------------------------------------------------- */

static int device_count(void) {
    const char *env = getenv("MOEGRAD_SIM_DEVICE_COUNT");
    int n = env ? atoi(env) : 1;
    return n < 0 ? 0 : n > SIM_MAX_DEVICES ? SIM_MAX_DEVICES : n;
}

SIM_EXPORT int32_t aclrtGetDeviceCount(uint32_t *count) {
    if (!count) return SIM_RT_PARAM_INVALID;
    *count = (uint32_t)device_count();
    return SIM_ACL_SUCCESS;
}

SIM_EXPORT int32_t aclrtSetDevice(int32_t deviceId) {
    lock();
    if (!g_initialized) {
        unlock();
        moegradSimSetError("EH0001: [moegrad-sim] aclrtSetDevice: aclInit has not been called");
        return SIM_ACL_ERROR_UNINITIALIZE;
    }
    if (deviceId < 0 || deviceId >= device_count()) {
        unlock();
        moegradSimSetError("EE1004: [moegrad-sim] aclrtSetDevice: device %d does not exist (%d visible)",
                           deviceId, device_count());
        return SIM_RT_INVALID_DEVICEID;
    }
    g_refs[deviceId]++;
    g_counts[SIM_COUNT_DEVICE_REFS]++;
    if (t_device != deviceId || t_generation != g_generation[deviceId]) {
        t_device = deviceId;
        t_generation = g_generation[deviceId];
        t_sets = 0;
    }
    t_sets++;
    unlock();
    return SIM_ACL_SUCCESS;
}

SIM_EXPORT int32_t aclrtResetDevice(int32_t deviceId) {
    lock();
    if (deviceId < 0 || deviceId >= SIM_MAX_DEVICES) {
        unlock();
        moegradSimSetError("EE1004: [moegrad-sim] aclrtResetDevice: device %d does not exist", deviceId);
        return SIM_RT_INVALID_DEVICEID;
    }
    if (g_refs[deviceId] == 0) {
        unlock();
        moegradSimSetError("EE1005: [moegrad-sim] aclrtResetDevice: device %d holds no reference", deviceId);
        return SIM_RT_PARAM_INVALID;
    }
    g_refs[deviceId]--;
    g_counts[SIM_COUNT_DEVICE_REFS]--;
    if (t_device == deviceId && t_generation == g_generation[deviceId] && t_sets > 0) t_sets--;
    if (g_refs[deviceId] == 0) {
        /* The last reset waits for the device's kernels, as CANN's does. */
        for (Stream *st = g_streams; st; st = st->next) {
            if (st->device != deviceId) continue;
            if (drain_stream_locked(st, block_cap_deadline()) != DRAIN_IDLE) {
                g_counts[SIM_COUNT_BLOCKED]++;
                g_counts[SIM_COUNT_VIOLATIONS]++;
                break;
            }
        }
        reclaim_device_locked(deviceId);
    }
    unlock();
    return SIM_ACL_SUCCESS;
}

/* ---- acl/acl_rt.h: memory ----------------------------------------------------------------------- */

SIM_EXPORT int32_t aclrtMalloc(void **devPtr, size_t size, int policy) {
    lock();
    int rc = check_context_locked("aclrtMalloc");
    if (rc != SIM_ACL_SUCCESS) {
        unlock();
        return rc;
    }
    if (!devPtr || size == 0 || policy < 0 || policy > 2) {
        unlock();
        moegradSimSetError("EE1006: [moegrad-sim] aclrtMalloc: invalid argument (ptr %p, size %zu, policy %d)",
                           (void *)devPtr, size, policy);
        return SIM_RT_PARAM_INVALID;
    }
    int64_t serial = 0;
    if (fault_fires_locked(SIM_FAULT_MALLOC, NULL, &serial)) {
        unlock();
        moegradSimSetError("EL0004: [moegrad-sim] injected out of device memory (malloc #%lld, %zu bytes)",
                           (long long)serial, size);
        return SIM_RT_MEMORY_ALLOCATION;
    }
    uint64_t padded = ((uint64_t)size + 31) / 32 * 32 + 32; /* CANN pads to 32 bytes, plus 32 */
    void *base = NULL;
    Alloc *a = malloc(sizeof *a);
    if (!a || posix_memalign(&base, 512, padded) != 0) {
        free(a);
        unlock();
        moegradSimSetError("EL0004: [moegrad-sim] out of host memory for %zu bytes", size);
        return SIM_RT_MEMORY_ALLOCATION;
    }
    memset(base, 0xA5, padded); /* never zero: a kernel that skips a write shows garbage */
    a->base = base;
    a->size = size;
    a->device = t_device;
    a->busy = 0;
    a->next = g_allocs;
    g_allocs = a;
    g_counts[SIM_COUNT_ALLOCATIONS]++;
    g_counts[SIM_COUNT_ALLOCATED_BYTES] += (int64_t)size;
    g_counts[SIM_COUNT_MALLOCS]++;
    *devPtr = base;
    unlock();
    return SIM_ACL_SUCCESS;
}

SIM_EXPORT int32_t aclrtFree(void *devPtr) {
    lock();
    int rc = check_context_locked("aclrtFree");
    if (rc != SIM_ACL_SUCCESS) {
        unlock();
        return rc;
    }
    Alloc **ap = &g_allocs;
    while (*ap && (*ap)->base != devPtr) ap = &(*ap)->next;
    if (!*ap) {
        g_counts[SIM_COUNT_VIOLATIONS]++;
        unlock();
        moegradSimSetError("EE1007: [moegrad-sim] aclrtFree: %p is not a live device allocation", devPtr);
        return SIM_RT_PARAM_INVALID;
    }
    Alloc *a = *ap;
    if (a->busy) /* CANN frees at once and does not wait: a kernel still running now uses freed memory */
        g_counts[SIM_COUNT_VIOLATIONS]++;
    *ap = a->next;
    g_counts[SIM_COUNT_ALLOCATIONS]--;
    g_counts[SIM_COUNT_ALLOCATED_BYTES] -= (int64_t)a->size;
    free(a->base);
    free(a);
    unlock();
    return SIM_ACL_SUCCESS;
}

SIM_EXPORT int32_t aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, int kind) {
    lock();
    int rc = check_context_locked("aclrtMemcpy");
    if (rc != SIM_ACL_SUCCESS) {
        unlock();
        return rc;
    }
    if (!dst || !src || count > destMax || kind < 0 || kind > 3) {
        unlock();
        moegradSimSetError("EE1009: [moegrad-sim] aclrtMemcpy: invalid argument (count %zu, destMax %zu, kind %d)",
                           count, destMax, kind);
        return SIM_RT_PARAM_INVALID;
    }
    int dst_device = kind == 1 || kind == 3, src_device = kind == 2 || kind == 3;
    Alloc *d = dst_device ? find_block_locked(dst, count) : NULL;
    Alloc *s = src_device ? find_block_locked(src, count) : NULL;
    if ((dst_device && !d) || (src_device && !s)) {
        g_counts[SIM_COUNT_VIOLATIONS]++;
        unlock();
        moegradSimSetError("EE1010: [moegrad-sim] aclrtMemcpy: the %s range of %zu bytes is not live device memory",
                           dst_device && !d ? "destination" : "source", count);
        return SIM_RT_PARAM_INVALID;
    }
    if ((d && d->busy) || (s && s->busy)) {
        g_counts[SIM_COUNT_VIOLATIONS]++;
        unlock();
        moegradSimSetError("EE1011: [moegrad-sim] aclrtMemcpy: device memory still in use by an unfinished kernel");
        return SIM_RT_INTERNAL_ERROR;
    }
    int64_t serial = 0;
    if (fault_fires_locked(SIM_FAULT_MEMCPY, NULL, &serial)) {
        unlock();
        moegradSimSetError("EE9999: [moegrad-sim] injected memcpy failure (memcpy #%lld, %zu bytes)",
                           (long long)serial, count);
        return SIM_RT_INTERNAL_ERROR;
    }
    memcpy(dst, src, count);
    unlock();
    return SIM_ACL_SUCCESS;
}

SIM_EXPORT int32_t aclrtGetMemInfo(int attr, size_t *free_bytes, size_t *total_bytes) {
    lock();
    int rc = check_context_locked("aclrtGetMemInfo");
    if (rc != SIM_ACL_SUCCESS) {
        unlock();
        return rc;
    }
    if (!free_bytes || !total_bytes || attr < 0 || attr > 1) {
        unlock();
        moegradSimSetError("EE1012: [moegrad-sim] aclrtGetMemInfo: invalid argument (attr %d)", attr);
        return SIM_RT_PARAM_INVALID;
    }
    int64_t serial = 0;
    if (fault_fires_locked(SIM_FAULT_HEALTH, NULL, &serial)) {
        unlock();
        moegradSimSetError("EL9999: [moegrad-sim] injected driver failure (aclrtGetMemInfo #%lld)", (long long)serial);
        return SIM_RT_DRV_INTERNAL_ERROR;
    }
    *total_bytes = SIM_HBM_BYTES;
    *free_bytes = SIM_HBM_BYTES - (uint64_t)g_counts[SIM_COUNT_ALLOCATED_BYTES];
    unlock();
    return SIM_ACL_SUCCESS;
}

/* ---- acl/acl_rt.h: streams ---------------------------------------------------------------------- */

SIM_EXPORT int32_t aclrtCreateStream(void **stream) {
    lock();
    int rc = check_context_locked("aclrtCreateStream");
    if (rc != SIM_ACL_SUCCESS) {
        unlock();
        return rc;
    }
    Stream *s = stream ? calloc(1, sizeof *s) : NULL;
    if (!s) {
        unlock();
        moegradSimSetError("EE1013: [moegrad-sim] aclrtCreateStream: invalid argument");
        return SIM_RT_PARAM_INVALID;
    }
    s->magic = STREAM_MAGIC;
    s->device = t_device;
    s->next = g_streams;
    g_streams = s;
    g_counts[SIM_COUNT_STREAMS]++;
    g_counts[SIM_COUNT_STREAMS_CREATED]++;
    *stream = s;
    unlock();
    return SIM_ACL_SUCCESS;
}

static int stream_for_call_locked(void *stream, const char *api, Stream **out) {
    int rc = check_context_locked(api);
    if (rc != SIM_ACL_SUCCESS) return rc;
    Stream *s = find_stream_locked(stream);
    if (!s) {
        moegradSimSetError("EE1002: [moegrad-sim] %s: %p is not a live stream", api, stream);
        return SIM_RT_PARAM_INVALID;
    }
    if (s->device != t_device) {
        moegradSimSetError("EE1003: [moegrad-sim] %s: stream %p belongs to device %d, not the current device %d", api,
                           stream, s->device, t_device);
        return SIM_RT_STREAM_CONTEXT;
    }
    *out = s;
    return SIM_ACL_SUCCESS;
}

static int drain_stream_locked(Stream *s, int64_t deadline_ms) {
    while (s->head) {
        SimJob *job = s->head;
        if (job->hung) {
            int64_t now = now_ms();
            if (job->hang_until_ms >= 0 && now >= job->hang_until_ms) {
                job->hung = 0;
                continue;
            }
            if (deadline_ms >= 0 && now >= deadline_ms) return DRAIN_TIMEOUT;
            int64_t wake = job->hang_until_ms;
            if (deadline_ms >= 0 && (wake < 0 || deadline_ms < wake)) wake = deadline_ms;
            if (wake < 0) {
                pthread_cond_wait(&g_cond, &g_lock);
            } else {
                struct timespec ts = {.tv_sec = wake / 1000, .tv_nsec = (wake % 1000) * 1000000};
                pthread_cond_timedwait(&g_cond, &g_lock, &ts);
            }
            if (find_stream_locked(s) != s) return DRAIN_GONE;
            continue;
        }
        complete_job_locked(pop_job_locked(s), 1);
    }
    return DRAIN_IDLE;
}

/* Complete whatever has finished by now, without waiting. */
static void progress_stream_locked(Stream *s) {
    int64_t now = now_ms();
    while (s->head) {
        SimJob *job = s->head;
        if (job->hung && job->hang_until_ms >= 0 && now >= job->hang_until_ms) job->hung = 0;
        if (job->hung) return;
        complete_job_locked(pop_job_locked(s), 1);
    }
}

static int64_t block_cap_deadline(void) {
    const char *env = getenv("MOEGRAD_SIM_BLOCK_CAP_MS");
    long long cap = env && *env ? atoll(env) : 3000;
    return now_ms() + (cap < 0 ? 0 : cap);
}

static void unlink_stream_locked(Stream *s) {
    Stream **sp = &g_streams;
    while (*sp != s) sp = &(*sp)->next;
    *sp = s->next;
    s->magic = 0;
    free(s);
    g_counts[SIM_COUNT_STREAMS]--;
}

SIM_EXPORT int32_t aclrtDestroyStream(void *stream) {
    lock();
    Stream *s = NULL;
    int rc = stream_for_call_locked(stream, "aclrtDestroyStream", &s);
    if (rc != SIM_ACL_SUCCESS) {
        unlock();
        return rc;
    }
    /* CANN waits for the stream's tasks before destroying it. */
    int drained = drain_stream_locked(s, block_cap_deadline());
    if (drained == DRAIN_GONE) {
        unlock();
        moegradSimSetError("EE1016: [moegrad-sim] stream %p was released while being destroyed", stream);
        return SIM_RT_PARAM_INVALID;
    }
    if (drained == DRAIN_TIMEOUT) {
        g_counts[SIM_COUNT_BLOCKED]++;
        g_counts[SIM_COUNT_VIOLATIONS]++;
        unlock();
        moegradSimSetError("EE1014: [moegrad-sim] aclrtDestroyStream: a kernel on stream %p never finishes; the "
                           "real runtime would block here forever", stream);
        return SIM_RT_STREAM_NOT_COMPLETE;
    }
    unlink_stream_locked(s);
    unlock();
    return SIM_ACL_SUCCESS;
}

SIM_EXPORT int32_t aclrtDestroyStreamForce(void *stream) {
    lock();
    Stream *s = NULL;
    int rc = stream_for_call_locked(stream, "aclrtDestroyStreamForce", &s);
    if (rc != SIM_ACL_SUCCESS) {
        unlock();
        return rc;
    }
    while (s->head) { /* not waited for: discarded unrun */
        SimJob *job = pop_job_locked(s);
        job->release(job->ctx);
        free(job);
    }
    unlink_stream_locked(s);
    g_counts[SIM_COUNT_FORCED]++;
    pthread_cond_broadcast(&g_cond);
    unlock();
    return SIM_ACL_SUCCESS;
}

SIM_EXPORT int32_t aclrtStreamQuery(void *stream, int32_t *status) {
    lock();
    g_counts[SIM_COUNT_QUERIES]++;
    Stream *s = NULL;
    int rc = stream_for_call_locked(stream, "aclrtStreamQuery", &s);
    if (rc != SIM_ACL_SUCCESS) {
        unlock();
        return rc;
    }
    if (!status) {
        unlock();
        moegradSimSetError("EE1006: [moegrad-sim] aclrtStreamQuery: status is nullptr");
        return SIM_RT_PARAM_INVALID;
    }
    progress_stream_locked(s);
    *status = s->head ? 1 : 0; /* ACL_STREAM_STATUS_NOT_READY : ACL_STREAM_STATUS_COMPLETE */
    unlock();
    return SIM_ACL_SUCCESS;
}

SIM_EXPORT int32_t aclrtSynchronizeStreamWithTimeout(void *stream, int32_t timeout) {
    lock();
    g_counts[SIM_COUNT_SYNCS]++;
    if (timeout == 0 || timeout < -1) { /* CANN's StreamSynchronize check: -1 or > 0 only */
        unlock();
        moegradSimSetError("EE1006: [moegrad-sim] aclrtSynchronizeStreamWithTimeout: timeout=%dms is invalid "
                           "(-1 waits forever, > 0 is a timeout in ms)", (int)timeout);
        return SIM_RT_PARAM_INVALID;
    }
    Stream *s = NULL;
    int rc = stream_for_call_locked(stream, "aclrtSynchronizeStreamWithTimeout", &s);
    if (rc != SIM_ACL_SUCCESS) {
        unlock();
        return rc;
    }
    int64_t serial = 0;
    if (fault_fires_locked(SIM_FAULT_SYNC, NULL, &serial)) {
        while (s->head) complete_job_locked(pop_job_locked(s), 0); /* the kernels ended in error */
        unlock();
        moegradSimSetError("EZ9999: [moegrad-sim] injected AI Core exception reported by stream sync #%lld",
                           (long long)serial);
        return SIM_RT_AICORE_EXCEPTION;
    }
    int drained = drain_stream_locked(s, timeout < 0 ? -1 : now_ms() + timeout);
    unlock();
    if (drained == DRAIN_TIMEOUT) {
        moegradSimSetError("EE1015: [moegrad-sim] stream synchronize timeout after %d ms (a kernel is "
                           "still running)", timeout);
        return SIM_RT_STREAM_SYNC_TIMEOUT;
    }
    if (drained == DRAIN_GONE) {
        moegradSimSetError("EE1016: [moegrad-sim] stream %p was released while being synchronized", stream);
        return SIM_RT_PARAM_INVALID;
    }
    return SIM_ACL_SUCCESS;
}

/* ---- the simulator's own test interface ----------------------------------------------------------- */

SIM_EXPORT int32_t moegradSimCounts(int64_t *out, int32_t capacity) {
    lock();
    for (int i = 0; i < SIM_COUNT__N && i < capacity; i++) out[i] = g_counts[i];
    unlock();
    return SIM_COUNT__N;
}

SIM_EXPORT int32_t moegradSimInjectFault(const char *kind, int64_t nth, int64_t arg) {
    if (!kind || nth < 1) return -1;
    for (int k = 0; k < SIM_FAULT__N; k++) {
        if (strcmp(kind, FAULT_NAMES[k]) == 0) {
            lock();
            g_faults[k].countdown = nth;
            g_faults[k].arg = arg;
            unlock();
            return 0;
        }
    }
    return -1;
}

SIM_EXPORT void moegradSimClearFaults(void) {
    lock();
    for (int k = 0; k < SIM_FAULT__N; k++) g_faults[k].countdown = 0;
    unlock();
}

SIM_EXPORT int64_t moegradSimReleaseHung(void) {
    int64_t released = 0;
    lock();
    for (Stream *s = g_streams; s; s = s->next)
        for (SimJob *job = s->head; job; job = job->next)
            if (job->hung) {
                job->hang_until_ms = 0;
                released++;
            }
    pthread_cond_broadcast(&g_cond);
    unlock();
    return released;
}

SIM_EXPORT int32_t moegradSimHasContext(void) {
    lock();
    int has = has_context_locked();
    unlock();
    return has;
}
