#!/usr/bin/env bash
# Run a megarl job on this machine: sets up .venv if needed, then `megarl train CONFIG [overrides]`.
#   bash launch/local.sh configs/quickstart.yaml controller.steps=5
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash tools/setup_env.sh
venv="${MEGARL_VENV:-$root/.venv}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$venv/bin/megarl" train "${1:-configs/quickstart.yaml}" "${@:2}"
