# syntax=docker/dockerfile:1
#
# The moegrad service image: one recipe for CPU hosts and Ascend NPU hosts (docs/operations.md).
#
#   CPU (the embedded NumPy emulation):
#     docker build -t moegrad:cpu .
#   Ascend NPU (Atlas A2/A3): a CANN base image, e.g. from the ascendai/cann repository, whose tags
#   read <cann-version>-<chip>-<os>-<python>:
#     docker build --build-arg BASE_IMAGE=ascendai/cann:8.3.rc1-910b-ubuntu22.04-py3.11 -t moegrad:npu .
#
# BASE_IMAGE must provide Python 3.11 or newer as `python`, with pip and venv. The service runs in its
# own virtual environment (APP_ROOT/venv), so it never changes the base image's Python packages.
# One uvicorn worker per container: one process owns one device (scale with more containers).

ARG BASE_IMAGE=python:3.11-slim
# Everything the build writes lies under APP_ROOT (tests/deploy builds the same steps under a
# temporary directory by overriding it).
ARG APP_ROOT=/opt/moegrad

# ---- requirements: the dependency list, from pyproject.toml, at the versions of requirements.lock ---
FROM ${BASE_IMAGE} AS requirements
ARG APP_ROOT
WORKDIR ${APP_ROOT}/requirements
COPY pyproject.toml requirements.lock docker/requirements.py ./
RUN python requirements.py pyproject.toml service > requirements.txt

# ---- wheel: the moegrad wheel, from the source -----------------------------------------------------
FROM ${BASE_IMAGE} AS wheel
ARG APP_ROOT
WORKDIR ${APP_ROOT}/wheel
COPY pyproject.toml README.md ./
COPY client/ client/
COPY service/ service/
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir dist .

# ---- runtime ---------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS runtime
ARG APP_ROOT
# The user the service runs as. On an NPU host, match the host's driver run user (HwHiAiUser, 1000:1000
# by default) so the process may open the NPU device files: --build-arg APP_UID=$(id -u HwHiAiUser) ...
ARG APP_UID=1000
ARG APP_GID=1000
# NUMBA_CACHE_DIR: where the compiled reference kernel is cached; /tmp is writable (an emptyDir in the pod).
ENV VIRTUAL_ENV=${APP_ROOT}/venv \
    PATH=${APP_ROOT}/venv/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NUMBA_CACHE_DIR=/tmp/numba-cache \
    MOEGRAD_HOST=0.0.0.0 \
    MOEGRAD_PORT=8000
WORKDIR ${APP_ROOT}
RUN python -m venv "${VIRTUAL_ENV}"

# Dependencies first: this layer is rebuilt only when the dependency list or the lock changes. The
# lock (the versions `make test` passed with) constrains every version the list resolves to.
COPY --from=requirements ${APP_ROOT}/requirements/requirements.txt ${APP_ROOT}/requirements/requirements.lock ./
RUN python -m pip install --no-cache-dir --constraint requirements.lock --requirement requirements.txt

# Then the project itself, without touching the dependencies.
COPY --from=wheel ${APP_ROOT}/wheel/dist/ dist/
RUN python -m pip install --no-cache-dir --no-deps dist/*.whl && rm -r dist

COPY --chmod=0755 docker/entrypoint.sh ${APP_ROOT}/venv/bin/moegrad-entrypoint
COPY --chmod=0755 docker/healthcheck.py ${APP_ROOT}/venv/bin/moegrad-healthcheck

RUN (getent group "${APP_GID}" >/dev/null || groupadd --gid "${APP_GID}" moegrad) \
    && (getent passwd "${APP_UID}" >/dev/null \
        || useradd --no-log-init --uid "${APP_UID}" --gid "${APP_GID}" --create-home --home-dir /home/moegrad \
           --shell /usr/sbin/nologin moegrad)
USER ${APP_UID}:${APP_GID}

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 CMD ["moegrad-healthcheck"]
ENTRYPOINT ["moegrad-entrypoint"]
CMD []
