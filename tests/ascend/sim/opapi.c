/*
 * The operator of moegrad's CANN simulator (libopapi_transformer.so, or libopapi.so for the
 * older single-library layout): aclnnMoeInitRoutingV2GradGetWorkspaceSize and
 * aclnnMoeInitRoutingV2Grad with the prototypes of aclnnop/aclnn_moe_init_routing_v2_grad.h.
 *
 * The release. The operator behaves as the CANN release of its package: the Version= of
 * <home>/share/info/ops_transformer/version.info, <home> being two folders above this library's
 * file (<home>/lib64/libopapi_transformer.so, links resolved), read at each phase one; MOEGRAD_SIM_RELEASE, when set,
 * stands for that file (a library loaded once per process cannot be reinstalled between tests; an
 * empty value is an unreadable release). An unreadable release behaves as 9.0.
 *
 * Phase one applies the operator's documented host checks in this order: 161001 null, 161002
 * dtype, then the attribute / rank / size / divisibility checks, answered 561002 before 9.1 and
 * 561103 ACLNN_ERR_INNER_NULLPTR from 9.1 (the 9.1 docs; the tiling runs in an l0 layer whose
 * failure the API reports as a null result). From 9.1 the dtype checks skip a tensor with no
 * elements, and an empty output (N = 0 or H = 0) succeeds with no workspace and no attribute check,
 * and phase two launches nothing; before 9.1 an empty output is refused with 561002, as the 8.x
 * tiling's positive-dimension checks do. It makes a single-use executor. Unlike a real device it
 * also reads expandedRowIdx and rejects an index the kernel would read outside gradExpandedX with
 * (an undefined read on a device): outside [-1, E*C) in drop/pad mode and outside [0, N*K)
 * otherwise; on the 950 from 9.1, whose kernel gives a +0.0 row for any negative index, for a
 * dropless index >= N*K and for an active-mode index >= A, only a drop/pad index >= E*C. Duplicated
 * indices are accepted, as on the device: the kernel is a gather, a repeated row is simply read
 * twice (moegrad's Python validation rejects them unless allow_duplicate_indices).
 *
 * Installation faults answer as opbase's do: phase one fails with 561107 when ASCEND_OPP_PATH is
 * unset (opbase reads it to find the kernels) and with 561003 for an injected "kernel" fault (no
 * kernel binary). The workspace is the fixed 16 MiB the operator's tiling reserves.
 *
 * Phase two queues the kernel on the stream. The kernel is the Atlas A2/A3 arithmetic of
 * docs/semantics.md section 3: rows widened exactly to float, float adds in the bin order, one
 * round-half-to-even conversion to the output dtype. When the runtime reports an Ascend950* SoC
 * (aclrtGetSocName; MOEGRAD_SIM_SOC_NAME chooses it), the kernel adds in the 950 order instead, as
 * it stands when the whole K fits in one chunk: a float accumulator from +0.0, groups of four rows
 * added as s += ((x0 + x1) + (x2 + x3)) (from 9.0; before, one row at a time, s += x), the leftover
 * rows as s += x, an invalid slot's row taken as +0.0 (never -0.0) and added in its place, one
 * rounding to the output dtype.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <libgen.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim.h"

/* libascendcl.so (acl/acl_base.h): the SoC the process runs on. */
const char *aclrtGetSocName(void);

/* ---- the release ------------------------------------------------------------------------------ */

/* "9.1.0" -> 901 (major * 100 + minor); 0 when it is not "<major>.<minor>...". */
static int parse_release(const char *version) {
    int major = 0, minor = 0;
    if (!version || sscanf(version, "%d.%d", &major, &minor) != 2 || major < 0 || minor < 0 || minor > 99) return 0;
    return major * 100 + minor;
}

