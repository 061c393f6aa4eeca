"""One-sided rounds on loopback: how often a round comes out partial on one side only (docs/LOG.md).

    python scripts/bench/stream_race.py                         # 130 inner steps, H = 2: 65 rounds, fp32
    python scripts/bench/stream_race.py --steps 130 --extra --hv.compression int2

Starts ``hivemind-dht`` and two 2-rank clusters on 127.0.0.1 (open_diloco/local_galaxy.py, which ends
everything by PID) with hivemind's debug log on (it slows the averagers' processes, which is what made the
race common), and many short rounds. Prints one line per round that was not whole on both sides (not 2 peers,
retried, re-synced or not in sync), the reducer errors of the two logs (``sent k parts, but we expected n``),
and a summary: rounds, one-sided rounds, median all-reduce seconds. What it showed before and after the fix in
galaxy/allreduce.py (a reducer's stream ends only once its sender has read every average): docs/LOG.md.
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import sys
import tempfile
from pathlib import Path

from open_diloco.local_galaxy import Galaxy, outer_records, round_was_clean

REDUCER_ERROR = re.compile(r"exchange with peer \S+ failed: (.*) \(its span keeps our values\)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=130, help="inner steps per cluster (H = 2: a round every 2)"
    )
    parser.add_argument("--workdir", help="where logs and metrics go (default: a new temporary directory)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more trainer flags, last")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the galaxy is ended by PID on a kill too
    work = Path(args.workdir or tempfile.mkdtemp(prefix="stream_race_"))
    work.mkdir(parents=True, exist_ok=True)
    galaxy = Galaxy(work)
    try:
        flags = [
            "--max-steps",
            str(args.steps),
            "--hv.local-steps",
            "2",
            "--hv.averaging-timeout",
            "30",
            *args.extra,
        ]
        metrics = [
            galaxy.start_cluster(rank, 2, *flags, nproc=2, env={"HIVEMIND_LOGLEVEL": "DEBUG"})
            for rank in (0, 1)
        ]
        for rank in (0, 1):
            code = galaxy.wait(f"cluster{rank}", 60 + 10 * args.steps)
            if code != 0:
                sys.exit(f"cluster {rank} failed ({code}); its log: {work / f'cluster{rank}.log'}")
    finally:
        galaxy.close()
    rounds = [outer_records(m) for m in metrics]
    numbers = sorted(set(rounds[0]) | set(rounds[1]))
    one_sided = [n for n in numbers if not all(n in side and _whole(side[n]) for side in rounds)]
    for n in one_sided:
        print(
            f"round {n}: "
            + " | ".join(
                f"cluster {rank}: " + (_brief(side[n]) if n in side else "no record")
                for rank, side in enumerate(rounds)
            )
        )
    for rank in (0, 1):
        for error in REDUCER_ERROR.findall(galaxy.log(f"cluster{rank}")):
            print(f"cluster {rank} reducer error: {error}")
    seconds = [r["allreduce_seconds"] for r in rounds[0].values() if _whole(r)]
    print(
        f"rounds {len(numbers)}, one-sided {len(one_sided)}, median all-reduce "
        f"{statistics.median(seconds) if seconds else float('nan'):.3f} s; logs in {work}"
    )


def _whole(record: dict) -> bool:
    return record["galaxy_peers"] == 2 and round_was_clean(record)


def _brief(record: dict) -> str:
    keys = ("galaxy_peers", "galaxy_complete", "retries", "resynced", "in_sync")
    return ", ".join(f"{key} {record.get(key)}" for key in keys)


if __name__ == "__main__":
    main()
