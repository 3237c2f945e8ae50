#!/usr/bin/env bash
# The device check for a lent GPU machine (`run` tool): no network, one overall deadline that fits one
# 10-minute call (default 470 s), every step independent (a failed step never skips the others), the
# JSON ($OUT/gpu_check.json, else docs/gpu_check.json) rewritten after every step and on a kill, and a
# non-zero exit if any step failed or was skipped for lack of time. Steps, in order of risk:
#   ipc        CUDA IPC sync between processes, exact vs the plan on CPU, checksums on, memory flat
#              (tools/gpu_ddma_ipc.py);
#   trainer    megarl's own trainer (build_gpt_model, DDP, the Megatron optimizer, bf16): logprobs and a
#              step, GPU vs CPU (CUDA hidden) within a bf16-derived bound, then make_sender over the live
#              parameters into a cuda_ipc receiver, exact                  (tools/gpu_trainer_check.py);
#   trainer_scale  the trainer at a ~200M shape: a step's peak memory against the dry run's memory plan for
#              the same shape, and a save/resume bit for bit          (tools/gpu_trainer_scale_check.py);
#   megatron   megatron-core from the carried wheel: a TP1 step + logprobs, GPU vs CPU (CUDA hidden)
#              within a float32-derived bound (tools/gpu_megatron_check.py);
#   build      megarl._C with its CUDA kernels (nvcc; ninja from the carried wheels when there), timed;
#   fp8        the CUDA FP8 kernel vs the torch reference, bit for bit       (tools/gpu_fp8_check.py);
#   checksum   the CUDA digest kernel vs the CPU kernel and torch, to the bit; planted corruptions
#              caught; its GB/s beside a d2d copy, reported               (tools/gpu_checksum_check.py);
#   nccl       the nccl transport's calls on a 1-rank ProcessGroupNCCL, and its CUDA packing and landing
#              of a 1B worker's sync (TP2 -> TP1) equal to its host path     (tools/gpu_nccl_check.py);
#   bench      CUDA IPC sync GB/s vs a device-to-device copy of the same bytes at a 1B shape, with checksums
#              and without; goal >= 50% without, enforced; the fixed cost (the 1B's parameters at width 64);
#   ipc_8b     the fp8 CUDA IPC sync at an 8B layer's width, TP2 -> TP2, exact, each worker's landing tables
#              (index memory) under 16 MiB, vs 16 B per element before (tools/gpu_ddma_ipc.py --width 8b);
#   gpu_tests  the test suite's `gpu`-marked tests (pytest from the carried wheels).
# Env: PYTHON (default python3); MEGARL_MCORE_WHEEL (default: wheels/ or shared/wheels/
#   megatron_core-0.16.1-*.whl: tools/gpu_check_wheels.sh puts it there, hash-checked, before the call);
#   MEGARL_GPU_CHECK_DEADLINE_S (default 470); MEGARL_GPU_CHECK_STEPS (comma list, default all);
#   MEGARL_GPU_CHECK_IPC_CASES (tools/gpu_ddma_ipc.py --cases, default all four);
#   MEGARL_GPU_CHECK_PLANT=build|fp8|checksum|ipc|trainer|scale|megatron|nccl|bench|ipc_8b plants a failure in that step (the script must exit
#   non-zero); MEGARL_GPU_CHECK_DRY=1 runs the same control flow on CPU (no CUDA build, no wheel).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-docs}"
mkdir -p "$out"
json="$out/gpu_check.json"
py="${PYTHON:-python3}"
dry="${MEGARL_GPU_CHECK_DRY:-0}"
plant="${MEGARL_GPU_CHECK_PLANT:-}"
deadline_s="${MEGARL_GPU_CHECK_DEADLINE_S:-470}"
only="${MEGARL_GPU_CHECK_STEPS:-ipc,trainer,trainer_scale,megatron,build,fp8,checksum,nccl,bench,ipc_8b,gpu_tests}"
dryflag=""; [[ "$dry" == 1 ]] && dryflag="--cpu-dry"
export MEGARL_GPU_CHECK_PLANT="$plant" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1
results="$out/gpu_check.steps.jsonl"
: > "$results"
started=$(date +%s)
failed=0
current=""

