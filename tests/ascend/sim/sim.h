/*
 * moegrad's CANN simulator: internal interface shared by the three simulated libraries.
 *
 *   libascendcl.so   runtime (aclInit, aclrt*, aclGetRecentErrMsg, aclsysGetVersionStr), "device"
 *                    memory on the host, streams, per-thread device context, fault injection,
 *                    live-resource counters
 *   libnnopbase.so   aclCreateTensor / aclDestroyTensor / aclDestroyAclOpExecutor, the registries
 *                    of live tensors and executors
 *   libopapi*.so     aclnnMoeInitRoutingV2GradGetWorkspaceSize / aclnnMoeInitRoutingV2Grad
 *
 * The public symbols follow CANN's documented C ABI (acl/acl_rt.h, acl/acl_base.h,
 * aclnn/acl_meta.h, aclnnop/aclnn_moe_init_routing_v2_grad.h): aclError and aclnnStatus are
 * int32_t, every enum is a C int, handles are opaque pointers. Everything named moegradSim* is
 * the simulator's own and does not exist in CANN.
 */
#ifndef MOEGRAD_SIM_H
#define MOEGRAD_SIM_H

#include <stddef.h>
#include <stdint.h>

#define SIM_EXPORT __attribute__((visibility("default")))
#define SIM_MAX_DIMS 8

/* aclError codes (acl/acl_base.h, acl/error_codes/rt_error_codes.h). */
enum {
    SIM_ACL_SUCCESS = 0,
    SIM_ACL_ERROR_INVALID_PARAM = 100000,
    SIM_ACL_ERROR_UNINITIALIZE = 100001,
    SIM_ACL_ERROR_REPEAT_INITIALIZE = 100002,
    SIM_ACL_ERROR_INVALID_FILE = 100003,
    SIM_ACL_ERROR_REPEAT_FINALIZE = 100037,
    SIM_RT_PARAM_INVALID = 107000,
    SIM_RT_INVALID_DEVICEID = 107001,
    SIM_RT_CONTEXT_NULL = 107002,
    SIM_RT_STREAM_CONTEXT = 107003,
    SIM_RT_MEMORY_ALLOCATION = 207001,
    SIM_RT_MEMORY_FREE = 207002,
    SIM_RT_INTERNAL_ERROR = 507000,
    SIM_RT_STREAM_NOT_COMPLETE = 507004,
    SIM_RT_AICORE_EXCEPTION = 507015,
    SIM_RT_STREAM_SYNC_TIMEOUT = 507046,
    SIM_RT_DRV_INTERNAL_ERROR = 507899,
    SIM_ACL_ERROR_INTERNAL_ERROR = 500000,
};

/* ACL_PKG_VERSION_MAX_SIZE (acl/acl_rt.h): aclsysGetVersionStr's output buffer, NUL included. */
#define SIM_PKG_VERSION_MAX_SIZE 128

/* aclnnStatus codes (aclnn/acl_meta.h). */
enum {
    SIM_ACLNN_SUCCESS = 0,
    SIM_ACLNN_ERR_PARAM_NULLPTR = 161001,
    SIM_ACLNN_ERR_PARAM_INVALID = 161002,
    SIM_ACLNN_ERR_RUNTIME_ERROR = 361001,
    SIM_ACLNN_ERR_INNER_TILING_ERROR = 561002,
    SIM_ACLNN_ERR_INNER_FIND_KERNEL_ERROR = 561003,
    SIM_ACLNN_ERR_INNER_NULLPTR = 561103,
    SIM_ACLNN_ERR_INNER_OPP_PATH_NOT_FOUND = 561107,
};

/* aclDataType values (acl/acl_base.h). */
enum { SIM_ACL_FLOAT = 0, SIM_ACL_FLOAT16 = 1, SIM_ACL_INT32 = 3, SIM_ACL_BF16 = 27 };

