#!/usr/bin/env bash
# GPU figures for docs/results/, run on a lent CUDA machine whose image has torch and transformers but not
# the rest.
# Prepare the carried packages here first (CPython 3.12 wheels and the sdist-only packages as installed files):
#   scripts/bench/gpu_figures.sh --prepare         # fills .gpu_wheels/ (git-ignored)
# then, on the GPU machine, with .gpu_wheels carried:
#   scripts/bench/gpu_figures.sh                   # output in $OUT (or ./gpu_out)
# Steps (each bounded by `timeout`, a failed one does not stop the next): the seed-style trainer on one GPU (nccl,
# bf16, FSDP2, torch.compile); the inner-loop ratio against a plain FSDP2 loop, eager; a local galaxy of two
# 1-rank clusters sharing the GPU (bf16, int8 pseudo-gradients: θ_outer hashes must match every round); and what a
# checkpoint costs a 96M cluster on the GPU (scripts/bench/checkpoint.py); the quality yardstick
# (scripts/bench/convergence.py --device cuda) at sizes and lengths two CPU cores cannot run. GPU_BUDGET_S bounds
# the whole.
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
  # the yardstick's corpus (this machine's CPython standard library), packed here: the GPU trains on the same
  # tokens, and its image lacks `datasets`, which packing raw text needs
  .venv/bin/python scripts/bench/convergence.py --arms ddp --steps 1 --eval-samples 16 --seeds 0 >/dev/null \
    && rm -rf "$wheels/packed" && cp -r outputs/data_cache/py-*/ "$wheels/packed"
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
  # INNER_LOOPS="plain plain-like-trainer trainer trainer-gc-auto trainer-no-workers" takes the gap apart
  stamp "2. inner loop vs plain FSDP2, eager (${INNER_LOOPS:-plain trainer})"
  timeout "${INNER_TIMEOUT_S:-150}" $py scripts/bench/inner_loop.py --nproc 1 --path-model "$model" \
    --precision bf16-mixed --seq-length 1024 --per-device 16 --total 64 --steps "${INNER_STEPS:-25}" \
    --warmup 8 --repeats 2 --loops "${INNER_LOOPS:-plain trainer}" 2>&1 \
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
if want 6; then
  # The yardstick's processes share the GPU, one per seed and group of arms, each writing its records as its arms
  # finish (a timeout keeps what is done). YARD_SET picks the groups: 25m (the default: the ~25M quick setting
  # over 8 seeds, M=4 and the codecs of issue 16), 2m (the same arms at 2M over 16 seeds), long (the 96M quick
  # setting, ~25M at H = 100 and 500), outer (~25M at H = 100: plain against Nesterov, 4 seeds) or custom
  # (YARD_SEEDS, YARD_ARGS, YARD_ARMS).
  # These 16 processes keep one GPU busy; a 96M DiLoCo arm is slow (its rounds' work runs on the host), so
  # the 96M groups need several times a short lease (GPU_STEPS=6 with a larger GPU_BUDGET_S, or fewer groups;
  # timings in docs/results/training-quality.md and docs/LOG.md). The device returns one tarball.
  stamp "6. quality yardstick on the GPU"
  mkdir -p "$out/yard"
  left=$(( ${GPU_BUDGET_S:-540} - ($(date +%s) - started) - 15 ))
  yard() { local name=$1; shift
    timeout "$left" $py scripts/bench/convergence.py --device cuda --dataset-path "$wheels/packed" \
      --data-cache-dir /tmp/yard_cache --out "$out/yard/$name.jsonl" "$@" >"$out/yard/$name.log" 2>&1 &
  }
  if ! $py scripts/bench/convergence.py --device cuda --quick --model 2m --arms "ddp diloco:M=2,H=1" --steps 2 \
    --eval-samples 16 --dataset-path "$wheels/packed" --data-cache-dir /tmp/yard_cache --seeds 0 \
    >"$out/yard_smoke.log" 2>&1; then
    echo "yardstick smoke run failed:"; tail -20 "$out/yard_smoke.log"
  else
    case "${YARD_SET:-25m}" in
      25m)  # issue 12's M=4 and issue 16's codecs at ~25M, 8 seeds; two processes per seed, each with the arms
            # its ratios need (a codec ÷ dense DiLoCo of the same process)
        for seed in 0 1 2 3 4 5 6 7; do
          yard "25m_m4_s$seed" --model 25m --quick --seeds "$seed" --threads 1 \
            --arms "ddp half:M=4 diloco:M=4,H=20"
          yard "25m_codecs_s$seed" --model 25m --quick --seeds "$seed" --threads 1 --arms "diloco:M=2,H=20 \
diloco:M=2,H=20,codec=sparse diloco:M=2,H=20,codec=sparse,density=0.12 diloco:M=2,H=20,codec=int2 \
diloco:M=2,H=20,codec=int8 diloco:M=2,H=20,codec=int4"
        done ;;
      2m)  # the 2M quick setting over 16 seeds, issue 12's arms and issue 16's codecs: on two CPU cores one seed moves a
           # ratio by ±3 % and 16 seeds of all arms take hours; here one process per seed
        for seed in $(seq 0 15); do
          yard "2m_s$seed" --model 2m --quick --seeds "$seed" --threads 1 --arms "ddp half:M=2 diloco:M=2,H=20 \
diloco:M=2,H=50 half:M=4 diloco:M=4,H=20 diloco:M=2,H=20,codec=int8 diloco:M=2,H=20,codec=int4 \
diloco:M=2,H=20,codec=int2 diloco:M=2,H=20,codec=sparse"
        done ;;
      long)  # the 96M quick setting (2 seeds, lr 1.5e-3) and ~25M over 2,000 steps at H = 100 and 500: several
             # times one short lease (docs/results/training-quality.md has how far one got)
        for seed in 0 1; do
          yard "100m_m2_s$seed" --model 100m --quick --lr 1.5e-3 --seeds "$seed" --threads 2 \
            --arms "ddp half:M=2 diloco:M=2,H=20 diloco:M=2,H=50"
          yard "100m_m4_s$seed" --model 100m --quick --lr 1.5e-3 --seeds "$seed" --threads 2 \
            --arms "half:M=4 diloco:M=4,H=20"
          yard "25m_long_s$seed" --model 25m --quick --steps 2000 --eval-interval 250 --seeds "$seed" --threads 1 \
            --arms "ddp half:M=2"
          yard "25m_longH_s$seed" --model 25m --quick --steps 2000 --eval-interval 250 --seeds "$seed" \
            --threads 1 --arms "diloco:M=2,H=100 diloco:M=2,H=500"
        done ;;
      outer)  # issue 36's question at ~25M: plain averaging against the papers' Nesterov 0.7/0.9 (3 plain
              # warm-up rounds) over 2,000 steps at H = 100, 4 seeds, DDP beside them; one process per seed and arm
        for seed in 0 1 2 3; do
          for named in ddp=ddp plain=diloco:M=2,H=100 nesterov=diloco:M=2,H=100,olr=0.7,mom=0.9,owarm=3; do
            yard "25m_outer_${named%%=*}_s$seed" --model 25m --quick --steps 2000 --eval-interval 250 \
              --seeds "$seed" --threads 1 --arms "${named#*=}"
          done
        done ;;
      custom)  # YARD_ARGS (convergence.py flags) and YARD_ARMS, one process per seed of YARD_SEEDS
        for seed in ${YARD_SEEDS:-0 1}; do
          yard "custom_s$seed" ${YARD_ARGS:-} --seeds "$seed" --threads 1 --arms "${YARD_ARMS:-ddp}"
        done ;;
      *) echo "YARD_SET=${YARD_SET}: not a set (25m, 2m, long, outer, custom)" ;;
    esac
  fi
  (sleep 60; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv) >"$out/yard_gpu_load.txt" 2>&1 &
  wait
  stamp "6. done"; cat "$out/yard_gpu_load.txt"
  tail -n 3 "$out"/yard/*.log
  tar czf "$out/yard.tgz" -C "$out" yard && rm -rf "$out/yard"
fi
stamp "done"
