# open_diloco image: the trainer (`open-diloco`, the entrypoint), torchrun, scripts/cluster_train.sh and the
# stock `hivemind-dht`. CPU by default:
#   docker build -t open-diloco .
#   docker run --rm open-diloco --config configs/demo-2m.toml --max-steps 5
# CUDA: a CUDA runtime base and the matching torch wheel index:
#   docker build -t open-diloco:cuda --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   docker run --rm --gpus all --network host --ipc host --entrypoint scripts/cluster_train.sh open-diloco:cuda \
#     configs/my.toml 2 0 10.0.0.1 29500
# (--network host: peers and other nodes must reach the ports this container listens on; --ipc host: NCCL
# and data workers need more shared memory than docker's default 64 MiB.)
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# python:*-slim has Python; CUDA base images do not. procps and iproute2 (ps, ip) help debug a node.
# Versions come from the base image's distribution, which differs per BASE_IMAGE: nothing to pin here.
# hadolint ignore=DL3008
RUN apt-get update \
    && packages=(procps iproute2 ca-certificates) \
    && if ! command -v python3 >/dev/null; then packages+=(python3 python3-venv); fi \
    && apt-get install -y --no-install-recommends "${packages[@]}" \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /opt/open_diloco

# torch first, from the index of the chosen device (the default PyPI wheel would pull in CUDA on CPU images).
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# The tested versions of everything but torch (constraints.txt); --build-arg CONSTRAINTS= resolves freely.
ARG CONSTRAINTS=constraints.txt
COPY pyproject.toml README.md constraints.txt ./
COPY open_diloco ./open_diloco
RUN pip install . ${CONSTRAINTS:+-c "$CONSTRAINTS"} && hivemind-dht --help >/dev/null

COPY scripts ./scripts
COPY configs ./configs
COPY tests/models ./tests/models

ENTRYPOINT ["open-diloco"]
CMD ["--help"]
