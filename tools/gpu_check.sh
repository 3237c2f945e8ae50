#!/usr/bin/env bash
# The device check of issue 19, for a lent GPU machine (`run` tool): no network, under 8 minutes,
# non-zero exit on any failure, results as JSON in $OUT/gpu_check.json (else docs/gpu_check.json).
#   1. build megarl._C with its CUDA kernels (nvcc) in place;
#   2. the CUDA FP8 kernel vs the torch reference, bit for bit   (tools/gpu_fp8_check.py);
#   3. CUDA IPC sync, TP2 trainer (2 processes) -> TP1 and TP2 receivers holding CUDA tensors in
#      vLLM's layout: exact, checksums on, device memory flat over the syncs (tools/gpu_ddma_ipc.py);
#   4. megatron-core from the carried wheel: TP1 step + logprobs, GPU vs CPU within a float32-derived
#      bound (tools/gpu_megatron_check.py);
#   5. bench: CUDA IPC sync GB/s vs a device-to-device copy of the same bytes (goal >= 50%).
# Env: PYTHON (default python3), MEGARL_MCORE_WHEEL (default: the first wheels/megatron_core-0.16.1-*.whl),
# MEGARL_GPU_CHECK_PLANT=build|fp8|ipc|megatron|bench plants a failure in that step (the script must
# exit non-zero), MEGARL_GPU_CHECK_DRY=1 runs the same control flow on CPU (steps 1 and 4's wheel skipped).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-docs}"
mkdir -p "$out"
json="$out/gpu_check.json"
py="${PYTHON:-python3}"
dry="${MEGARL_GPU_CHECK_DRY:-0}"
plant="${MEGARL_GPU_CHECK_PLANT:-}"
dryflag=""; [[ "$dry" == 1 ]] && dryflag="--cpu-dry"
export MEGARL_GPU_CHECK_PLANT="$plant" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1
results="$out/gpu_check.steps.jsonl"
: > "$results"
started=$(date +%s)

finish() {  # write the JSON (every step so far) and exit with the given status
  local rc=$1
  "$py" - "$results" "$json" "$rc" "$(( $(date +%s) - started ))" "$dry" <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
doc = {"ok": sys.argv[3] == "0", "seconds": int(sys.argv[4]), "dry_run_on_cpu": sys.argv[5] == "1", "steps": steps}
json.dump(doc, open(sys.argv[2], "w"), indent=1)
print(f"gpu_check: {'OK' if doc['ok'] else 'FAILED'} in {doc['seconds']} s -> {sys.argv[2]}")
PY
  exit "$rc"
}

step() {  # step NAME TIMEOUT_S CMD...: run, keep its last JSON line, stop everything on failure
  local name=$1 limit=$2; shift 2
  local log="$out/gpu_check.$name.log" t0 rc=0
  t0=$(date +%s)
  echo "gpu_check: step $name ..."
  timeout "$limit" "$@" > "$log" 2>&1 || rc=$?
  if [[ "$plant" == "$name" && "$name" == build ]]; then rc=97; fi
  "$py" - "$name" "$rc" "$(( $(date +%s) - t0 ))" "$log" >> "$results" <<'PY'
import json, sys
name, rc, secs, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
lines = open(log, errors="replace").read().splitlines()
detail = None
for line in reversed(lines):
    if line.startswith("{"):
        try:
            detail = json.loads(line)
            break
        except ValueError:
            pass
print(json.dumps({"step": name, "ok": rc == 0, "exit": rc, "seconds": secs, "result": detail,
                  "log_tail": [] if rc == 0 else lines[-15:]}))
PY
  if [[ $rc -ne 0 ]]; then
    echo "gpu_check: step $name FAILED (exit $rc); log: $log" >&2
    tail -15 "$log" >&2 || true
    finish 1
  fi
}

trap 'echo "gpu_check: aborted at line $LINENO" >&2; finish 1' ERR

if [[ "$dry" != 1 ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu_check.nvidia_smi.txt"
  # 1. the extension with its CUDA kernels, built in place against this python's torch (no pip, no network)
  step build 300 env MEGARL_CUDA=1 "$py" setup.py -q build_ext --inplace
  step build_has_cuda_kernels 60 "$py" -c "import json, megarl.native as n; ok = n.native_function('fp8_e4m3_quantize_rows_cuda') is not None; print(json.dumps({'cuda_kernels_bound': ok})); raise SystemExit(0 if ok else 1)"
else
  step build 60 "$py" -c "import json; print(json.dumps({'dry': 'no CUDA build on CPU'}))"
fi
step fp8 120 "$py" tools/gpu_fp8_check.py $dryflag
step ipc 240 "$py" tools/gpu_ddma_ipc.py --syncs 5 $dryflag
if [[ "$dry" != 1 ]]; then
  wheel="${MEGARL_MCORE_WHEEL:-$(ls wheels/megatron_core-0.16.1-*.whl shared/wheels/megatron_core-0.16.1-*.whl 2>/dev/null | head -1 || true)}"
  [[ -n "$wheel" && -f "$wheel" ]] || { echo '{"step":"megatron_wheel","ok":false,"exit":1,"result":{"error":"no megatron_core-0.16.1 wheel (set MEGARL_MCORE_WHEEL)"}}' >> "$results"; finish 1; }
  site="$(mktemp -d)"
  step megatron_install 120 "$py" -m pip install -q --no-index --no-deps --target "$site" "$wheel"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
step megatron 240 "$py" tools/gpu_megatron_check.py $dryflag
step bench 180 "$py" tools/gpu_ddma_ipc.py --bench --trials 3 $dryflag
if [[ "$plant" == bench ]]; then echo '{"step":"bench_goal","ok":false,"exit":1,"result":{"planted":true}}' >> "$results"; finish 1; fi
finish 0
