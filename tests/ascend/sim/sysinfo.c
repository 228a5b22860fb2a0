/*
 * The package versions of moegrad's CANN simulator, linked into libascendcl.so with runtime.c:
 * aclsysGetVersionStr reads $ASCEND_HOME_PATH/share/info/<package>/version.info as CANN's runtime
 * does (hicann/runtime src/acl/aclrt_impl/acl.cpp, aclsysGetVersionStrImpl).
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim.h"

/* ---- acl/acl_rt.h: package versions ------------------------------------------------------------- */

/* The value after "Version=" on the first line of `path` that holds it, trimmed, into `out`
 * (SIM_PKG_VERSION_MAX_SIZE bytes). 0, or SIM_ACL_ERROR_INVALID_FILE (no file, no key, empty value). */
static int read_version_file(const char *path, char *out) {
    FILE *f = fopen(path, "r");
    if (!f) return SIM_ACL_ERROR_INVALID_FILE;
    char line[1024];
    int rc = SIM_ACL_ERROR_INVALID_FILE;
    while (fgets(line, sizeof line, f)) {
        char *at = strstr(line, "Version=");
        if (!at) continue;
        char *value = at + strlen("Version="), *end = value + strlen(value);
        while (*value && isspace((unsigned char)*value)) value++;
        while (end > value && isspace((unsigned char)end[-1])) *--end = 0;
        if (*value == 0) break;
        if (strlen(value) >= SIM_PKG_VERSION_MAX_SIZE) {
            rc = SIM_ACL_ERROR_INTERNAL_ERROR; /* the runtime's strcpy_s into 128 bytes fails */
            break;
        }
        strcpy(out, value);
        rc = SIM_ACL_SUCCESS;
        break;
    }
    fclose(f);
    return rc;
}

/* aclError aclsysGetVersionStr(char *pkgName, char *versionStr): as hicann/runtime's
 * aclsysGetVersionStrImpl (src/acl/aclrt_impl/acl.cpp): realpath($ASCEND_HOME_PATH)/share/info/
 * <pkgName>/version.info, a name with '_' retried with '-' (and the reverse), 100003 when neither
 * file gives a value. No aclInit is needed. */
SIM_EXPORT int32_t aclsysGetVersionStr(char *pkgName, char *versionStr) {
    if (!pkgName || !versionStr) {
        moegradSimSetError("EH0004: [moegrad-sim] aclsysGetVersionStr: %s is nullptr", pkgName ? "versionStr" : "pkgName");
        return SIM_ACL_ERROR_INVALID_PARAM;
    }
    const char *env = getenv("ASCEND_HOME_PATH");
    char home[PATH_MAX];
    if (!env || !realpath(env, home)) {
        moegradSimSetError("EH0005: [moegrad-sim] aclsysGetVersionStr: ASCEND_HOME_PATH is not set or does not exist");
        return SIM_ACL_ERROR_INVALID_FILE;
    }
    char names[2][256];
    snprintf(names[0], sizeof names[0], "%s", pkgName);
    snprintf(names[1], sizeof names[1], "%s", pkgName);
    int alternative = strchr(pkgName, '-') != NULL || strchr(pkgName, '_') != NULL;
    char from = strchr(pkgName, '-') ? '-' : '_', to = from == '-' ? '_' : '-';
    for (char *c = names[1]; *c; c++)
        if (*c == from) *c = to;
    int rc = SIM_ACL_ERROR_INVALID_FILE;
    for (int i = 0; i < 1 + alternative && rc == SIM_ACL_ERROR_INVALID_FILE; i++) {
        char path[PATH_MAX + 512];
        snprintf(path, sizeof path, "%s/share/info/%s/version.info", home, names[i]);
        rc = read_version_file(path, versionStr);
    }
    if (rc != SIM_ACL_SUCCESS)
        moegradSimSetError("EH0006: [moegrad-sim] aclsysGetVersionStr: no Version= for package %s under %s/share/info",
                           pkgName, home);
    return rc;
}