/* Indices of moegradSimCounts' output (mirrored in tests/ascend/conftest.py). */
enum {
    SIM_COUNT_ALLOCATIONS = 0,    /* live aclrtMalloc blocks */
    SIM_COUNT_ALLOCATED_BYTES,    /* their requested sizes, summed */
    SIM_COUNT_TENSORS,            /* live aclTensor handles */
    SIM_COUNT_EXECUTORS,          /* live (not yet launched, not destroyed) executors */
    SIM_COUNT_STREAMS,            /* live streams */
    SIM_COUNT_PENDING,            /* launched kernels not yet complete (hung ones) */
    SIM_COUNT_DEVICE_REFS,        /* aclrtSetDevice calls not yet balanced by aclrtResetDevice */
    SIM_COUNT_INITIALIZED,        /* 1 between aclInit and aclFinalize */
    SIM_COUNT_VIOLATIONS,         /* misuse detected: busy memory freed, busy stream destroyed, ... */
    SIM_COUNT_RECLAIMED,          /* resources a device reset / finalize had to release itself */
    SIM_COUNT_MALLOCS,            /* aclrtMalloc calls that succeeded, ever */
    SIM_COUNT_LAUNCHES,           /* kernels launched (phase two succeeded), ever */
    SIM_COUNT_SYNCS,              /* aclrtSynchronizeStreamWithTimeout calls, ever */
    SIM_COUNT_CONTEXT_ERRORS,     /* calls refused with 107002 (no aclrtSetDevice on the thread) */
    SIM_COUNT_STREAMS_CREATED,    /* aclrtCreateStream calls that succeeded, ever */
    SIM_COUNT_PHASE_ONE,          /* GetWorkspaceSize calls, ever */
    SIM_COUNT_QUERIES,            /* aclrtStreamQuery calls, ever */
    SIM_COUNT_FORCED,             /* streams destroyed with aclrtDestroyStreamForce, ever */
    SIM_COUNT_BLOCKED,            /* calls that would have blocked forever on a hung kernel (cut short) */
    SIM_COUNT_ACL_REFS,           /* aclInit references (aclFinalizeReference releases one) */
    SIM_COUNT__N
};

/* Fault kinds (moegradSimInjectFault / MOEGRAD_SIM_FAULTS). */
enum {
    SIM_FAULT_MALLOC = 0, /* the Nth aclrtMalloc fails with 207001 */
    SIM_FAULT_MEMCPY,     /* the Nth aclrtMemcpy fails with 507000 */
    SIM_FAULT_LAUNCH,     /* the Nth phase two fails with 361001 */
    SIM_FAULT_SYNC,       /* the Nth stream sync reports an AI Core exception, 507015 */
    SIM_FAULT_HANG,       /* the Nth launched kernel hangs for `arg` ms (-1: until released) */
    SIM_FAULT_HEALTH,     /* the Nth aclrtGetMemInfo fails with 507899 */
    SIM_FAULT_TILING,     /* the Nth phase one that passes every check fails its tiling with 561002 */
    SIM_FAULT_KERNEL,     /* the Nth phase one that passes every check finds no kernel binary, 561003 */
    SIM_FAULT__N
};

/* One device memory range a kernel reads or writes. */
typedef struct {
    const void *ptr;
    uint64_t bytes;
} SimRange;

/* A launched kernel: the runtime runs `run(ctx)` when the kernel completes, then `release(ctx)`. */
typedef struct SimJob {
    void (*run)(void *ctx);
    void (*release)(void *ctx);
    void *ctx;
    SimRange ranges[4];
    int nranges;
    int hung;             /* 1 while the kernel "hangs" */
    int64_t hang_until_ms; /* monotonic ms when the hang ends; -1 = until moegradSimReleaseHung */
    struct SimJob *next;
} SimJob;

/* A tensor as aclCreateTensor recorded it (strides and offset in elements). */
typedef struct SimTensor {
    uint64_t magic;
    int32_t dtype;
    int32_t format;
    int64_t ndim;
    int64_t dims[SIM_MAX_DIMS];
    int64_t strides[SIM_MAX_DIMS];
    int64_t offset;
    int64_t storage_ndim;
    int64_t storage_dims[SIM_MAX_DIMS];
    void *data;
    struct SimTensor *next;
} SimTensor;

/* An executor: a snapshot of the validated call, made by phase one, consumed by phase two. */
typedef struct SimExecutor {
    uint64_t magic;
    SimTensor grad, idx, out; /* copies, so destroying the tensors after launch is fine */
    int64_t top_k, drop_pad_mode, active_num;
    uint64_t workspace_size;
    int empty;           /* 1: the output has no elements, phase two launches nothing */
    int order_950;       /* 1: the SoC is an Ascend 950, the kernel adds in its order */
    int chain_950;       /* 1: ... in the 8.5 order (a plain chain), not in groups of four */
    int defines_invalid; /* 1: 950 from 9.1: negative and dropless >= N*K slots are +0.0 rows */
    struct SimExecutor *next;
} SimExecutor;

/* libascendcl internals used by the other two libraries. */
SIM_EXPORT void moegradSimSetError(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
SIM_EXPORT void moegradSimTrack(int counter, int64_t delta);
SIM_EXPORT int moegradSimFaultFires(int kind, int64_t *arg, int64_t *serial);
SIM_EXPORT int moegradSimCheckContext(const char *api);
SIM_EXPORT int moegradSimRangeLive(const void *ptr, uint64_t bytes);
SIM_EXPORT int moegradSimEnqueue(void *stream, SimJob *job);

/* libnnopbase internals used by libopapi. */
SIM_EXPORT int moegradSimTensorLive(const void *tensor);
SIM_EXPORT SimExecutor *moegradSimExecutorCreate(void);
SIM_EXPORT int moegradSimExecutorConsume(void *executor);
SIM_EXPORT int64_t moegradSimElementSize(int32_t dtype);

#endif
