#!/usr/bin/env bash
# Compile every CUDA source under csrc/ with nvcc, object files only, for the GPU generations setup.py
# builds (megarl/cuda_archs.py: SASS for sm_80, sm_89, sm_90, sm_100 that this nvcc can build, PTX for the
# newest). Needs no GPU and no torch: the .cu files include only CUDA toolkit headers.
#   tools/compile_cuda.sh            # objects in build/ (csrc/cuda/x.cu -> build/cuda/x.o)
#   NVCC=/path/to/nvcc MEGARL_CUDA_ARCHS=9.0 tools/compile_cuda.sh
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

nvcc="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$nvcc" && -x /usr/local/cuda/bin/nvcc ]]; then
  nvcc=/usr/local/cuda/bin/nvcc
fi
if [[ -z "$nvcc" ]]; then
  echo "compile_cuda.sh: nvcc not found (looked at \$NVCC, PATH and /usr/local/cuda/bin);" \
       "install the CUDA toolkit or set NVCC=/path/to/nvcc" >&2
  exit 1
fi

# setup.py's own choice of -gencode flags (megarl/cuda_archs.py, loaded by path: no megarl install needed)
mapfile -t gencode < <(NVCC_LISTED="$("$nvcc" --list-gpu-arch 2>/dev/null || true)" python3 - <<'PY'
import importlib.util, os
spec = importlib.util.spec_from_file_location("cuda_archs", "megarl/cuda_archs.py")
archs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(archs)
env = os.environ.get(archs.ARCHS_ENV, "").strip()
flags, dropped = archs.gencode_flags(archs.parse_archs(env) if env else archs.DEFAULT_ARCHS,
                                     os.environ["NVCC_LISTED"].split() or None)
print("\n".join(flags))
PY
)
out_dir="${OUT_DIR:-build}"
mkdir -p "$out_dir"
echo "compile_cuda.sh: $("$nvcc" --version | tail -n 2 | head -n 1) -> $out_dir (${gencode[*]})"

mapfile -t sources < <(find csrc -name '*.cu' | sort)
if [[ ${#sources[@]} -eq 0 ]]; then
  echo "compile_cuda.sh: no .cu files under csrc/" >&2
  exit 1
fi

for src in "${sources[@]}"; do
  obj="$out_dir/${src#csrc/}"
  obj="${obj%.cu}.o"
  mkdir -p "$(dirname "$obj")"
  echo "  nvcc $src -> $obj"
  "$nvcc" "${gencode[@]}" -std=c++17 -O3 -Xcompiler -Wall -Werror all-warnings \
    -Icsrc -c "$src" -o "$obj"
done
echo "compile_cuda.sh: compiled ${#sources[@]} CUDA source(s) OK"