/* The release this operator package behaves as (see the file comment): 901 for 9.1, 0 unreadable. */
static int package_release(void) {
    const char *forced = getenv("MOEGRAD_SIM_RELEASE");
    if (forced) return parse_release(forced);
    Dl_info info;
    if (!dladdr((void *)package_release, &info) || !info.dli_fname) return 0;
    char path[PATH_MAX]; /* the file itself: the name it was first loaded by may run through a link */
    if (!realpath(info.dli_fname, path)) return 0;
    char *home = dirname(dirname(path));
    char file[PATH_MAX + 64];
    snprintf(file, sizeof file, "%s/share/info/ops_transformer/version.info", home);
    FILE *f = fopen(file, "r");
    if (!f) return 0;
    char line[512];
    int release = 0;
    while (fgets(line, sizeof line, f)) {
        char *at = strstr(line, "Version=");
        if (at) {
            release = parse_release(at + strlen("Version="));
            break;
        }
    }
    fclose(f);
    return release;
}

#define NAME1 "aclnnMoeInitRoutingV2GradGetWorkspaceSize"
#define NAME2 "aclnnMoeInitRoutingV2Grad"

/* ---- exact conversions ------------------------------------------------------------------------ */

static float bits_to_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint32_t float_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13)); /* inf, NaN */
    if (exp != 0) return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
    if (man == 0) return bits_to_float(sign);
    int shifts = 0; /* subnormal half: normalise (exact, float has the range) */
    while (!(man & 0x400u)) {
        man <<= 1;
        shifts++;
    }
    return bits_to_float(sign | ((uint32_t)(113 - shifts) << 23) | ((man & 0x3ffu) << 13));
}

/* m >> s rounded to nearest, ties to even (s >= 1). */
static uint32_t shift_round_even(uint32_t m, int s) {
    if (s >= 32) return 0;
    uint32_t q = m >> s, rem = m & ((1u << s) - 1), half = 1u << (s - 1);
    return q + (rem > half || (rem == half && (q & 1u)));
}

static uint16_t float_to_half(float f) {
    uint32_t u = float_to_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t exp = (u >> 23) & 0xffu, man = u & 0x7fffffu;
    if (exp == 0xff) return man ? (uint16_t)(sign | 0x7e00u | (man >> 13)) : (uint16_t)(sign | 0x7c00u);
    int e = (int)exp - 112; /* the half exponent field */
    if (e >= 31) return (uint16_t)(sign | 0x7c00u);
    uint32_t m = exp ? (man | 0x800000u) : man;
    if (e >= 1) /* a carry out of the mantissa correctly bumps the exponent (to inf at the top) */
        return (uint16_t)(sign | (((uint32_t)e << 10) + shift_round_even(m, 13) - 0x400u));
    return (uint16_t)(sign | shift_round_even(m, 14 - e)); /* subnormal or zero */
}

static float bf16_to_float(uint16_t b) { return bits_to_float((uint32_t)b << 16); }

