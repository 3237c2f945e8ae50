#!/usr/bin/env bash
# Put the wheels tools/gpu_check.sh installs on the lent GPU machine (which has no network) into
# wheels/, for its python (cp312, x86_64 manylinux), each checked against the hash pinned in
# tools/gpu_check_wheels.txt (pip --require-hashes). Run on this side before the device call, then
# carry wheels/ with it (`run` tool: carry ["wheels"]; ~2.8 MB).
#   tools/gpu_check_wheels.sh [DEST]     (default wheels/)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dest="${1:-wheels}"
py="${PYTHON:-.venv/bin/python}"
mkdir -p "$dest"
"$py" -m pip download -q --no-deps --require-hashes --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -r tools/gpu_check_wheels.txt -d "$dest"
ls -l "$dest"/megatron_core-0.16.1-*.whl "$dest"/ninja-*.whl "$dest"/packaging-*.whl "$dest"/safetensors-*.whl "$dest"/pytest-*.whl
