#!/usr/bin/env bash
# moegrad container entrypoint (installed as `moegrad-entrypoint`).
#
#   moegrad-entrypoint [FLAG ...]        ->  exec moegrad-service serve [FLAG ...]
#   moegrad-entrypoint serve [FLAG ...]  ->  the same
#   moegrad-entrypoint COMMAND [ARG ...] ->  exec COMMAND (a shell, `moegrad --help`, ...) in the same environment
#
# Before that it
#   1. sources CANN's environment script when the image has one (an NPU image, built on a CANN base):
#      the first that exists of CANN_SET_ENV_SCRIPTS, a colon-separated list, by default
#      /usr/local/Ascend/ascend-toolkit/set_env.sh (CANN 8.x) then /usr/local/Ascend/cann/set_env.sh
#      (newer layouts). The script exports ASCEND_HOME_PATH, which the service's settings honour. On
#      a CPU image neither exists and nothing is sourced.
#   2. binds 0.0.0.0 unless MOEGRAD_HOST says otherwise (a container is reached from outside it).
#   3. drops MOEGRAD_AUTH_TOKENS_FILE, with a warning, when that file does not exist: the Kubernetes
#      manifests mount the token Secret as optional, and a Secret nobody created means no
#      authentication rather than a pod that cannot start.
#
# `exec` makes the service PID 1 of the container, so SIGTERM reaches uvicorn directly: it stops
# admitting, lets admitted calls finish within MOEGRAD_SHUTDOWN_GRACE_S and exits 0. The service
# always runs one uvicorn worker: one process owns one device.
set -euo pipefail

log() { printf 'moegrad-entrypoint: %s\n' "$*" >&2; }

# Split the list with parameter expansion only: no here-string temp file on a read-only root.
remaining="${CANN_SET_ENV_SCRIPTS:-/usr/local/Ascend/ascend-toolkit/set_env.sh:/usr/local/Ascend/cann/set_env.sh}:"
while [[ -n "$remaining" ]]; do
    script="${remaining%%:*}"
    remaining="${remaining#*:}"
    if [[ -n "$script" && -f "$script" ]]; then
        # CANN's script reads variables that may be unset (LD_LIBRARY_PATH, PYTHONPATH, ...) and is
        # not written for errexit: source it with both off, then restore them.
        set +eu
        # shellcheck disable=SC1090
        source "$script"
        status=$?
        set -eu
        if [[ $status -ne 0 ]]; then
            log "warning: $script exited with status $status"
        fi
        log "sourced $script (ASCEND_HOME_PATH=${ASCEND_HOME_PATH:-unset})"
        break
    fi
done

if [[ -n "${ASCEND_VISIBLE_DEVICES:-}" ]]; then
    # Set by the Ascend device plugin / Docker runtime: the physical NPU(s) mounted into this
    # container. The runtime numbers the mounted devices from 0, so the service's device id is 0.
    log "ASCEND_VISIBLE_DEVICES=${ASCEND_VISIBLE_DEVICES} (physical); serving device id ${MOEGRAD_DEVICE_ID:-0} of the container"
fi

export MOEGRAD_HOST="${MOEGRAD_HOST:-0.0.0.0}"

if [[ -n "${MOEGRAD_AUTH_TOKENS_FILE:-}" && ! -e "${MOEGRAD_AUTH_TOKENS_FILE}" ]]; then
    log "warning: MOEGRAD_AUTH_TOKENS_FILE=${MOEGRAD_AUTH_TOKENS_FILE} does not exist (no token Secret?); serving without it"
    unset MOEGRAD_AUTH_TOKENS_FILE
fi

if [[ $# -eq 0 || "$1" == -* ]]; then
    exec moegrad-service serve "$@"
elif [[ "$1" == serve ]]; then
    shift
    exec moegrad-service serve "$@"
fi
exec "$@"
