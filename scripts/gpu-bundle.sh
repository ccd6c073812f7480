#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs into .gpu-bundle/ (release, `--features cuda`,
# stripped): the two binaries, the GPU test executables and the kernel test-vector generator.
# For GPU machines that have CUDA but no Rust toolchain and no network: carry `.gpu-bundle` there
# and run `scripts/gpu-check.sh` (it uses the bundle when present). Same CPU architecture only.
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=.gpu-bundle
FEATURES=orchestrator-worker/cuda,orchestrator-coordinator/cuda
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE"
cargo build --release --workspace --features "$FEATURES"
cargo build --release -p orchestrator-kernels --example kernel_vectors
cp target/release/orchestrator target/release/orchestrator-worker target/release/examples/kernel_vectors "$BUNDLE/"
# The GPU test executables of both packages (each test target is named `cuda`).
cargo test --release --no-run --features orchestrator-worker/cuda -p orchestrator-kernels -p orchestrator-worker --test cuda \
  --message-format=json 2>/dev/null | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda":
        pkg = "kernels" if "orchestrator-kernels" in m["package_id"] else "worker"
        shutil.copy(m["executable"], sys.argv[1] + "/" + pkg + "-cuda-tests")
' "$BUNDLE"
for t in kernels worker; do
  [ -x "$BUNDLE/$t-cuda-tests" ] || { echo "missing the $t GPU test executable" >&2; exit 1; }
done
strip "$BUNDLE"/* 2>/dev/null || true
ls -l "$BUNDLE"
echo "bundle: $(du -sh "$BUNDLE" | cut -f1) in $BUNDLE (carry it to the GPU machine, run scripts/gpu-check.sh)"
