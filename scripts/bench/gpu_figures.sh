#!/usr/bin/env bash
# GPU figures for the README, run on a lent CUDA machine whose image has torch and transformers but not the rest.
# Prepare the carried packages here first (CPython 3.12 wheels and the sdist-only packages as installed files):
#   scripts/bench/gpu_figures.sh --prepare         # fills .gpu_wheels/ (git-ignored)
# then, on the GPU machine, with .gpu_wheels carried:
#   scripts/bench/gpu_figures.sh                   # output in $OUT (or ./gpu_out)
# Steps (each bounded by `timeout`, a failed one does not stop the next): the seed-style trainer on one GPU (nccl,
# bf16, FSDP2, torch.compile); the inner-loop ratio against a plain FSDP2 loop, eager; a local galaxy of two
# 1-rank clusters sharing the GPU (bf16, int8 pseudo-gradients: θ_outer hashes must match every round); and what a
# checkpoint costs a 96M cluster on the GPU (scripts/bench/checkpoint.py). GPU_BUDGET_S bounds the whole.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
wheels=.gpu_wheels
if [ "${1:-}" = "--prepare" ]; then
  mkdir -p "$wheels/site"
  site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  for spec in $(.venv/bin/python -m pip list --format freeze 2>/dev/null | grep -i -E "^(cyclopts|docstring.parser|\
rich.rst|rich|docutils|torchdata|pydantic|pydantic.core|annotated.types|typing.inspection|typing.extensions|\
cryptography|cffi|base58|configargparse|netaddr|protobuf|py.cid|py.multihash|py.multibase|py.multicodec|morphys|\
blake3|mmh3)=="); do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 -d "$wheels" "$spec" || echo "no cp312 wheel for $spec"
  done
  # sdist-only on PyPI (hivemind carries its p2pd binary): the installed files travel as they are
  for pkg in hivemind varint.py prefetch_generator baseconv.py; do cp -r "$site/$pkg" "$wheels/site/"; done
  find "$wheels/site" -name __pycache__ -prune -exec rm -rf {} +
  du -sh "$wheels"
  exit 0
fi

out="${OUT:-gpu_out}"
mkdir -p "$out"
started=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - started )) s)"; }
stamp "setup"
# the carried packages go to /tmp/site (torch, transformers, numpy stay the image's); hivemind-dht beside the
# image's python, where the galaxy harness and run_galaxy.sh look for it
py=$(python3 -c "import sys; print(sys.executable)")
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $wheels/*.whl >"$out/pip.log" 2>&1 \
  || tail -5 "$out/pip.log"
cp -r $wheels/site/* /tmp/site/
printf '#!%s\nfrom hivemind.hivemind_cli.run_dht import main\nmain()\n' "$py" >"$(dirname "$py")/hivemind-dht"
chmod +x "$(dirname "$py")/hivemind-dht"
export PYTHONPATH="/tmp/site:$PWD" HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
$py -c "import torch, transformers, hivemind, numpy; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'hivemind', hivemind.__version__, 'numpy', numpy.__version__, 'cpus', __import__('os').cpu_count())" \
  | tee -a "$out/gpu.txt"
model=configs/models/llama-100m-fresh

# GPU_STEPS="2 4" runs only those steps (a rerun after one failed)
want() { [ -z "${GPU_STEPS:-}" ] || [[ " $GPU_STEPS " == *" $1 "* ]]; }

if want 1; then
  stamp "1. seed-style trainer, 1 GPU, bf16 + torch.compile"
  timeout 180 $py -m torch.distributed.run --standalone --nproc_per_node=1 open_diloco/train_fsdp.py --fake-data \
    --path-model "$model" --seq-length 1024 --per-device-train-batch-size 16 --total-batch-size 64 --lr 3e-3 \
    --max-steps 60 --log-interval 10 --torch-compile --metric-logger-type jsonl \
    --metrics-path "$out/train_gpu.jsonl" 2>&1 | grep -v "^W" >"$out/train_gpu.log"; tail -4 "$out/train_gpu.log"
fi
if want 2; then
  stamp "2. inner loop vs plain FSDP2, eager"
  timeout 150 $py scripts/bench/inner_loop.py --nproc 1 --path-model "$model" --precision bf16-mixed \
    --seq-length 1024 --per-device 16 --total 64 --steps 25 --warmup 8 --repeats 2 2>&1 \
    | tee "$out/inner_loop_eager.txt" | tail -6
fi
if want 3; then
  stamp "3. galaxy of two 1-rank clusters on the GPU, bf16, ${GALAXY_CODEC:-int8}"
  PYTHON=$py timeout 150 scripts/run_galaxy.sh --clusters 2 --ranks 1 --steps 60 --local-steps 20 -- \
    --path-model "$model" --precision bf16-mixed --hv.compression "${GALAXY_CODEC:-int8}" --seq-length 256 \
    --per-device-train-batch-size 8 >"$out/galaxy_gpu.log" 2>&1; echo "rc $?"; tail -12 "$out/galaxy_gpu.log"
fi
if want 4; then
  stamp "4. checkpoint cost on the GPU, 96M: save/load, and a round with no / blocking / background save"
  left=$(( ${GPU_BUDGET_S:-540} - ($(date +%s) - started) - 10 ))
  [ "$left" -gt 30 ] && timeout "$left" $py scripts/bench/checkpoint.py "$model" --rounds 4 --local-steps 6 2>&1 \
    | tee "$out/checkpoint.txt" | tail -14
fi
if want 5; then
  stamp "5. inner loop vs plain FSDP2, torch.compile"
  timeout 200 $py scripts/bench/inner_loop.py --nproc 1 --path-model "$model" --precision bf16-mixed \
    --seq-length 1024 --per-device 16 --total 64 --steps 25 --warmup 8 --repeats 1 --torch-compile 2>&1 \
    | tee "$out/inner_loop_compile.txt" | tail -6
fi
stamp "done"
