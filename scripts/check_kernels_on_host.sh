#!/usr/bin/env bash
# Checks the CUDA C kernels (kernels/src/cuda/kernels.cu) without a GPU: compiles them as host
# C++ with a thin shim for the CUDA built-ins (scripts/host-kernels/shim.h), runs every kernel on
# test vectors whose expected bytes come from the CPU backend
# (`cargo run -p orchestrator-kernels --example kernel_vectors`), and compares byte for byte.
# This checks the kernels' index arithmetic and bit manipulation; NVRTC compilation, launches
# and the GPU itself are checked only by scripts/gpu-check.sh on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=${CXX:-$(command -v c++ || command -v g++ || command -v clang++ || true)}
if [ -z "$CXX" ]; then
  echo "skipped: no C++ compiler for the host check of kernels.cu"
  exit 0
fi
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
# KERNEL_VECTORS: a prebuilt `kernel_vectors` example (GPU machines without a Rust toolchain).
if [ -n "${KERNEL_VECTORS:-}" ]; then
  "$KERNEL_VECTORS" "$OUT/vectors"
else
  cargo run -q -p orchestrator-kernels --example kernel_vectors -- "$OUT/vectors"
fi
"$CXX" -std=c++17 -O2 -ffp-contract=off -fno-fast-math -Wall -Wno-unused-function -Wno-unknown-pragmas -o "$OUT/harness" scripts/host-kernels/harness.cpp
"$OUT/harness" "$OUT/vectors" $(ls "$OUT/vectors")
echo "kernels.cu on the host: every kernel reproduces the CPU backend's bytes"
