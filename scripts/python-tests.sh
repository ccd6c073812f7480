#!/usr/bin/env bash
# The Python tests: tests/python (/metrics parsed by Prometheus' own Python parsers during a
# rolling update, the Grafana dashboard's queries, JSON logs, manifests and verify-dump on dumps
# Python writes), then the Python client's suite (python/tests). They run the real binaries from
# ORCHESTRATOR_BIN_DIR (default target/debug; build them first), in a venv of their own.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/venv-py
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check "prometheus_client==0.26.*" "pytest==9.*" numpy ml_dtypes xxhash safetensors jsonschema
cargo build --workspace -q
export ORCHESTRATOR_BIN_DIR="${ORCHESTRATOR_BIN_DIR:-$PWD/target/debug}"
"$venv/bin/python" -m pytest -q tests/python "$@"

# The Python client's suite, in a venv of its own, installed as a user would (`pip install
# ./python`, which generates the gRPC stubs from proto/orchestrator.proto with grpcio-tools).
client=target/venv-client
if [ ! -x "$client/bin/python" ]; then
  python3 -m venv "$client"
fi
"$client/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps ./python
"$client/bin/pip" install -q --disable-pip-version-check ./python "pytest==9.*"
"$client/bin/python" -m pytest -q python/tests "$@"
