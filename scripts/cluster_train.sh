#!/usr/bin/env bash
# Launch this node's part of one cluster: preflight checks, then torchrun (c10d rendezvous), logged per node.
# Run `scripts/cluster_train.sh --help` for the arguments and environment variables.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/cluster_train.sh [CONFIG] [NUM_NODES] [NODE_RANK] [MASTER_ADDR] [MASTER_PORT] [TRAINER FLAGS...]

Start this node's share of one cluster (one torchrun job training one replica with FSDP2). Run it once per
node, with the same CONFIG, NUM_NODES, MASTER_ADDR and MASTER_PORT everywhere and a distinct NODE_RANK.

Positionals (each optional; the first argument starting with -- ends them):
  CONFIG        TOML/YAML/JSON config file (default: configs/demo-2m.toml of this checkout). Relative paths
                inside it start at the current directory.
  NUM_NODES     nodes in this cluster (default 1)
  NODE_RANK     0 on the node at MASTER_ADDR (it hosts the rendezvous), 1..NUM_NODES-1 elsewhere (default 0)
  MASTER_ADDR   host of node 0, reachable from every node (default 127.0.0.1)
  MASTER_PORT   rendezvous port on MASTER_ADDR (default 29500)
  TRAINER FLAGS passed through to the trainer and override CONFIG, e.g. --hv.world-rank 1 --max-steps 100

Environment:
  NPROC_PER_NODE     ranks on this node (default: the GPUs visible, else 1 on CPU)
  BACKEND            nccl or gloo, passed as --backend (default: nccl with GPUs, else gloo)
  LOG_LEVEL          INFO (default) or DEBUG (torch.distributed, NCCL and hivemind debug output)
  CONDA_ENV | VENV   conda environment name / virtualenv directory to activate first
  LOG_DIR            where logs go (default logs/distributed_training under the current directory)
  PREFLIGHT_TIMEOUT  seconds per network check (default 5)
  MASTER_WAIT        seconds node_rank > 0 waits for node 0 to listen (default 60)
  RDZV_ID            rendezvous id shared by the nodes (default: SLURM/PBS job id, else open_diloco)
  RDZV_TIMEOUT       seconds torchrun waits for all nodes to join (default 600)
  MAX_RESTARTS       times torchrun restarts the cluster's ranks after one dies (default 0). With it, pass
                     --ckpt.resume auto (and a --ckpt.interval): a restart resumes from the newest checkpoint,
                     or starts fresh and joins from the galaxy's peers when there is none yet
  LOCAL_ADDR         address other nodes reach this one at (default: MASTER_ADDR on node 0, else this
                     host's address on the route to MASTER_ADDR)

Before torchrun starts, `open-diloco preflight` checks the config, the Python environment, the GPUs (when
nccl is asked for), the master (node_rank > 0), the DHT initial peers (when --hv.* is set) and a one-rank
torch.distributed init, printing PASS/FAIL per check with the fix. A failure exits non-zero and nothing starts.

Logs: LOG_DIR/cluster_train_<YYYYmmdd_HHMMSS>_node<NODE_RANK>.log holds this script's, preflight's,
torchrun's and every local rank's output (the step lines come from global rank 0, on whichever node the
rendezvous gave group rank 0); LOG_DIR/cluster_train_latest_node<NODE_RANK>.log links to the newest one.
With c10d rendezvous torchrun assigns group ranks itself: NODE_RANK names the log, picks the node that hosts
the rendezvous store and whether preflight checks the master.

Exit status: torchrun's; 1 when a preflight check failed; 2 for a usage error.
EOF
}

