#!/usr/bin/env bash
# The test command: installs what is missing (tools/setup_env.sh), then runs the default suite
# (everything not marked gpu or slow). Extra arguments go to pytest, e.g. `-m slow` or `-k generator`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash tools/setup_env.sh
venv="${MEGARL_VENV:-$root/.venv}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The C++ extension must have built: its tests fail instead of skipping.
export MEGARL_REQUIRE_NATIVE=1
exec "$venv/bin/python" -m pytest "$@"
