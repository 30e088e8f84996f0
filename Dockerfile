# layoutlab in a pinned CUDA container: the GPU twin of README's CPU install.
#   docker build -t layoutlab .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --user "$(id -u):$(id -g)" --rm -v "$PWD/runs:/work/runs" \
#       layoutlab bash launch/run.sh recipes/7b_tp2_zero3      (multi-node flags: docs/multinode.md)
# Every version is a build argument whose default is the tested one; the Python packages' defaults equal
# pyproject.toml's pins (tests/unit/test_container.py compares them). An empty argument fails the build.
# The CUDA of PyPI's torch 2.13.0 wheel: it requires cuda-toolkit==13.0.3 (nvidia-cuda-runtime 13.0.96, CUDA 13.0
# Update 2) and nvidia-nccl-cu13 2.29.7 (read from the wheel's metadata, tests/unit/test_container.py). The base's nvcc
# has the same major, as DeepSpeed's JIT ops need; cuDNN, cuBLAS and NCCL come with the wheel.
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu22.04
FROM ${CUDA_IMAGE}

ARG CUDA_IMAGE
ARG PYTHON_VERSION=3.11
ARG TORCH_VERSION=2.13.0
ARG DEEPSPEED_VERSION=0.19.8
ARG MEGATRON_CORE_VERSION=0.16.1
ARG TRANSFORMERS_VERSION=5.24.0
ARG ACCELERATE_VERSION=1.15.0
ARG TENSORBOARD_VERSION=2.21.0
ARG MSGSPEC_VERSION=0.23.0
ARG NCCL_TESTS_VERSION=v2.19.6
ARG NSYS_APT_PACKAGE=cuda-nsight-systems-13-0
ARG USER_UID=1000

# Fail early and by name when a version was passed empty (`--build-arg X=`), instead of installing "latest".
RUN : "${CUDA_IMAGE:?}" "${PYTHON_VERSION:?}" "${TORCH_VERSION:?}" "${DEEPSPEED_VERSION:?}" \
      "${MEGATRON_CORE_VERSION:?}" "${TRANSFORMERS_VERSION:?}" "${ACCELERATE_VERSION:?}" "${TENSORBOARD_VERSION:?}" \
      "${MSGSPEC_VERSION:?}" "${NCCL_TESTS_VERSION:?}" "${NSYS_APT_PACKAGE:?}" "${USER_UID:?}"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TORCH_CUDA_ARCH_LIST="7.5;8.0;8.6;8.9;9.0;10.0;12.0"

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

# One virtual environment for everything, first on PATH: `python` is the pinned interpreter. torch from PyPI, whose
# Linux wheel is the CUDA 13 build (PyTorch's own index offers no cu129 wheel of 2.13). The NCCL torch loads (the
# nvidia-nccl-cu13 wheel) is the one nccl-tests link below and the one on the loader's path, so the collective sweep
# and nccl-tests measure one library.
ENV VIRTUAL_ENV=/opt/venv
ENV PATH="/opt/venv/bin:/usr/local/cuda/bin:${PATH}" \
    NCCL_HOME="/opt/venv/lib/python${PYTHON_VERSION}/site-packages/nvidia/nccl"
ENV LD_LIBRARY_PATH="${NCCL_HOME}/lib:${LD_LIBRARY_PATH}"
RUN "python${PYTHON_VERSION}" -m venv /opt/venv \
 && python -m pip install --upgrade "pip==25.2" "setuptools==80.9.0" "wheel==0.45.1" \
 && python -m pip install "torch==${TORCH_VERSION}" \
 && python -m pip install "deepspeed==${DEEPSPEED_VERSION}" "megatron-core==${MEGATRON_CORE_VERSION}" \
      "transformers==${TRANSFORMERS_VERSION}" "accelerate==${ACCELERATE_VERSION}" \
      "tensorboard==${TENSORBOARD_VERSION}" "msgspec==${MSGSPEC_VERSION}"

# nccl-tests from a pinned release, with MPI for multi-node sweeps, against torch's NCCL (the wheel ships
# include/nccl.h and lib/libnccl.so.2; the link name is added); its *_perf binaries go on PATH, where
# run.mode=commbench looks for them.
RUN ln -s libnccl.so.2 "${NCCL_HOME}/lib/libnccl.so" \
 && git clone --depth 1 --branch "${NCCL_TESTS_VERSION}" https://github.com/NVIDIA/nccl-tests.git /opt/nccl-tests \
 && make -C /opt/nccl-tests -j"$(nproc)" MPI=1 MPI_HOME=/usr/lib/x86_64-linux-gnu/openmpi \
      CUDA_HOME=/usr/local/cuda NCCL_HOME="${NCCL_HOME}" \
 && cp /opt/nccl-tests/build/*_perf /usr/local/bin/ \
 && rm -rf /opt/nccl-tests

# The project itself with its test extras, installed into the same environment (torch's CUDA build above already
# satisfies its pin). Transformer Engine and flash-attn are left out: for torch 2.13 both are source builds against
# torch (transformer_engine_torch and flash-attn publish sdists only), tens of minutes of nvcc each; install
# "transformer-engine[pytorch]" on top for train.attention=te (docs/backends.md).
WORKDIR /work
COPY pyproject.toml setup.py README.md ./
COPY launch ./launch
COPY analysis ./analysis
COPY recipes ./recipes
COPY ds_configs ./ds_configs
COPY bench ./bench
# the tests too: tests/gpu/run_checks.sh runs inside the image on a GPU machine
COPY tests ./tests
RUN python -m pip install -e ".[test]" \
 && python -c "import torch, deepspeed, megatron.core, transformers, accelerate; print(torch.__version__, torch.version.cuda)"

# Not root: runs/ is where results land; mount a host folder there to keep them. `docker run --user "$(id -u):$(id -g)"`
# runs as the owner of that folder instead (a uid-1000 user would otherwise write files its host user cannot change):
# the home's caches (torch extensions, Hugging Face) are writable by any uid.
RUN useradd --create-home --uid "${USER_UID}" layoutlab \
 && mkdir -p /work/runs /home/layoutlab/.cache \
 && chown -R layoutlab:layoutlab /work /home/layoutlab \
 && chmod -R a+rwX /home/layoutlab /work/runs
ENV HOME=/home/layoutlab
USER ${USER_UID}
ENV TORCH_EXTENSIONS_DIR=/home/layoutlab/.cache/torch_extensions
CMD ["bash", "launch/run.sh", "recipes/7b_tp2_zero3", "--dry-run"]
