"""Summarise a galaxy run from its clusters' jsonl metrics: losses, rounds, and whether every cluster held the
same θ_outer (equal `param_hash`) after every outer step. Exit code 1 if any round disagreed."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(paths: list[str]) -> int:
    runs = {}
    missing = [path for path in paths if not Path(path).is_file()]
    if missing or not paths:
        print(
            f"no metrics from {', '.join(missing) or 'any cluster'}: a cluster failed before its first step "
            "(its log beside the metrics says why)"
        )
        return 1
    for path in paths:
        records = [json.loads(line) for line in Path(path).read_text().splitlines()]
        runs[Path(path).stem] = [r for r in records if "step" in r]
    print(f"\n{'cluster':<10} {'steps':>6} {'first loss':>11} {'last loss':>10} {'rounds':>7} {'peers':>6}")
    for name, records in runs.items():
        rounds = [r for r in records if "outer_step" in r]
        peers = min((r["galaxy_peers"] for r in rounds), default=0)
        print(
            f"{name:<10} {len(records):>6} {records[0]['loss']:>11.4f} {records[-1]['loss']:>10.4f} "
            f"{len(rounds):>7} {peers:>6}"
        )
    hashes: dict[int, set[str]] = {}
    for records in runs.values():
        for r in records:
            if "outer_step" in r:
                hashes.setdefault(r["outer_step"], set()).add(r["param_hash"])
    differing = [step for step, seen in sorted(hashes.items()) if len(seen) > 1]
    if differing:
        print(f"θ_outer DIFFERED between clusters after outer steps {differing}")
        return 1
    print(f"θ_outer identical (param_hash) in every cluster after all {len(hashes)} outer steps")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