die() { echo "cluster_train: error: $*" >&2; exit 2; }

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then usage; exit 0; fi

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
positional=("$repo_root/configs/demo-2m.toml" 1 0 127.0.0.1 29500)
for i in 0 1 2 3 4; do
  [[ $# -gt 0 && "$1" != --* ]] || break
  positional[i]="$1"
  shift
done
config="${positional[0]}" num_nodes="${positional[1]}" node_rank="${positional[2]}"
master_addr="${positional[3]}" master_port="${positional[4]}"
[[ "$num_nodes" =~ ^[1-9][0-9]*$ ]] || die "NUM_NODES must be a positive integer, got '$num_nodes' (see --help)"
[[ "$node_rank" =~ ^[0-9]+$ && "$node_rank" -lt "$num_nodes" ]] \
  || die "NODE_RANK must be in 0..$((num_nodes - 1)), got '$node_rank' (see --help)"
[[ "$master_port" =~ ^[0-9]+$ && "$master_port" -ge 1 && "$master_port" -le 65535 ]] \
  || die "MASTER_PORT must be a port number, got '$master_port' (see --help)"

# Activate the environment before anything asks which python or torchrun to use.
if [[ -n "${CONDA_ENV:-}" ]]; then
  command -v conda >/dev/null || die "CONDA_ENV=$CONDA_ENV but conda is not on PATH"
  set +u  # conda's activation scripts read unset variables
  eval "$(conda shell.bash hook)"
  conda activate "$CONDA_ENV"
  set -u
elif [[ -n "${VENV:-}" ]]; then
  [[ -f "$VENV/bin/activate" ]] || die "VENV=$VENV has no bin/activate: point it at a virtualenv directory"
  set +u
  # shellcheck disable=SC1091  # the virtualenv is chosen at run time
  source "$VENV/bin/activate"
  set -u
fi
python="$(command -v python3 || command -v python || true)"
[[ -n "$python" ]] || die "no python3 on PATH: set VENV or CONDA_ENV"
# The checkout this script belongs to wins over any installed copy of the package.
export PYTHONPATH="$repo_root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # step lines reach the log as they happen, not when a pipe buffer fills

visible_gpus() {
  if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
    tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c '^[^-]' || true
  elif command -v nvidia-smi >/dev/null; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}
gpus="$(visible_gpus)"
nproc_per_node="${NPROC_PER_NODE:-$(( gpus > 0 ? gpus : 1 ))}"
backend="${BACKEND:-$([[ "$gpus" -gt 0 ]] && echo nccl || echo gloo)}"
[[ "$nproc_per_node" =~ ^[1-9][0-9]*$ ]] || die "NPROC_PER_NODE must be a positive integer, got '$nproc_per_node'"
max_restarts="${MAX_RESTARTS:-0}"
[[ "$max_restarts" =~ ^[0-9]+$ ]] || die "MAX_RESTARTS must be a whole number, got '$max_restarts'"
[[ "$backend" == nccl || "$backend" == gloo ]] || die "BACKEND must be nccl or gloo, got '$backend'"

log_level="${LOG_LEVEL:-INFO}"
case "$log_level" in
  INFO) export LOGLEVEL=INFO NCCL_DEBUG="${NCCL_DEBUG:-WARN}" ;;
  DEBUG) export LOGLEVEL=DEBUG NCCL_DEBUG="${NCCL_DEBUG:-INFO}" TORCH_DISTRIBUTED_DEBUG=DETAIL \
           TORCH_CPP_LOG_LEVEL=INFO HIVEMIND_LOGLEVEL=DEBUG ;;
  *) die "LOG_LEVEL must be INFO or DEBUG, got '$log_level'" ;;
esac

log_dir="${LOG_DIR:-logs/distributed_training}"
mkdir -p "$log_dir"
log_name="cluster_train_$(date +%Y%m%d_%H%M%S)_node${node_rank}.log"
log_file="$log_dir/$log_name"
: >"$log_file"
ln -sfn "$log_name" "$log_dir/cluster_train_latest_node${node_rank}.log"

say() { echo "cluster_train: $*" | tee -a "$log_file"; }

# Run a command with its output on the console and in the log; return the command's status, not tee's.
logged() {
  local status=0
  "$@" 2>&1 | tee -a "$log_file" || status="${PIPESTATUS[0]}"
  return "$status"
}

trainer_args=(--config "$config" --backend "$backend" "$@")
say "node $node_rank of $num_nodes on $(hostname), master $master_addr:$master_port, $nproc_per_node rank(s), backend $backend"
say "python $python; log $log_file"
say "trainer flags: ${trainer_args[*]}"

preflight_status=0
logged "$python" -m open_diloco preflight --num-nodes "$num_nodes" --node-rank "$node_rank" \
  --master-addr "$master_addr" --master-port "$master_port" --nproc-per-node "$nproc_per_node" \
  --timeout "${PREFLIGHT_TIMEOUT:-5}" --master-wait "${MASTER_WAIT:-60}" -- "${trainer_args[@]}" \
  || preflight_status=$?
if [[ "$preflight_status" -ne 0 ]]; then
  say "preflight failed (exit $preflight_status): torchrun not started"
  exit "$preflight_status"
fi

# Node 0 hosts the rendezvous store; the others only connect (is_host=0), so on one host they never race for
# the port and on many hosts none tries to bind an address it does not have.
is_host=$(( node_rank == 0 ? 1 : 0 ))
# The node the rendezvous makes group rank 0 tells the others where its process-group store listens: its
# --local_addr, else its FQDN, which on many hosts resolves to localhost. Announce an address the others can
# reach: MASTER_ADDR on node 0, elsewhere this host's address on the route to the master.
local_addr="${LOCAL_ADDR:-}"
if [[ -z "$local_addr" && "$node_rank" -eq 0 ]]; then
  local_addr="$master_addr"
elif [[ -z "$local_addr" ]]; then
  local_addr="$("$python" -c 'import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((sys.argv[1], 9))  # UDP: picks the route, sends nothing
print(s.getsockname()[0])' "$master_addr")"
fi
status=0
logged torchrun --nnodes="$num_nodes" --nproc_per_node="$nproc_per_node" --node_rank="$node_rank" \
  --max-restarts="$max_restarts" --rdzv_backend=c10d --rdzv_endpoint="$master_addr:$master_port" \
  --rdzv_id="${RDZV_ID:-${SLURM_JOB_ID:-${PBS_JOBID:-open_diloco}}}" \
  --rdzv_conf="is_host=$is_host,join_timeout=${RDZV_TIMEOUT:-600}" --local_addr="$local_addr" \
  "$repo_root/open_diloco/train_fsdp.py" "${trainer_args[@]}" || status=$?
say "torchrun exited with status $status"
exit "$status"
