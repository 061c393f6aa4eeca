#!/usr/bin/env bash
# GPU figures for the README, run on a lent CUDA machine (see scripts/bench/README section in README.md):
# installs the carried wheels (.gpu_wheels/, cp312) that the machine's image lacks, then runs the trainer
# on nccl + bf16 + FSDP2 (+ torch.compile) and the inner-loop benchmark. Output goes to $OUT (or ./gpu_out).
set -euo pipefail
out="${OUT:-gpu_out}"
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --find-links .gpu_wheels .gpu_wheels/*.whl >"$out/pip.log" 2>&1 || cat "$out/pip.log"
export PYTHONPATH="$PWD" HF_HUB_OFFLINE=1 WANDB_MODE=disabled
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
model=configs/models/llama-100m-fresh
# 1. the seed-style command on one GPU, bf16 + compile, with metrics
python3 -m torch.distributed.run --standalone --nproc_per_node=1 open_diloco/train_fsdp.py --fake-data \
  --path-model "$model" --seq-length 1024 --per-device-train-batch-size 16 --total-batch-size 64 --lr 3e-3 \
  --max-steps 60 --log-interval 10 --torch-compile --metric-logger-type jsonl --metrics-path "$out/train_gpu.jsonl" \
  2>&1 | grep -v "^W" | tee "$out/train_gpu.log" | tail -8
# 2. inner-loop ratio, eager and compiled
python3 scripts/bench/inner_loop.py --nproc 1 --path-model "$model" --precision bf16-mixed --seq-length 1024 \
  --per-device 16 --total 64 --steps 25 --warmup 8 --repeats 2 | tee "$out/inner_loop_eager.txt"
python3 scripts/bench/inner_loop.py --nproc 1 --path-model "$model" --precision bf16-mixed --seq-length 1024 \
  --per-device 16 --total 64 --steps 25 --warmup 8 --repeats 1 --torch-compile | tee "$out/inner_loop_compile.txt"
