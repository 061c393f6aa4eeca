"""What the ledger costs a galaxy: bytes and seconds of its entries, against what already moves at the same
moments (a state download of the model, a checkpoint's metadata). Prints a table; figures go in
docs/results/ledger.md.

    .venv/bin/python -m scripts.bench.ledger_cost [--members 4] [--params 25e6]
"""

from __future__ import annotations

import argparse
import json
import time

from open_diloco.outer.ledger import KEEP, SERVED, Ledger, round_entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=4, help="clusters in every round")
    parser.add_argument(
        "--params", type=float, default=25e6, help="model parameters (for the state download)"
    )
    args = parser.parse_args()
    meta = {
        "weight": 1.0,
        "inner_steps": 500,
        "codec": "int8",
        "outer_optimizer": "sgd lr=0.7 momentum=0.9 nesterov=True warmup_rounds=0",
    }
    peers = {rank: meta for rank in range(args.members)}
    ledger = Ledger()
    started = time.perf_counter()
    for round_no in range(1, KEEP + 1):
        hashes = (f"{round_no - 1:016x}", f"{round_no:016x}")
        entry = round_entry(
            round_no=round_no,
            attempt=0,
            fragment=0,
            before=hashes[0],
            after=hashes[1],
            peers=peers,
            members=range(args.members),
        )
        ledger.append(entry)
    per_entry = (time.perf_counter() - started) / KEEP
    one = len(json.dumps(ledger.last.to_wire()))
    started = time.perf_counter()
    tail = json.dumps(ledger.tail())
    tail_seconds = time.perf_counter() - started
    started = time.perf_counter()
    saved = "".join(json.dumps(fields) + "\n" for fields in ledger.state_dict())
    save_seconds = time.perf_counter() - started
    started = time.perf_counter()
    Ledger().load_state_dict([json.loads(line) for line in saved.splitlines()])
    load_seconds = time.perf_counter() - started
    state_bytes = 2 * 4 * args.params  # θ_outer and the outer momentum, fp32: what a download carries
    rows = [
        ("one entry (JSON)", f"{one} B", f"{per_entry * 1e6:.0f} µs to make and append", ""),
        (
            f"served tail ({SERVED} entries)",
            f"{len(tail) / 1e3:.0f} kB",
            f"{tail_seconds * 1e3:.1f} ms",
            f"{len(tail) / state_bytes:.2e} of a {args.params:.0e}-parameter state download",
        ),
        (
            f"checkpoint ledger.jsonl ({KEEP} entries)",
            f"{len(saved) / 1e6:.2f} MB",
            f"save {save_seconds:.2f} s, load {load_seconds:.2f} s",
            f"{len(saved) / state_bytes:.2e} of that state",
        ),
    ]
    print(f"ledger cost: {args.members} members a round")
    print("| what | size | time | against |\n| --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
