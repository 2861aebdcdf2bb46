#!/usr/bin/env bash
# The GPU figures of docs/devices.md in one script (about 30 minutes on one H100: each scale grid about 10, the training 3-4):
#   0. benchmarks/step_time.py: plain and gated steps side by side in one process, with kernels, device busy time and
#      the host's waits for the device (about 4 minutes);
#   1. benchmarks/scale.py on the three SmolLM2 shapes in bf16, at the default batch (8) and at 32;
#   2. the default capitals config trained in bf16-mixed (the training's wall time is written to OUT/train_wall_s);
#   3. its lock evaluation on the GPU.
# Usage: bash benchmarks/gpu_check.sh [OUT]      OUT: outputs/gpu_check unless given
#   PYTHON   the interpreter (default: python)
#   TRAIN_ARGS   more training options, e.g. "--trainer.logger false" where W&B is not installed
set -uo pipefail
out=${1:-outputs/gpu_check}
py=${PYTHON:-python}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
$py benchmarks/step_time.py --sizes 135M 1.7B --batch_sizes 8 32 --profile --sync_check --out "$out/step_time" 2>&1 \
  | grep -v "it/s\]" | tee "$out/step_time.log"
for batch in 8 32; do
  $py benchmarks/scale.py --sizes 1.7B 360M 135M --repeats 10 --rounds 1 --batch_size "$batch" \
    --out "$out/scale_b$batch" 2>&1 | grep -v "it/s\]" | tee "$out/scale_b$batch.log"
done
start=$(date +%s)
# shellcheck disable=SC2086  # TRAIN_ARGS is a list of options
$py -m modular train fit --config modular/configs/gate_capitals_smollm2.yaml --trainer.precision bf16-mixed \
  --trainer.enable_progress_bar false --trainer.default_root_dir "$out/run" ${TRAIN_ARGS:-} > "$out/train.log" 2>&1
status=$?
echo $(( $(date +%s) - start )) > "$out/train_wall_s"
echo "training: exit status $status, $(cat "$out/train_wall_s") s (log: $out/train.log)"
grep -a "\[modular\] step" "$out/train.log"
$py -m modular lock --run "$out/run" --device cuda --batch_size 64 > "$out/lock.log" 2>&1
echo "lock evaluation: exit status $? (lock.json and lock.png in $out/run)"
grep -a "\[modular\]" "$out/lock.log" | tail -8
