#!/usr/bin/env bash
# From the meta device to the first inner step on one CUDA GPU (issue 36): `--dry-run` of the 7B config
# (when the GPU has room for it, ≥ 120 GiB: an H200) and of the 3B config, 1 rank, bf16-mixed, activation
# checkpointing, eager, seq 2048 x 1. Each prints a line (memory, seconds) and a JSON line; under 4 minutes
# on an H200.
#   scripts/bench/gpu_meta_first_step.sh            # output in $OUT (or ./gpu_out)
# The GPU image has torch and transformers but not the rest of the project's packages: prepare them here once
# with `scripts/bench/gpu_figures.sh --prepare` and carry .gpu_wheels (without it the image's python is used
# as it is).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
out="${OUT:-gpu_out}"
mkdir -p "$out"
started=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - started )) s)" | tee -a "$out/first_step.txt"; }

stamp "setup"
if [ -d .gpu_wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_wheels/*.whl \
    >"$out/pip.log" 2>&1 || tail -5 "$out/pip.log"
  [ -d .gpu_wheels/site ] && cp -r .gpu_wheels/site/* /tmp/site/
fi
export PYTHONPATH="/tmp/site:$PWD" HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$out/first_step.txt"
gib=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory // 2**30)")
models="3b"
[ "$gib" -ge 120 ] && models="7b 3b"

for size in $models; do
  stamp "dry run, llama-$size-fresh, 1 GPU, bf16-mixed, activation checkpointing"
  # one rank: no torchrun needed (a one-rank process group over an in-memory store, nccl on CUDA)
  timeout 120 python3 open_diloco/train_fsdp.py --dry-run --path-model "configs/models/llama-$size-fresh" \
    --device cuda --precision bf16-mixed --activation-checkpointing --no-torch-compile --seq-length 2048 \
    --per-device-train-batch-size 1 --total-batch-size 1 >"$out/dry_run_$size.log" 2>&1
  echo "rc $?" | tee -a "$out/first_step.txt"
  grep -E "^dry run|^\{\"dry_run\"|Error|error" "$out/dry_run_$size.log" | tail -4 \
    | tee -a "$out/first_step.txt"
done
stamp "done"
