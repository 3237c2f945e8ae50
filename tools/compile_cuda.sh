#!/usr/bin/env bash
# Compile every CUDA source under csrc/ for Hopper (sm_90) with nvcc, object files only.
# Needs no GPU and no torch: the .cu files include only CUDA toolkit headers.
#   tools/compile_cuda.sh            # objects in build/ (csrc/cuda/x.cu -> build/cuda/x.o)
#   NVCC=/path/to/nvcc CUDA_ARCH=sm_100 tools/compile_cuda.sh
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

arch="${CUDA_ARCH:-sm_90}"
out_dir="${OUT_DIR:-build}"
mkdir -p "$out_dir"
echo "compile_cuda.sh: $("$nvcc" --version | tail -n 2 | head -n 1) -> $out_dir (arch $arch)"

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
  "$nvcc" -arch="$arch" -std=c++17 -O3 -Xcompiler -Wall -Werror all-warnings \
    -Icsrc -c "$src" -o "$obj"
done
echo "compile_cuda.sh: compiled ${#sources[@]} CUDA source(s) OK"