write_json() {  # write_json STATE: the JSON of every step so far (STATE: running | done | killed)
  "$py" - "$results" "$json" "$1" "$failed" "$(( $(date +%s) - started ))" "$dry" "$deadline_s" "$current" <<'PY'
import json, sys
results, path, state, failed, secs, dry, deadline, current = sys.argv[1:9]
steps = [json.loads(l) for l in open(results) if l.strip()]
doc = {"ok": state == "done" and failed == "0" and all(s["ok"] for s in steps), "state": state,
       "seconds": int(secs), "deadline_s": int(deadline), "dry_run_on_cpu": dry == "1", "steps": steps}
if state == "killed":
    doc["killed_during"] = current or None
json.dump(doc, open(path + ".tmp", "w"), indent=1)
import os
os.replace(path + ".tmp", path)
PY
}

on_kill() {
  trap - TERM INT
  echo "gpu_check: killed during step ${current:-none}" >&2
  [[ -n "${child:-}" ]] && kill -TERM "$child" 2>/dev/null
  write_json killed
  exit 1
}
trap on_kill TERM INT

record() {  # record NAME RC SECONDS LOG [NOTE]: one line of the steps file
  "$py" - "$@" >> "$results" <<'PY'
import json, sys
name, rc, secs, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
note = sys.argv[5] if len(sys.argv) > 5 else None
try:
    lines = open(log, errors="replace").read().splitlines()
except OSError:
    lines = []
detail = None
for line in reversed(lines):
    if line.startswith("{"):
        try:
            detail = json.loads(line)
            break
        except ValueError:
            pass
print(json.dumps({"step": name, "ok": rc == 0, "exit": rc, "seconds": secs, "result": detail, "note": note,
                  "log_tail": [] if rc == 0 else lines[-15:]}))
PY
}

step() {  # step NAME LIMIT_S CMD...: run within min(LIMIT_S, time left), record it, never stop the script
  local name=$1 limit=$2; shift 2
  local log="$out/gpu_check.$name.log" t0 rc=0 left
  left=$(( deadline_s - ($(date +%s) - started) - 10 ))  # 10 s kept for the last JSON
  if (( left < 15 )); then
    echo "gpu_check: step $name skipped: ${left} s left of ${deadline_s}" >&2
    : > "$log"
    record "$name" 124 0 "$log" "skipped: no time left in the ${deadline_s} s deadline"
    failed=1; write_json running; return
  fi
  (( limit > left )) && limit=$left
  t0=$(date +%s); current=$name
  echo "gpu_check: step $name (limit $limit s) ..."
  timeout -k 5 "$limit" "$@" > "$log" 2>&1 &
  child=$!
  wait "$child" || rc=$?
  child=""
  if [[ "$plant" == "$name" && "$name" == build ]]; then rc=97; fi
  record "$name" "$rc" "$(( $(date +%s) - t0 ))" "$log" "$([[ $rc == 124 ]] && echo "timed out after $limit s")"
  if [[ $rc -ne 0 ]]; then
    failed=1
    echo "gpu_check: step $name FAILED (exit $rc); log: $log" >&2
    tail -15 "$log" >&2
  fi
  current=""
  write_json running
}

wants() { [[ ",$only," == *",$1,"* ]]; }

write_json running
if [[ "$dry" != 1 ]]; then
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu_check.nvidia_smi.txt" 2>&1 || true
  else
    echo "nvidia-smi not found" > "$out/gpu_check.nvidia_smi.txt"
  fi
fi

# Carried wheels (tools/gpu_check_wheels.sh): ninja makes torch's extension build parallel.
wheels=""
for d in wheels shared/wheels; do [[ -d "$d" ]] && wheels="$d" && break; done
if [[ -n "$wheels" ]] && ls "$wheels"/ninja-*.whl > /dev/null 2>&1 && ! command -v ninja > /dev/null; then
  tools_site="$(mktemp -d)"
  "$py" -m pip install -q --no-index --no-deps --target "$tools_site" "$wheels"/ninja-*.whl > /dev/null 2>&1 \
    && export PATH="$tools_site/bin:$PATH" PYTHONPATH="$tools_site${PYTHONPATH:+:$PYTHONPATH}"
fi

