#!/usr/bin/env bash
# GPU acceptance check (one GPU; 38 s on an H200 from a bundle, measured 2026-12-04; minutes more when it builds):
#   0. finds the CUDA driver, NVRTC and NCCL libraries (pip wheels' versioned names included);
#   1. checks kernels.cu compiled for the host against the CPU backend (no GPU needed);
#   2. builds everything with the `cuda` feature, or, on a machine without a Rust toolchain,
#      uses the prebuilt `.gpu-bundle/` that `scripts/gpu-bundle.sh` writes;
#   3. runs every GPU test (kernels and worker: each op against the CPU backend byte for byte,
#      whole-rank loads at TP 1/2/4/8, the device probe, NCCL with world size 1 and a missing
#      peer) and fails if any of them skipped for lack of CUDA;
#   4. the 8-layer dsv41-flash checkpoint at TP 1/2/4/8: GPU kernel digests equal the CPU's;
#   5. `orchestrator-worker load --device cuda` against `--device cpu` (kernel, source and y
#      digests equal);
#   6. `orchestrator launch --device cuda --tp 1 --verify golden`: a GPU worker's report checked
#      against the coordinator's CPU recomputation;
#   7. a rolling update of a served TP 1 x DP 2 cluster of GPU workers (both on GPU 0): A -> B
#      verified and swapped, then a worker whose stage skips the permutation refused;
#   8. the GPU benchmarks; then a summary.
# Output and logs: $GPU_CHECK_OUT (default: a temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."
FEATURES=orchestrator-worker/cuda,orchestrator-coordinator/cuda
LOG=${GPU_CHECK_OUT:-$(mktemp -d)}
mkdir -p "$LOG"
BUNDLE=${GPU_BUNDLE:-.gpu-bundle}
declare -a SUMMARY=()
step() { echo; echo "== $*"; }
pass() { SUMMARY+=("[ ok ] $*"); }
fail() { SUMMARY+=("[FAIL] $*"); STATUS=1; }
STATUS=0
START=$SECONDS

step "GPU"
nvidia-smi -L || echo "(nvidia-smi not available)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
command -v nvcc > /dev/null && nvcc --version | tail -2

step "CUDA libraries"
# cudarc loads libcuda.so(.1), libnvrtc.so(.12) and libnccl.so; CUDA 13 machines and pip
# wheels ship libnvrtc.so.13 and libnccl.so.2. Link the newest found under the names it tries.
LIBS=$LOG/cuda-libs
mkdir -p "$LIBS"
find_lib() {
  # What the dynamic loader knows first (the driver must match the kernel module), else the
  # newest copy under the usual places (pip wheels under /opt or site-packages).
  local known
  known=$(ldconfig -p 2>/dev/null | awk -v n="$1" '$1 ~ "^"n {print $NF}' | grep -v stub | head -1)
  if [ -n "$known" ]; then echo "$known"; return; fi
  find /usr/local/cuda*/lib64 /usr/local/nvidia /usr/lib/x86_64-linux-gnu /opt /usr/local/lib /usr/lib/python3*/ \
    -name "$1*" 2>/dev/null | grep -v -e '\.a$' -e stub | sort -V | tail -1
}
for lib in libcuda.so libnvrtc.so libnccl.so; do
  # Every copy on the machine, for the log (a wrong pick is then visible).
  find /usr/local/cuda*/lib64 /usr/local/nvidia /usr/lib/x86_64-linux-gnu /opt /usr/local/lib /usr/lib/python3*/ \
    -name "$lib*" 2>/dev/null | grep -v -e '\.a$' -e stub | sed "s/^/  candidate: /" || true
  found=$(find_lib "$lib" || true)
  if [ -n "$found" ]; then
    ln -sf "$found" "$LIBS/$lib"
    echo "$lib -> $found"
    # NVRTC needs its builtins library beside it.
    [ "$lib" = libnvrtc.so ] && for b in "$(dirname "$found")"/libnvrtc-builtins.so*; do [ -e "$b" ] && ln -sf "$b" "$LIBS/"; done
  else
    echo "$lib: not found"
  fi
done
export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

if command -v cargo > /dev/null; then
  step "build --release --features cuda"
  cargo build --release --workspace --features "$FEATURES"
  cargo build --release -p orchestrator-kernels --example kernel_vectors
  pass "release build with --features cuda"
  BIN=target/release
  VECTORS=target/release/examples/kernel_vectors
  test_exe() {
    cargo test --release --features "orchestrator-$1/cuda" -p "orchestrator-$1" --test cuda -- "${@:2}"
  }
