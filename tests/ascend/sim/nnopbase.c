/*
 * libnnopbase.so of moegrad's CANN simulator: aclTensor and aclOpExecutor handles
 * (aclnn/acl_meta.h). Handles are host objects; every live one is registered so a test can count
 * them and so a stale or foreign handle is refused instead of dereferenced.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "sim.h"

#define TENSOR_MAGIC 0x54454e534f525f31ULL   /* "TENSOR_1" */
#define EXECUTOR_MAGIC 0x455845435554455aULL /* "EXECUTEZ" */

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static SimTensor *g_tensors;
static SimExecutor *g_executors;

SIM_EXPORT int64_t moegradSimElementSize(int32_t dtype) {
    switch (dtype) {
    case SIM_ACL_FLOAT: case SIM_ACL_INT32: return 4;
    case SIM_ACL_FLOAT16: case SIM_ACL_BF16: return 2;
    case 2: case 4: case 12: return 1;       /* ACL_INT8, ACL_UINT8, ACL_BOOL */
    case 6: case 7: return 2;                /* ACL_INT16, ACL_UINT16 */
    case 8: return 4;                        /* ACL_UINT32 */
    case 9: case 10: case 11: return 8;      /* ACL_INT64, ACL_UINT64, ACL_DOUBLE */
    default: return 0;
    }
}

SIM_EXPORT void *aclCreateTensor(const int64_t *viewDims, uint64_t viewDimsNum, int32_t dataType,
                                 const int64_t *stride, int64_t offset, int32_t format, const int64_t *storageDims,
                                 uint64_t storageDimsNum, void *tensorData) {
    if (viewDimsNum > SIM_MAX_DIMS || storageDimsNum > SIM_MAX_DIMS || (viewDimsNum && !viewDims) ||
        (storageDimsNum && !storageDims)) {
        moegradSimSetError("EZ1001: [moegrad-sim] aclCreateTensor: invalid dims (%llu view, %llu storage)",
                           (unsigned long long)viewDimsNum, (unsigned long long)storageDimsNum);
        return NULL;
    }
    SimTensor *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->magic = TENSOR_MAGIC;
    t->dtype = dataType;
    t->format = format;
    t->ndim = (int64_t)viewDimsNum;
    t->offset = offset;
    t->data = tensorData;
    int64_t running = 1;
    for (int64_t d = t->ndim - 1; d >= 0; d--) {
        t->dims[d] = viewDims[d];
        t->strides[d] = stride ? stride[d] : running; /* no strides: contiguous */
        running *= viewDims[d];
    }
    t->storage_ndim = storageDims ? (int64_t)storageDimsNum : t->ndim;
    for (int64_t d = 0; d < t->storage_ndim; d++) t->storage_dims[d] = storageDims ? storageDims[d] : t->dims[d];
    pthread_mutex_lock(&g_lock);
    t->next = g_tensors;
    g_tensors = t;
    pthread_mutex_unlock(&g_lock);
    moegradSimTrack(SIM_COUNT_TENSORS, +1);
    return t;
}

SIM_EXPORT int32_t aclDestroyTensor(const void *tensor) {
    if (!tensor) return SIM_ACLNN_SUCCESS;
    pthread_mutex_lock(&g_lock);
    SimTensor **tp = &g_tensors;
    while (*tp && *tp != tensor) tp = &(*tp)->next;
    SimTensor *t = *tp;
    if (t) *tp = t->next;
    pthread_mutex_unlock(&g_lock);
    if (!t) {
        moegradSimTrack(SIM_COUNT_VIOLATIONS, +1);
        moegradSimSetError("EZ1002: [moegrad-sim] aclDestroyTensor: %p is not a live aclTensor", tensor);
        return SIM_ACLNN_ERR_PARAM_INVALID;
    }
    t->magic = 0;
    free(t);
    moegradSimTrack(SIM_COUNT_TENSORS, -1);
    return SIM_ACLNN_SUCCESS;
}

SIM_EXPORT int moegradSimTensorLive(const void *tensor) {
    int live = 0;
    pthread_mutex_lock(&g_lock);
    for (SimTensor *t = g_tensors; t && !live; t = t->next) live = t == tensor && t->magic == TENSOR_MAGIC;
    pthread_mutex_unlock(&g_lock);
    return live;
}

SIM_EXPORT SimExecutor *moegradSimExecutorCreate(void) {
    SimExecutor *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->magic = EXECUTOR_MAGIC;
    pthread_mutex_lock(&g_lock);
    e->next = g_executors;
    g_executors = e;
    pthread_mutex_unlock(&g_lock);
    moegradSimTrack(SIM_COUNT_EXECUTORS, +1);
    return e;
}

/* Take a live executor out of the registry (it can run, or be destroyed, exactly once). */
SIM_EXPORT int moegradSimExecutorConsume(void *executor) {
    pthread_mutex_lock(&g_lock);
    SimExecutor **ep = &g_executors;
    while (*ep && *ep != executor) ep = &(*ep)->next;
    SimExecutor *e = *ep;
    if (e) *ep = e->next;
    pthread_mutex_unlock(&g_lock);
    if (!e) return -1;
    e->magic = 0;
    e->next = NULL;
    moegradSimTrack(SIM_COUNT_EXECUTORS, -1);
    return 0;
}

SIM_EXPORT int32_t aclDestroyAclOpExecutor(void *executor) {
    if (!executor) {
        moegradSimSetError("EZ1003: [moegrad-sim] aclDestroyAclOpExecutor: executor is nullptr");
        return SIM_ACLNN_ERR_INNER_NULLPTR;
    }
    if (moegradSimExecutorConsume(executor) != 0) {
        moegradSimTrack(SIM_COUNT_VIOLATIONS, +1);
        moegradSimSetError("EZ1004: [moegrad-sim] aclDestroyAclOpExecutor: %p is not a live executor "
                           "(it already ran or was destroyed)", executor);
        return SIM_ACLNN_ERR_PARAM_INVALID;
    }
    free(executor);
    return SIM_ACLNN_SUCCESS;
}