static uint16_t float_to_bf16(float f) {
    uint32_t u = float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* ---- tensor access ------------------------------------------------------------------------------ */

static float load(const SimTensor *t, int64_t element) {
    const char *base = t->data;
    switch (t->dtype) {
    case SIM_ACL_FLOAT16: { uint16_t h; memcpy(&h, base + element * 2, 2); return half_to_float(h); }
    case SIM_ACL_BF16: { uint16_t b; memcpy(&b, base + element * 2, 2); return bf16_to_float(b); }
    default: { float f; memcpy(&f, base + element * 4, 4); return f; }
    }
}

static void store(const SimTensor *t, int64_t element, float value) {
    char *base = t->data;
    switch (t->dtype) {
    case SIM_ACL_FLOAT16: { uint16_t h = float_to_half(value); memcpy(base + element * 2, &h, 2); break; }
    case SIM_ACL_BF16: { uint16_t b = float_to_bf16(value); memcpy(base + element * 2, &b, 2); break; }
    default: memcpy(base + element * 4, &value, 4);
    }
}

static int32_t index_at(const SimTensor *idx, int64_t slot) {
    int32_t v;
    memcpy(&v, (const char *)idx->data + (idx->offset + slot * idx->strides[0]) * 4, 4);
    return v;
}

/* Storage size in bytes, after checking that the view lies inside the storage (0: it does not). */
static uint64_t storage_bytes(const SimTensor *t) {
    int64_t item = moegradSimElementSize(t->dtype), elements = 1, last = t->offset;
    for (int64_t d = 0; d < t->storage_ndim; d++) elements *= t->storage_dims[d];
    if (item == 0 || t->offset < 0) return 0;
    for (int64_t d = 0; d < t->ndim; d++) {
        if (t->dims[d] == 0) return (uint64_t)(elements * item);
        if (t->strides[d] < 0) return 0;
        last += (t->dims[d] - 1) * t->strides[d];
    }
    return last < elements ? (uint64_t)(elements * item) : 0;
}

/* ---- the kernel --------------------------------------------------------------------------------- */

static int64_t bins_for(int64_t k) {
    if (k >= 128) return 64;
    int log2k = 63 - __builtin_clzll((unsigned long long)k);
    return (int64_t)1 << (log2k >= 1 ? log2k - 1 : 0);
}

/* The Ascend 950 order with K in one chunk (see the file comment). */
static void kernel_950(const SimExecutor *e) {
    const SimTensor *g = &e->grad, *ix = &e->idx, *o = &e->out;
    int64_t k = e->top_k, n = o->dims[0], h_size = o->dims[1], slots = n * k;
    int mode = (int)e->drop_pad_mode;
    int64_t active = e->active_num, capacity = mode == 1 ? g->dims[1] : 1;
    for (int64_t i = 0; i < n; i++) {
        for (int64_t h = 0; h < h_size; h++) {
            float s = 0.0f, x[4];
            int64_t t = 0;
            while (t < k) {
                int64_t take = k - t >= 4 && !e->chain_950 ? 4 : 1;
                for (int64_t j = 0; j < take; j++) {
                    int32_t row = index_at(ix, i * k + t + j);
                    int invalid = mode == 1 ? row < 0 : (active > 0 && row >= active);
                    if (e->defines_invalid) /* 9.1: any negative, and a dropless index >= N*K */
                        invalid = invalid || row < 0 || (mode == 0 && active == 0 && row >= slots);
                    x[j] = 0.0f; /* an invalid slot is a +0.0 row */
                    if (!invalid) {
                        int64_t at = mode == 1 ? g->offset + (row / capacity) * g->strides[0] +
                                                     (row % capacity) * g->strides[1] + h * g->strides[2]
                                               : g->offset + row * g->strides[0] + h * g->strides[1];
                        x[j] = load(g, at);
                    }
                }
                s += take == 4 ? (x[0] + x[1]) + (x[2] + x[3]) : x[0];
                t += take;
            }
            store(o, o->offset + i * o->strides[0] + h * o->strides[1], s);
        }
    }
}

static void kernel(void *ctx) {
    const SimExecutor *e = ctx;
    if (e->order_950) {
        kernel_950(e);
        return;
    }
    const SimTensor *g = &e->grad, *ix = &e->idx, *o = &e->out;
    int64_t k = e->top_k, n = o->dims[0], h_size = o->dims[1], bins = bins_for(k);
    int mode = (int)e->drop_pad_mode;
    int64_t active = e->active_num, capacity = mode == 1 ? g->dims[1] : 1;
    float bin[64];
    for (int64_t i = 0; i < n; i++) {
        for (int64_t h = 0; h < h_size; h++) {
#define SLOT(t, skipped, value)                                                                              \
    do {                                                                                                     \
        int32_t row = index_at(ix, i * k + (t));                                                             \
        skipped = mode == 1 ? row < 0 : (active > 0 && row >= active);                                       \
        if (!skipped) {                                                                                      \
            int64_t at = mode == 1 ? g->offset + (row / capacity) * g->strides[0] +                          \
                                         (row % capacity) * g->strides[1] + h * g->strides[2]                \
                                   : g->offset + row * g->strides[0] + h * g->strides[1];                    \
            value = load(g, at);                                                                             \
        }                                                                                                    \
    } while (0)
            int skipped;
            float v = 0.0f;
            for (int64_t b = 0; b < bins; b++) { /* S1: assignment; a skipped slot is +0.0 */
                SLOT(2 * b, skipped, v);
                bin[b] = skipped ? 0.0f : v;
            }
            for (int64_t t = 2 * bins; t < k; t += 2) { /* S2: the remaining even slots */
                SLOT(t, skipped, v);
                if (!skipped) bin[(t / 2) % bins] += v;
            }
            for (int64_t t = 1; t < k; t += 2) { /* S3: the odd slots */
                SLOT(t, skipped, v);
                if (!skipped) bin[((t - 1) / 2) % bins] += v;
            }
            for (int64_t s = 1; s < bins; s *= 2) /* S4: pairwise tree into bin 0 */
                for (int64_t j = s; j < bins; j += 2 * s) bin[j - s] += bin[j];
#undef SLOT
            store(o, o->offset + i * o->strides[0] + h * o->strides[1], bin[0]);
        }
    }
}

static void release_executor(void *ctx) { free(ctx); }

/* ---- phase one ---------------------------------------------------------------------------------- */

static int32_t reject(int32_t status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int32_t reject(int32_t status, const char *fmt, ...) {
    char message[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    moegradSimSetError("EZ1001: [moegrad-sim] " NAME1 ": %s", message);
    return status;
}

static int is_grad_dtype(int32_t dtype) {
    return dtype == SIM_ACL_FLOAT || dtype == SIM_ACL_FLOAT16 || dtype == SIM_ACL_BF16;
}

static int64_t elements(const SimTensor *t) {
    int64_t n = 1;
    for (int64_t d = 0; d < t->ndim; d++) n *= t->dims[d];
    return n;
}

SIM_EXPORT int32_t aclnnMoeInitRoutingV2GradGetWorkspaceSize(const void *gradExpandedX, const void *expandedRowIdx,
                                                             int64_t topK, int64_t dropPadMode, int64_t activeNum,
                                                             const void *out, uint64_t *workspaceSize,
                                                             void **executor) {
    moegradSimTrack(SIM_COUNT_PHASE_ONE, +1);
    int release = package_release();
    int edge_91 = release >= 901; /* the 9.1 API edge: no chip branch */
    int32_t shape_error = edge_91 ? SIM_ACLNN_ERR_INNER_NULLPTR : SIM_ACLNN_ERR_INNER_TILING_ERROR;
    const void *handles[3] = {gradExpandedX, expandedRowIdx, out};
    const char *names[3] = {"gradExpandedX", "expandedRowIdx", "out"};
    /* 161001: null pointers */
    for (int i = 0; i < 3; i++)
        if (!handles[i]) return reject(SIM_ACLNN_ERR_PARAM_NULLPTR, "%s is nullptr", names[i]);
    if (!workspaceSize) return reject(SIM_ACLNN_ERR_PARAM_NULLPTR, "workspaceSize is nullptr");
    if (!executor) return reject(SIM_ACLNN_ERR_PARAM_NULLPTR, "executor is nullptr");
    for (int i = 0; i < 3; i++) {
        if (!moegradSimTensorLive(handles[i])) {
            moegradSimTrack(SIM_COUNT_VIOLATIONS, +1);
            return reject(SIM_ACLNN_ERR_PARAM_INVALID, "%s is not a live aclTensor", names[i]);
        }
    }
    const SimTensor *g = gradExpandedX, *ix = expandedRowIdx, *o = out;
    /* 161002: dtypes (from 9.1 not of a tensor with no elements) */
    if (!(edge_91 && elements(g) == 0) && !is_grad_dtype(g->dtype))
        return reject(SIM_ACLNN_ERR_PARAM_INVALID, "gradExpandedX dtype %d is not FLOAT, FLOAT16 or BFLOAT16",
                      (int)g->dtype);
    if (!(edge_91 && elements(ix) == 0) && ix->dtype != SIM_ACL_INT32)
        return reject(SIM_ACLNN_ERR_PARAM_INVALID, "expandedRowIdx dtype %d is not INT32", (int)ix->dtype);
    if (!(edge_91 && elements(o) == 0) && o->dtype != g->dtype)
        return reject(SIM_ACLNN_ERR_PARAM_INVALID, "out dtype %d differs from gradExpandedX dtype %d", (int)o->dtype,
                      (int)g->dtype);
    if (edge_91 && elements(o) == 0) { /* 9.1: an empty output, no launch and no attribute check */
        SimExecutor *e = moegradSimExecutorCreate();
        if (!e) return reject(SIM_ACLNN_ERR_INNER_NULLPTR, "out of host memory for the executor");
        e->empty = 1;
        *workspaceSize = 0;
        *executor = e;
        return SIM_ACLNN_SUCCESS;
    }
    /* 561002 (561103 from 9.1): attributes */
    if (dropPadMode != 0 && dropPadMode != 1)
        return reject(shape_error, "dropPadMode=%lld must be 0 or 1", (long long)dropPadMode);
    if (topK <= 0) return reject(shape_error, "topK=%lld must be > 0", (long long)topK);
    if (activeNum < 0) return reject(shape_error, "activeNum=%lld must be >= 0", (long long)activeNum);
    /* 561002 (561103 from 9.1): ranks, sizes, divisibility */
    int64_t want_rank = dropPadMode == 1 ? 3 : 2;
    if (g->ndim != want_rank)
        return reject(shape_error, "gradExpandedX has rank %lld, expected %lld", (long long)g->ndim,
                      (long long)want_rank);
    if (ix->ndim != 1) return reject(shape_error, "expandedRowIdx has rank %lld, expected 1", (long long)ix->ndim);
    if (o->ndim != 2) return reject(shape_error, "out has rank %lld, expected 2", (long long)o->ndim);
    long long slots = ix->dims[0], hidden = g->dims[g->ndim - 1];
    if (dropPadMode == 0 && activeNum == 0 && g->dims[0] != slots)
        return reject(shape_error, "gradExpandedX dim 0 is %lld, expandedRowIdx has %lld (dropless)",
                      (long long)g->dims[0], slots);
    if (dropPadMode == 0 && activeNum > 0 && g->dims[0] != activeNum)
        return reject(shape_error, "gradExpandedX dim 0 is %lld, activeNum is %lld", (long long)g->dims[0],
                      (long long)activeNum);
    if (slots % topK != 0)
        return reject(shape_error, "expandedRowIdx has %lld slots, not a multiple of topK=%lld", slots,
                      (long long)topK);
    if (o->dims[1] != hidden)
        return reject(shape_error, "out last dim is %lld, gradExpandedX's is %lld", (long long)o->dims[1], hidden);
    if (o->dims[0] != slots / topK)
        return reject(shape_error, "out dim 0 is %lld, expected %lld", (long long)o->dims[0], slots / (long long)topK);
    const char *opp = getenv("ASCEND_OPP_PATH");
    if (!opp || !*opp) /* opbase finds the kernels through it */
        return reject(SIM_ACLNN_ERR_INNER_OPP_PATH_NOT_FOUND, "the environment variable ASCEND_OPP_PATH is not set");
    if (slots == 0 || hidden == 0) /* before 9.1: the tiling checks every dimension is positive */
        return reject(SIM_ACLNN_ERR_INNER_TILING_ERROR, "empty tensors are not supported (N*K=%lld, H=%lld)", slots,
                      hidden);
    for (int i = 0; i < 3; i++)
        if (storage_bytes(handles[i]) == 0)
            return reject(SIM_ACLNN_ERR_PARAM_INVALID, "%s: the view does not fit its storage", names[i]);
    /* 161002: index values (the simulator reads them; a real phase one cannot) */
    if (!moegradSimRangeLive(ix->data, storage_bytes(ix)))
        return reject(SIM_ACLNN_ERR_PARAM_INVALID, "expandedRowIdx data %p is not live device memory", ix->data);
    const char *soc = aclrtGetSocName();
    int is_950 = soc != NULL && strncmp(soc, "Ascend950", 9) == 0;
    int defines_invalid = is_950 && edge_91; /* the 950 kernel from 9.1 */
    long long low = dropPadMode == 1 ? -1 : 0;
    long long high = dropPadMode == 1 ? (long long)(g->dims[0] * g->dims[1]) : slots;
    if (defines_invalid) { /* any negative; dropless and active indices of any size */
        low = INT32_MIN;
        if (dropPadMode == 0) high = (long long)INT32_MAX + 1;
    }
    for (long long s = 0; s < slots; s++) {
        int32_t v = index_at(ix, s);
        if (v < low || v >= high)
            return reject(SIM_ACLNN_ERR_PARAM_INVALID, "expandedRowIdx[%lld]=%d is outside [%lld, %lld)", s, (int)v,
                          low, high);
    }
    int64_t serial = 0;
    if (moegradSimFaultFires(SIM_FAULT_TILING, NULL, &serial))
        return reject(shape_error, "injected tiling failure (phase one #%lld)", (long long)serial);
    if (moegradSimFaultFires(SIM_FAULT_KERNEL, NULL, &serial))
        return reject(SIM_ACLNN_ERR_INNER_FIND_KERNEL_ERROR,
                      "injected missing kernel: no binary of MoeInitRoutingV2Grad for this SoC under ASCEND_OPP_PATH "
                      "(phase one #%lld)", (long long)serial);
    SimExecutor *e = moegradSimExecutorCreate();
    if (!e) return reject(SIM_ACLNN_ERR_INNER_NULLPTR, "out of host memory for the executor");
    e->grad = *g;
    e->idx = *ix;
    e->out = *o;
    e->grad.next = e->idx.next = e->out.next = NULL;
    e->top_k = topK;
    e->drop_pad_mode = dropPadMode;
    e->active_num = activeNum;
    e->order_950 = is_950;
    e->chain_950 = is_950 && release != 0 && release < 900; /* 8.5: the plain chain */
    e->defines_invalid = defines_invalid;
    e->workspace_size = 16u << 20; /* the tiling's fixed reservation: 16 MiB */
    *workspaceSize = e->workspace_size;
    *executor = e;
    return SIM_ACLNN_SUCCESS;
}

/* ---- phase two ---------------------------------------------------------------------------------- */

SIM_EXPORT int32_t aclnnMoeInitRoutingV2Grad(void *workspace, uint64_t workspaceSize, void *executor, void *stream) {
    if (!executor) {
        moegradSimSetError("EZ1001: [moegrad-sim] " NAME2 ": executor is nullptr");
        return SIM_ACLNN_ERR_PARAM_NULLPTR;
    }
    if (moegradSimExecutorConsume(executor) != 0) {
        moegradSimTrack(SIM_COUNT_VIOLATIONS, +1);
        moegradSimSetError("EZ1005: [moegrad-sim] " NAME2 ": executor %p is not live (an executor runs once)",
                           executor);
        return SIM_ACLNN_ERR_PARAM_INVALID;
    }
    SimExecutor *e = executor; /* ours now: freed here on failure, by the runtime after the kernel otherwise */
    if (e->empty) { /* nothing to compute: no kernel is launched */
        free(e);
        return SIM_ACLNN_SUCCESS;
    }
    int32_t rc = moegradSimCheckContext(NAME2);
    if (rc != SIM_ACLNN_SUCCESS) {
        free(e);
        return SIM_ACLNN_ERR_RUNTIME_ERROR;
    }
    if (e->workspace_size > 0 && (!workspace || workspaceSize < e->workspace_size)) {
        moegradSimSetError("EZ1001: [moegrad-sim] " NAME2 ": workspace %p of %llu bytes, %llu required", workspace,
                           (unsigned long long)workspaceSize, (unsigned long long)e->workspace_size);
        free(e);
        return SIM_ACLNN_ERR_PARAM_INVALID;
    }
    int64_t serial = 0;
    if (moegradSimFaultFires(SIM_FAULT_LAUNCH, NULL, &serial)) {
        moegradSimSetError("EZ9999: [moegrad-sim] injected kernel launch failure (launch #%lld)", (long long)serial);
        free(e);
        return SIM_ACLNN_ERR_RUNTIME_ERROR;
    }
    SimJob *job = calloc(1, sizeof *job);
    if (!job) {
        free(e);
        return SIM_ACLNN_ERR_RUNTIME_ERROR;
    }
    job->run = kernel;
    job->release = release_executor;
    job->ctx = e;
    const SimTensor *tensors[3] = {&e->grad, &e->idx, &e->out};
    for (int i = 0; i < 3; i++) job->ranges[job->nranges++] = (SimRange){tensors[i]->data, storage_bytes(tensors[i])};
    if (e->workspace_size > 0) job->ranges[job->nranges++] = (SimRange){workspace, e->workspace_size};
    rc = moegradSimEnqueue(stream, job);
    if (rc != 0) {
        free(job);
        free(e);
        return SIM_ACLNN_ERR_RUNTIME_ERROR;
    }
    moegradSimTrack(SIM_COUNT_LAUNCHES, +1);
    return SIM_ACLNN_SUCCESS;
}
