"""Make the fixture of `open-diloco report`'s tests (tests/fixtures/report/): the metrics of a real galaxy of
three one-rank clusters, in the WAN lab's namespaces (scripts/wan/), whose cluster 2 loses its link for a
while and heals. Needs root and iproute2, as the lab does.

    .venv/bin/python -m scripts.report_fixture tests/fixtures/report

Writes ``cluster{0,1,2}.jsonl`` there (the logs stay in a temporary directory) and prints the outer steps
cluster 2 was cut off at and came back at.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from open_diloco.local_galaxy import REPO, Galaxy, outer_records
from scripts.wan.lab import Lab

CUT_CLUSTER = 2
"""The cluster whose link goes down."""

FLAGS = [
    "--path-model",
    str(REPO / "tests" / "models" / "llama-2m-fresh"),
    "--max-steps",
    "120",
    "--hv.local-steps",
    "5",
    "--eval-interval",
    "20",
    "--eval-samples",
    "16",
    "--hv.averaging-timeout",
    "10",
    "--hv.heartbeat-interval",
    "1",
    "--hv.member-expiry",
    "4",
    "--hv.on-partial-round",
    "proceed",
]


def make(out: Path, cut_after_step: int, cut_seconds: float) -> None:
    """Run the galaxy, cut cluster 2 off after ``cut_after_step`` for ``cut_seconds``, copy the metrics."""
    with tempfile.TemporaryDirectory() as tmp, Lab(3, "region") as lab:
        workdir = Path(tmp)
        galaxy = Galaxy(workdir, lab=lab)
        try:
            metrics = [galaxy.start_cluster(rank, 3, *FLAGS, nproc=1) for rank in range(3)]
            galaxy.wait_for_step(metrics[CUT_CLUSTER], cut_after_step, 600)
            lab.set_link(f"cluster{CUT_CLUSTER}", up=False)
            cut_at = max(outer_records(metrics[CUT_CLUSTER]), default=0)
            time.sleep(cut_seconds)
            lab.set_link(f"cluster{CUT_CLUSTER}", up=True)
            back_at = max(outer_records(metrics[CUT_CLUSTER]), default=0)
            for rank in range(3):
                code = galaxy.wait(f"cluster{rank}", 600)
                if code:
                    raise SystemExit(f"cluster{rank} exited {code}:\n{galaxy.log(f'cluster{rank}')[-3000:]}")
        finally:
            galaxy.close()
        out.mkdir(parents=True, exist_ok=True)
        for path in metrics:
            shutil.copy(path, out / path.name)
    print(f"cluster{CUT_CLUSTER} cut off after outer step {cut_at}, link back at outer step {back_at}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for cluster{0,1,2}.jsonl")
    parser.add_argument("--cut-after-step", type=int, default=30, help="cluster 2's inner step of the cut")
    parser.add_argument("--cut-seconds", type=float, default=20.0, help="how long its link stays down")
    args = parser.parse_args(argv)
    make(args.out, args.cut_after_step, args.cut_seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
