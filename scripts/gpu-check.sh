#!/usr/bin/env bash
# GPU acceptance check (one GPU; about 5-8 minutes on an H200):
#   0. checks kernels.cu compiled for the host against the CPU backend (no GPU needed);
#   1. builds everything with the `cuda` feature;
#   2. runs every GPU test (kernels and worker: each op against the CPU backend byte for byte,
#      whole-rank loads at TP 1/2/4/8, the device probe, NCCL with world size 1 and a missing
#      peer) and fails if any of them skipped for lack of CUDA;
#   3. the 8-layer dsv41-flash checkpoint at TP 1/2/4/8: GPU kernel digests equal the CPU's;
#   4. `orchestrator-worker load --device cuda` against `--device cpu` (kernel, source and y
#      digests equal);
#   5. the GPU benchmarks; then a summary.
set -euo pipefail
cd "$(dirname "$0")/.."
FEATURES=orchestrator-worker/cuda,orchestrator-coordinator/cuda
LOG=$(mktemp -d)
declare -a SUMMARY=()
step() { echo; echo "== $*"; }
pass() { SUMMARY+=("[ ok ] $*"); }
fail() { SUMMARY+=("[FAIL] $*"); STATUS=1; }
STATUS=0
START=$SECONDS

step "GPU"
nvidia-smi -L || echo "(nvidia-smi not available)"

step "kernels.cu compiled for the host, against the CPU backend"
if scripts/check_kernels_on_host.sh > "$LOG/host.txt" 2>&1; then
  pass "kernels.cu on the host reproduces the CPU bytes"
else
  fail "kernels.cu on the host (see $LOG/host.txt)"
fi

step "build --release --features cuda"
cargo build --release --workspace --features "$FEATURES"
pass "release build with --features cuda"

step "GPU tests (release)"
if cargo test --release --features orchestrator-worker/cuda -p orchestrator-kernels -p orchestrator-worker --test cuda -- --nocapture --test-threads 1 \
    2>&1 | tee "$LOG/tests.txt"; then
  if grep -q "skipped: no CUDA" "$LOG/tests.txt"; then
    fail "GPU tests skipped: no usable CUDA on this machine"
  else
    pass "GPU tests: $(grep -o 'test result: ok. [0-9]* passed' "$LOG/tests.txt" | awk '{s += $4} END {print s}') passed"
  fi
else
  fail "GPU tests (see $LOG/tests.txt)"
fi

step "8-layer dsv41-flash checkpoint, TP 1/2/4/8: GPU kernel digests vs CPU"
if cargo test --release --features orchestrator-worker/cuda -p orchestrator-worker --test cuda -- --ignored --nocapture \
    2>&1 | tee "$LOG/ckpt.txt" && ! grep -q "skipped: no CUDA" "$LOG/ckpt.txt"; then
  pass "8-layer dsv41-flash: $(grep -c 'on both' "$LOG/ckpt.txt") ranks with identical GPU/CPU kernel digests"
else
  fail "8-layer dsv41-flash digests (see $LOG/ckpt.txt)"
fi

step "orchestrator-worker load --device cuda vs --device cpu (dsv41-flash, 2 layers, TP 1, probe)"
W=target/release/orchestrator-worker
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
exit $STATUS
