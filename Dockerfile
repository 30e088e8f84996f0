# layoutlab in a pinned CUDA container: the GPU twin of README's CPU install.
#   docker build -t layoutlab .
#   docker run --gpus all --ipc=host --rm -v "$PWD/runs:/work/runs" layoutlab bash launch/run.sh recipes/7b_tp2_zero3
# Every version is a build argument whose default is the tested one; the Python packages' defaults equal
# pyproject.toml's pins (tests/unit/test_container.py compares them). An empty argument fails the build.
ARG CUDA_IMAGE=nvidia/cuda:12.9.1-cudnn-devel-ubuntu22.04
FROM ${CUDA_IMAGE}

ARG CUDA_IMAGE
ARG PYTHON_VERSION=3.11
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu129
ARG DEEPSPEED_VERSION=0.19.8
ARG MEGATRON_CORE_VERSION=0.16.1
ARG TRANSFORMERS_VERSION=5.24.0
ARG ACCELERATE_VERSION=1.15.0
ARG TENSORBOARD_VERSION=2.21.0
ARG MSGSPEC_VERSION=0.23.0
ARG NCCL_TESTS_VERSION=v2.19.6
ARG NSYS_APT_PACKAGE=cuda-nsight-systems-12-9
ARG USER_UID=1000

# Fail early and by name when a version was passed empty (`--build-arg X=`), instead of installing "latest".
RUN : "${CUDA_IMAGE:?}" "${PYTHON_VERSION:?}" "${TORCH_VERSION:?}" "${TORCH_INDEX_URL:?}" "${DEEPSPEED_VERSION:?}" \
      "${MEGATRON_CORE_VERSION:?}" "${TRANSFORMERS_VERSION:?}" "${ACCELERATE_VERSION:?}" "${TENSORBOARD_VERSION:?}" \
      "${MSGSPEC_VERSION:?}" "${NCCL_TESTS_VERSION:?}" "${NSYS_APT_PACKAGE:?}" "${USER_UID:?}"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TORCH_CUDA_ARCH_LIST="8.0;9.0"

# A C compiler and zlib headers build the Kineto fast path; libaio serves NVMe offload (DeepSpeed's async_io op);
# OpenMPI runs nccl-tests across nodes; pdsh and ssh are what DeepSpeed's own multi-node runner uses.
# DL3008 (apt versions unpinned), explained: apt packages follow the pinned base image's Ubuntu release, whose
# archive keeps only the current patch level, so a pinned version would break the build at its next update; the
# Nsight package is pinned by its versioned name.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-dev" "python${PYTHON_VERSION}-venv" \
      build-essential git ca-certificates zlib1g-dev libaio-dev \
      openmpi-bin libopenmpi-dev pdsh openssh-client \
      "${NSYS_APT_PACKAGE}" \
 && rm -rf /var/lib/apt/lists/*

# One virtual environment for everything, first on PATH: `python` is the pinned interpreter.
ENV VIRTUAL_ENV=/opt/venv
ENV PATH="/opt/venv/bin:/usr/local/cuda/bin:${PATH}"
RUN "python${PYTHON_VERSION}" -m venv /opt/venv \
 && python -m pip install --upgrade "pip==25.2" "setuptools==80.9.0" "wheel==0.45.1" \
 && python -m pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && python -m pip install "deepspeed==${DEEPSPEED_VERSION}" "megatron-core==${MEGATRON_CORE_VERSION}" \
      "transformers==${TRANSFORMERS_VERSION}" "accelerate==${ACCELERATE_VERSION}" \
      "tensorboard==${TENSORBOARD_VERSION}" "msgspec==${MSGSPEC_VERSION}"

# nccl-tests from a pinned release, with MPI for multi-node sweeps; its *_perf binaries go on PATH, where
# run.mode=commbench looks for them.
RUN git clone --depth 1 --branch "${NCCL_TESTS_VERSION}" https://github.com/NVIDIA/nccl-tests.git /opt/nccl-tests \
 && make -C /opt/nccl-tests -j"$(nproc)" MPI=1 MPI_HOME=/usr/lib/x86_64-linux-gnu/openmpi \
      CUDA_HOME=/usr/local/cuda NCCL_HOME=/usr \
 && cp /opt/nccl-tests/build/*_perf /usr/local/bin/ \
 && rm -rf /opt/nccl-tests

# The project itself, installed into the same environment (torch's CUDA build above already satisfies its pin).
WORKDIR /work
COPY pyproject.toml setup.py README.md ./
COPY launch ./launch
COPY analysis ./analysis
COPY recipes ./recipes
COPY ds_configs ./ds_configs
COPY bench ./bench
RUN python -m pip install -e . \
 && python -c "import torch, deepspeed, megatron.core, transformers, accelerate; print(torch.__version__, torch.version.cuda)"

# Not root: runs/ is where results land; mount a host folder there to keep them.
RUN useradd --create-home --uid "${USER_UID}" layoutlab \
 && mkdir -p /work/runs \
 && chown -R layoutlab:layoutlab /work
USER ${USER_UID}
ENV TORCH_EXTENSIONS_DIR=/home/layoutlab/.cache/torch_extensions
CMD ["bash", "launch/run.sh", "recipes/7b_tp2_zero3", "--dry-run"]