elif [ -x "$BUNDLE/orchestrator-worker" ]; then
  step "prebuilt bundle $BUNDLE (no Rust toolchain here)"
  ls -l "$BUNDLE"
  pass "prebuilt bundle (scripts/gpu-bundle.sh)"
  BIN=$BUNDLE
  VECTORS=$BUNDLE/kernel_vectors
  test_exe() { "$BUNDLE/$1-cuda-tests" "${@:2}"; }
else
  echo "no cargo and no $BUNDLE: run scripts/gpu-bundle.sh where Rust is installed and carry $BUNDLE here" >&2
  exit 2
fi

step "kernels.cu compiled for the host, against the CPU backend"
if KERNEL_VECTORS=$VECTORS scripts/check_kernels_on_host.sh > "$LOG/host.txt" 2>&1; then
  pass "$(tail -1 "$LOG/host.txt")"
else
  fail "kernels.cu on the host (see $LOG/host.txt)"
fi

step "GPU tests"
: > "$LOG/tests.txt"
tests_ok=1
for pkg in kernels worker; do
  test_exe "$pkg" --nocapture --test-threads 1 2>&1 | tee -a "$LOG/tests.txt" || tests_ok=0
done
if [ $tests_ok = 1 ] && ! grep -q "skipped: no CUDA" "$LOG/tests.txt"; then
  pass "GPU tests: $(grep -o 'test result: ok. [0-9]* passed' "$LOG/tests.txt" | awk '{s += $4} END {print s}') passed"
elif [ $tests_ok = 1 ]; then
  fail "GPU tests skipped: no usable CUDA on this machine"
else
  fail "GPU tests (see $LOG/tests.txt)"
fi

step "8-layer dsv41-flash checkpoint, TP 1/2/4/8: GPU kernel digests vs CPU"
if test_exe worker --ignored --nocapture 2>&1 | tee "$LOG/ckpt.txt" && ! grep -q "skipped: no CUDA" "$LOG/ckpt.txt"; then
  pass "8-layer dsv41-flash: $(grep -c 'on both' "$LOG/ckpt.txt") ranks with identical GPU/CPU kernel digests"
else
  fail "8-layer dsv41-flash digests (see $LOG/ckpt.txt)"
fi

W=$BIN/orchestrator-worker
step "orchestrator-worker load --device cuda vs --device cpu (dsv41-flash, 2 layers, TP 1, probe)"
ARGS=(load --dummy --preset dsv41-flash --layers 2 --tp 1 --probe 16,128,7 --brief)
digests() { grep -E "kernel digest|probe y_partial digest|^y |PASS|FAIL" | sed -E 's/\(kernel pass.*//'; }
if "$W" "${ARGS[@]}" --device cpu > "$LOG/cpu.txt" && "$W" "${ARGS[@]}" --device cuda > "$LOG/cuda.txt"; then
  if diff <(digests < "$LOG/cpu.txt") <(digests < "$LOG/cuda.txt"); then
    pass "single-GPU load + probe agree with the CPU ($(digests < "$LOG/cuda.txt" | head -1 | xargs))"
  else
    fail "GPU and CPU reports differ (see $LOG/cpu.txt, $LOG/cuda.txt)"
  fi
else
  fail "load --device cuda (see $LOG/cuda.txt)"
fi

step "orchestrator launch --device cuda --tp 1 --verify golden"
if "$BIN/orchestrator" launch --device cuda --tp 1 --verify golden --json > "$LOG/launch.json" 2> "$LOG/launch.err" \
    && grep -q '"ok": true' "$LOG/launch.json"; then
  pass "launch --device cuda --tp 1: the GPU rank's report agrees with the CPU golden digests and the probe"
else
  fail "launch --device cuda --tp 1 (see $LOG/launch.json, $LOG/launch.err)"
fi

