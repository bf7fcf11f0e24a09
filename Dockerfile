# deepinfer-server: DeepSeek-V4.1-Flash on DeepInfer, NVIDIA SM100 (B200) GPUs.
#
#   docker build --build-arg MAX_JOBS=8 -t deepinfer-server:latest .
#
# Build arguments (every pin can be overridden):
#   MAX_JOBS                         parallel compile jobs for DeepInfer and its kernels (8)
#   FLASH_MLA_SKIP_REG_SPILL_CHECK   non-empty: skip only FlashMLA's post-build register-spill
#                                    check (spills stay; kernels may be slower). Default: checked.
#   CUDA_VERSION, UBUNTU_VERSION, PYTHON_VERSION, DEEPINFER_REPO, DEEPINFER_COMMIT,
#   DEEPSEEK_RECIPE_VERSION, NCCL_VERSION, MOONCAKE_VERSION
#
# Two stages: the build stage compiles DeepInfer, its kernel libraries and this server into
# /opt/venv; the runtime stage starts again from the CUDA *development* image, because DeepGEMM,
# DeepEP and TileLang JIT-compile kernels at run time with nvcc and a host compiler, and copies
# only the environment and the DeepInfer tree (no git, no build intermediates, no pip caches).

ARG CUDA_VERSION=13.2.0
ARG UBUNTU_VERSION=24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS build

ARG PYTHON_VERSION=3.12
ARG MAX_JOBS=8
ARG FLASH_MLA_SKIP_REG_SPILL_CHECK=
ARG DEEPINFER_REPO=https://github.com/deepseek-ai/DeepInfer.git
ARG DEEPINFER_COMMIT=9bd9cf243fc53ef9afbf8f04d391d989117d6ab9
ARG DEEPSEEK_RECIPE_VERSION=0.2.0
ARG NCCL_VERSION=2.32.3
ARG MOONCAKE_VERSION=0.3.13.post1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive

# Build toolchain: DeepInfer needs GCC >= 13 (Ubuntu 24.04 ships 13) and Python 3.12.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-dev" "python${PYTHON_VERSION}-venv" \
        build-essential ca-certificates git ninja-build libibverbs-dev rdma-core \
    && rm -rf /var/lib/apt/lists/*

# setup.py requires VIRTUAL_ENV (or CONDA_PREFIX) and builds against the venv's torch.
RUN "python${PYTHON_VERSION}" -m venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    DEEPINFER_ACCELERATOR=nvidia \
    MAX_JOBS=${MAX_JOBS} \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN git clone --filter=blob:none "${DEEPINFER_REPO}" /opt/DeepInfer \
    && git -C /opt/DeepInfer checkout "${DEEPINFER_COMMIT}" \
    && git -C /opt/DeepInfer submodule update --init --recursive

# DeepInfer's documented build: an empty Python 3.12 environment, DEEPINFER_ACCELERATOR=nvidia,
# then ./build.sh, which installs the pinned requirements (torch 2.13.0+cu132, ...) and compiles
# the vendored kernel libraries (DeepEP, DeepGEMM, FlashMLA, DeepSelect) and deepinfer._C from
# source, MAX_JOBS at a time. FlashMLA reads FLASH_MLA_SKIP_REG_SPILL_CHECK only when it is set,
# so an empty build argument leaves the check on.
WORKDIR /opt/DeepInfer
RUN if [ -z "${FLASH_MLA_SKIP_REG_SPILL_CHECK}" ]; then unset FLASH_MLA_SKIP_REG_SPILL_CHECK; \
    else export FLASH_MLA_SKIP_REG_SPILL_CHECK; fi \
    && ./build.sh

# DeepInfer's intentional NCCL override: DeepEP needs NCCL >= 2.32.3 where torch pins 2.29.7.
# The runtime stage copies the DeepInfer checkout (it runs from source), not its git history.
RUN pip install --no-deps "nvidia-nccl-cu13==${NCCL_VERSION}" \
    && find /opt/DeepInfer -name .git -prune -exec rm -rf {} +

# This server, deepseek-recipe, and Mooncake's Transfer Engine, which moves KV between prefill
# and decode servers (--disaggregation-mode), in its CUDA 13 build (RDMA and NVLink on device
# memory) rather than the `disaggregation` extra's non-CUDA build (TCP over host memory, for the
# simulated engine): both provide the same `mooncake` module, so only one is installed. Same
# version as the extra's pin.
COPY pyproject.toml README.md /opt/deepinfer-server/
COPY src /opt/deepinfer-server/src
RUN pip install "deepseek-recipe==${DEEPSEEK_RECIPE_VERSION}" \
        "mooncake-transfer-engine-cuda13==${MOONCAKE_VERSION}" /opt/deepinfer-server

# Any dependency conflict fails the build, except exactly the NCCL override above.
COPY docker/check_dependencies.py /opt/deepinfer-server/docker/check_dependencies.py
RUN python /opt/deepinfer-server/docker/check_dependencies.py \
        --allow "torch:nvidia-nccl-cu13:2.29.7:${NCCL_VERSION}"


FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS runtime

ARG PYTHON_VERSION=3.12

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive

# Python, the host compiler for kernel JIT, the RDMA user-space libraries the Engram tables
# and DeepEP use (the host still has to expose /dev/infiniband), and libnuma, which DeepInfer's
# CPU binding (deep_cluster/topology/bind.py) loads (without it: a warning and no binding).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-dev" build-essential \
        ca-certificates ibverbs-providers libibverbs1 libnuma1 rdma-core \
    && rm -rf /var/lib/apt/lists/*

COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/DeepInfer /opt/DeepInfer
COPY docker/entrypoint.sh /usr/local/bin/deepinfer-entrypoint

# /cache is the one volume: Hugging Face downloads and remote code, the kernel JIT cache, and
# the server's state (the Responses store's SQLite file), which outlives the container there.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    PYTHONPATH=/opt/DeepInfer \
    DEEPINFER_ACCELERATOR=nvidia \
    HF_HOME=/cache/huggingface \
    DEEPINFER_JIT_CACHE_DIR=/cache/jit \
    DEEPINFER_STATE_DIR=/cache/state
VOLUME ["/cache"]

# No HEALTHCHECK: a cold start (weights, JIT) can take up to the one-hour start-up timeout;
# orchestrators (GPUStack, Kubernetes) probe GET /health on the serving port themselves.
EXPOSE 8000
WORKDIR /opt/deepinfer-server
ENTRYPOINT ["/usr/local/bin/deepinfer-entrypoint"]
CMD ["--help"]
