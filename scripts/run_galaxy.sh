#!/usr/bin/env bash
# A local galaxy on 127.0.0.1: one hivemind DHT bootstrap peer, N clusters of M ranks (torchrun each), fake data.
# Prints every cluster's step lines, then a summary (loss, rounds, whether θ_outer hashes matched every round).
# Everything it starts is ended on exit or Ctrl+C, by PID.
#
# --wan PROFILE runs the DHT and every cluster in a namespace of the WAN lab instead (scripts/wan/; needs root),
# their links shaped to PROFILE of scripts/wan/profiles.toml; the lab is removed at the end.
#
#   scripts/run_galaxy.sh [--clusters N] [--ranks M] [--steps S] [--local-steps H] [--wan PROFILE] [-- trainer flags]
#   e.g. scripts/run_galaxy.sh --clusters 2 --ranks 2 --steps 40 --local-steps 10 -- --hv.compression fp16
set -euo pipefail
cd "$(dirname "$0")/.."

clusters=2 ranks=2 steps=40 local_steps=10 wan=""
while [ $# -gt 0 ]; do
  case "$1" in
    --clusters) clusters="$2"; shift 2 ;;
    --ranks) ranks="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --local-steps) local_steps="$2"; shift 2 ;;
    --wan) wan="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "run_galaxy.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

python="${PYTHON:-.venv/bin/python}"
dht_bin="$(dirname "$python")/hivemind-dht"
workdir="outputs/galaxy_demo/$(date +%Y%m%d-%H%M%S)"
mkdir -p "$workdir"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

pids=() lab_pid=""
cleanup() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 30); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.5
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  if [ -n "$lab_pid" ]; then  # the lab last: it removes its namespaces and whatever is left in them
    kill -TERM "$lab_pid" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$lab_pid" 2>/dev/null || break; sleep 0.5; done
  fi
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'echo "interrupted: stopping the galaxy"; exit 130' INT TERM

# where an endpoint runs: `place NAME` prints its command prefix, `address NAME` the address it listens on
place() { :; }
address() { echo 127.0.0.1; }
if [ -n "$wan" ]; then
  "$python" -m scripts.wan.lab up --clusters "$clusters" --profile "$wan" --ready-file "$workdir/lab.json" \
    > >(sed -u "s/^/[lab] /" | tee "$workdir/lab.log") 2>&1 &
  lab_pid=$!
  for _ in $(seq 1 120); do
    [ -s "$workdir/lab.json" ] && break
    kill -0 "$lab_pid" 2>/dev/null || { wait "$lab_pid" || exit $?; }
    sleep 0.5
  done
  [ -s "$workdir/lab.json" ] || { echo "the WAN lab did not come up within 60 s; see $workdir/lab.log" >&2; exit 1; }
  endpoint() { "$python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["endpoints"][sys.argv[2]][sys.argv[3]])' "$workdir/lab.json" "$@"; }
  place() { echo "ip netns exec $(endpoint "${1/cluster/c}" netns)"; }
  address() { endpoint "${1/cluster/c}" address; }
fi

dht_host="$(address dht)"
# shellcheck disable=SC2046  # place prints a command prefix to split
# its INFO line carries the address we read: INFO whatever HIVEMIND_LOGLEVEL the caller has
HIVEMIND_LOGLEVEL=INFO $(place dht) "$dht_bin" --identity_path "$workdir/dht_identity.pem" --host_maddrs "/ip4/$dht_host/tcp/0" >"$workdir/dht.log" 2>&1 &
pids+=($!)
maddr=""
for _ in $(seq 1 60); do
  maddr="$(grep -o -m1 "/ip4/$dht_host/tcp/[0-9]*/p2p/[A-Za-z0-9]*" "$workdir/dht.log" 2>/dev/null || true)"
  [ -n "$maddr" ] && break
  sleep 0.5
done
[ -n "$maddr" ] || { echo "the DHT did not start within 30 s; see $workdir/dht.log" >&2; exit 1; }
echo "DHT bootstrap peer: $maddr  (logs and metrics in $workdir)"

# a round waits this long for a late cluster: on loopback 1 s; over the lab, long enough to cover a re-synced
# cluster's download of the demo model's θ_outer over the slowest profile (docs/round-protocol.md)
matchmaking=1.0
[ -n "$wan" ] && matchmaking=8.0
# the demo's model, batch, schedule and flags, each dropped where the trainer flags after `--` set it again (the CLI
# refuses a flag given twice): `-- --num-workers 2` or `-- --max-steps 100` wins over the script's own
user=" $* "
defaults=(--path-model tests/models/llama-2m-fresh --seq-length 128 --per-device-train-batch-size 4 --lr 1e-2
          --warmup-steps 5 --max-steps "$steps" --log-interval 5 --num-workers 0 --hv.local-steps "$local_steps"
          --hv.matchmaking-time "$matchmaking")
[[ "$user" == *" --per-device-train-batch-size "* ]] || defaults+=(--total-batch-size $((4 * ranks)))
demo_defaults=(--fake-data)
for ((i = 0; i < ${#defaults[@]}; i += 2)); do
  flag="${defaults[i]}"
  [[ "$user" == *" $flag "* || "$user" == *" $flag="* ]] || demo_defaults+=("$flag" "${defaults[i + 1]}")
done
[[ "$user" == *"-torch-compile "* ]] || demo_defaults+=(--no-torch-compile)
# a per-device batch of the caller's makes the default total (no gradient accumulation) follow it
per_device=$(sed -n 's/.* --per-device-train-batch-size \([0-9]*\) .*/\1/p' <<<"$user")
if [ -n "$per_device" ] && [[ "$user" != *" --total-batch-size "* ]]; then
  demo_defaults+=(--total-batch-size $((per_device * ranks)))
fi

for rank in $(seq 0 $((clusters - 1))); do
  # a local galaxy listens on 127.0.0.1 and a lab one on its lab address, unless the caller says where: the
  # default, 0.0.0.0, would announce (and have other clusters dial) every address of this machine
  listen=(--hv.host-maddrs "/ip4/$(address "cluster$rank")/tcp/0")
  [[ "$user" == *" --hv.host-maddrs "* || "$user" == *" --hv.host-maddrs="* ]] && listen=()
  # shellcheck disable=SC2046
  $(place "cluster$rank") "$python" -m torch.distributed.run --standalone --nproc_per_node="$ranks" open_diloco/train_fsdp.py \
    "${demo_defaults[@]}" \
    --metric-logger-type jsonl --metrics-path "$workdir/cluster$rank.jsonl" --run-name "cluster$rank" \
    --hv.initial-peers "$maddr" --hv.galaxy-size "$clusters" --hv.world-rank "$rank" \
    "${listen[@]}" "$@" \
    > >(grep --line-buffered -v '^W[0-9]' | sed -u "s/^/[cluster $rank] /" | tee "$workdir/cluster$rank.log") 2>&1 &
  pids+=($!)
done

status=0
for pid in "${pids[@]:1}"; do wait "$pid" || status=$?; done
"$python" scripts/galaxy_summary.py "$workdir"/cluster*.jsonl || status=$?
exit "$status"