step "rolling update on GPU workers (TP 1 x DP 2 on one GPU): A -> B staged, verified, swapped; a bad stage refused"
# Two replicas share GPU 0 (one NCCL rank each). The update stages B into device buffers beside
# A, verifies dp0 against the reference and dp1 as byte-identical to dp0, and swaps; with a
# worker that skips the permutation while staging, dp1 must fail verification and keep A.
O=$BIN/orchestrator
UPD=$LOG/update
CKPTS=$(mktemp -d) # the two checkpoints stay out of the logs' archive
mkdir -p "$UPD"
"$O" checkpoint synth --preset dsv41-flash --layers 2 --seed 1 --out "$CKPTS/A" > /dev/null
"$O" checkpoint synth --preset dsv41-flash --layers 2 --seed 2 --out "$CKPTS/B" > /dev/null
serve() { # NAME [launch flags]: a served cluster on A; sets URL, TOKEN and SERVE_PID
  local name=$1
  shift
  "$O" launch --device cuda --tp 1 --dp 2 --checkpoint "$CKPTS/A" --allow-root "$CKPTS" --serve --listen 127.0.0.1:0 "$@" \
    > "$UPD/$name.out" 2> "$UPD/$name.err" &
  SERVE_PID=$!
  for _ in $(seq 1 240); do
    grep -q '^serving' "$UPD/$name.err" && break
    kill -0 "$SERVE_PID" 2> /dev/null || break
    sleep 0.25
  done
  URL=$(grep -o -- '--coordinator [^ ]*' "$UPD/$name.err" | head -1 | cut -d' ' -f2)
  TOKEN=$(grep -o -- '--token-file [^ `]*' "$UPD/$name.err" | head -1 | cut -d' ' -f2)
  [ -n "$URL" ] && [ -n "$TOKEN" ]
}
unserve() {
  "$O" shutdown --coordinator "$URL" --token-file "$TOKEN" > /dev/null 2>&1 || kill "$SERVE_PID" 2> /dev/null || true
  wait "$SERVE_PID" 2> /dev/null || true
}
if serve good; then
  ok=0
  "$O" update --coordinator "$URL" --token-file "$TOKEN" --checkpoint "$CKPTS/B" > "$UPD/update.txt" 2>&1 || ok=1
  B_VERSION=$(grep -o 'version [0-9a-f]\{16\}' "$UPD/update.txt" | head -1 | cut -d' ' -f2)
  "$O" report --coordinator "$URL" --token-file "$TOKEN" > "$UPD/report.txt" 2>&1 || ok=1
  unserve
  if [ $ok = 0 ] && [ -n "$B_VERSION" ] && grep -q '^CONSISTENT' "$UPD/report.txt" && [ "$(grep -c "cuda.* $B_VERSION " "$UPD/report.txt")" = 2 ]; then
    pass "update on GPU workers: both replicas on $B_VERSION, CONSISTENT ($(grep '^timings' "$UPD/update.txt" | tail -1))"
  else
    fail "update on GPU workers (see $UPD/update.txt, $UPD/report.txt)"
  fi
else
  fail "launch --device cuda --tp 1 --dp 2 --serve (see $UPD/good.err)"
fi
if serve bad --inject-fault 1:stage-skip-permute; then
  if "$O" update --coordinator "$URL" --token-file "$TOKEN" --checkpoint "$CKPTS/B" > "$UPD/update-bad.txt" 2>&1; then
    unserve
    fail "an update whose dp1 stage skipped the permutation succeeded (see $UPD/update-bad.txt)"
  else
    unserve
    if grep -q 'replica dp1: FAILED, kept version' "$UPD/update-bad.txt"; then
      pass "a GPU stage that skipped the permutation was refused: $(grep -o 'replica dp1: FAILED, kept version [0-9a-f]*' "$UPD/update-bad.txt")"
    else
      fail "the bad stage failed for another reason (see $UPD/update-bad.txt)"
    fi
  fi
else
  fail "launch --device cuda --inject-fault (see $UPD/bad.err)"
fi

rm -rf "$CKPTS"

step "GPU benchmarks"
if "$W" bench-cuda --iters 10 | tee "$LOG/bench.txt"; then
  pass "benchmarks (below)"
else
  fail "benchmarks"
fi

echo
echo "== summary ($((SECONDS - START)) s; logs in $LOG)"
printf '%s\n' "${SUMMARY[@]}"
[ -f "$LOG/bench.txt" ] && sed -n '2,$p' "$LOG/bench.txt"
# On the device tool's machines, $OUT comes back: one archive of every log.
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  tar czf "$OUT/gpu-check-logs.tar.gz" -C "$LOG" . && echo "logs: \$OUT/gpu-check-logs.tar.gz"
fi
exit $STATUS