# In order of risk (issue 30); none needs another's result: ipc and megatron run without the extension.
wants ipc && step ipc 180 "$py" tools/gpu_ddma_ipc.py --syncs 4 --cases "${MEGARL_GPU_CHECK_IPC_CASES:-bf16,fp32,fp8,flat}" $dryflag
if wants megatron || wants trainer || wants trainer_scale; then
  if [[ "$dry" != 1 ]]; then
    wheel="${MEGARL_MCORE_WHEEL:-$(ls wheels/megatron_core-0.16.1-*.whl shared/wheels/megatron_core-0.16.1-*.whl 2>/dev/null | head -1)}"
    if [[ -n "$wheel" && -f "$wheel" ]]; then
      site="$(mktemp -d)"
      # megatron imports packaging; megarl's trainer reads safetensors (the machine has neither, maybe)
      extra=$(ls "$(dirname "$wheel")"/packaging-*.whl "$(dirname "$wheel")"/safetensors-*.whl 2>/dev/null)
      step megatron_install 60 "$py" -m pip install -q --no-index --no-deps --target "$site" "$wheel" $extra
      export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    else
      : > "$out/gpu_check.megatron_install.log"
      record megatron_install 1 0 "$out/gpu_check.megatron_install.log" \
        "no megatron_core-0.16.1 wheel in wheels/ or shared/wheels/ (run tools/gpu_check_wheels.sh first, or set MEGARL_MCORE_WHEEL)"
      failed=1; write_json running
    fi
  fi
  wants trainer && step trainer 150 "$py" tools/gpu_trainer_check.py $dryflag
  wants trainer_scale && step trainer_scale 200 "$py" tools/gpu_trainer_scale_check.py $dryflag
  wants megatron && step megatron 120 "$py" tools/gpu_megatron_check.py $dryflag
fi
if wants build; then
  if [[ "$dry" != 1 ]]; then
    # the extension with its CUDA kernels, built in place against this python's torch (no pip, no network)
    step build 240 env MEGARL_CUDA=1 MAX_JOBS=16 "$py" setup.py -q build_ext --inplace
    step build_has_cuda_kernels 30 "$py" -c "import json, megarl.native as n; ok = all(n.native_function(f) is not None for f in ('fp8_e4m3_quantize_rows_cuda', 'weighted_checksum_segments_cuda', 'weighted_checksum_segments_cuda_add')); print(json.dumps({'cuda_kernels_bound': ok})); raise SystemExit(0 if ok else 1)"
  else
    step build 30 "$py" -c "import json; print(json.dumps({'dry': 'no CUDA build on CPU'}))"
  fi
fi
wants fp8 && step fp8 90 "$py" tools/gpu_fp8_check.py $dryflag
wants checksum && step checksum 90 "$py" tools/gpu_checksum_check.py $dryflag
wants nccl && step nccl 90 "$py" tools/gpu_nccl_check.py $dryflag
# the goal at Llama-3.2-1B's shape (3.0 GB; the CPU dry run: the 306 MB one), then the same parameters at width
# 64 (the sync's fixed cost), reported
wants bench && step bench 150 "$py" tools/gpu_ddma_ipc.py --bench --trials 3 \
  --bench-model "$([[ $dry == 1 ]] && echo small || echo 1b),1b_narrow" $dryflag
# two syncs on a GPU (the second lands through the tables built at the first); one in the CPU dry run, whose
# CPU reference of a 4096 x 14336 layer takes minutes on a small host
wants ipc_8b && step ipc_8b 150 "$py" tools/gpu_ddma_ipc.py --width 8b --syncs "$([[ $dry == 1 ]] && echo 1 || echo 2)" $dryflag
if wants gpu_tests; then
  if [[ "$dry" != 1 ]] && ! "$py" -c "import pytest" 2> /dev/null && [[ -n "$wheels" ]]; then
    test_site="$(mktemp -d)"  # pytest and its dependencies from the carried wheels (tools/gpu_check_wheels.txt)
    "$py" -m pip install -q --no-index --no-deps --target "$test_site" "$wheels"/pytest-*.whl "$wheels"/pluggy-*.whl \
      "$wheels"/iniconfig-*.whl "$wheels"/pygments-*.whl > /dev/null 2>&1 \
      && export PYTHONPATH="$test_site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  # on CPU (the dry run) the gpu-marked tests skip themselves: the step checks the command runs
  step gpu_tests 150 "$py" -m pytest -q -m gpu -p no:cacheprovider tests/
fi
write_json done
echo "gpu_check: $([[ $failed == 0 ]] && echo OK || echo FAILED) in $(( $(date +%s) - started )) s -> $json"
exit "$failed"
