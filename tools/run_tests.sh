#!/usr/bin/env bash
# The test command: installs what is missing (tools/setup_env.sh), then runs the default suite
# (everything not marked gpu or slow). Extra arguments go to pytest, e.g. `-m slow` or `-k generator`.
# `--fast` first: only the tests that start no vLLM engine, no Megatron and no megarl command
# (tests/fast_tier.py; a few minutes), each guarded so that one that starts a process fails.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash tools/setup_env.sh
venv="${MEGARL_VENV:-$root/.venv}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The C++ extension must have built: its tests fail instead of skipping.
export MEGARL_REQUIRE_NATIVE=1
if [[ "${1:-}" == "--fast" ]]; then
    shift
    export MEGARL_FAST_TESTS=1
    set -- -m "not gpu and not slow and not processes" "$@"
fi
exec "$venv/bin/python" -m pytest "$@"
