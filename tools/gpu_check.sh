#!/usr/bin/env bash
# The GPU checks the DDMA and executor issues name, as one script for a lent device machine
# (`run` tool: `bash tools/gpu_check.sh`, results under $OUT). Prepared on a CPU machine and NOT yet
# run on a GPU: read its output critically the first time.
#   1. the gpu-marked tests (CUDA FP8 kernel vs torch, algorithms on CUDA);
#   2. the quickstart for 3 steps with trainer and generator as separate processes on the one GPU
#      (cluster.share_devices), DDMA sync with checksums and the probe every step, phase lines.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-runs/gpu_check}"
mkdir -p "$out"
nvidia-smi > "$out/nvidia_smi.txt" 2>&1
bash tools/setup_env.sh --gpu > "$out/setup.log" 2>&1 || { echo "setup failed (see $out/setup.log)"; exit 1; }
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 240 .venv/bin/python -m pytest -q -m gpu tests > "$out/pytest_gpu.log" 2>&1
echo "gpu tests: exit $? (tail of $out/pytest_gpu.log)"; tail -5 "$out/pytest_gpu.log"
for transport in zero_copy p2p; do
  timeout 300 .venv/bin/megarl train configs/quickstart.yaml name="gpu-$transport" logging.out_dir="$out" \
    controller.steps=3 controller.eval_every=0 trainer.checkpoint_interval=0 cluster.device=cuda \
    cluster.share_devices=true generator.gpu_memory_utilization=0.3 \
    sync.transport="$transport" sync.probe_every=1 > "$out/train_$transport.log" 2>&1
  echo "quickstart on one GPU, sync.transport=$transport: exit $?"
  grep -E "placement|step [0-9]/3|summary|Error|error" "$out/train_$transport.log" | cut -c1-300 | tail -8
done
