"""Run under torchrun (2 ranks, gloo) by tests/dist/test_pg_timeout.py: a round longer than the process-group
timeout's floor. The group is formed as the trainer forms it, with the timeout derived from a galaxy config
whose averaging timeout exceeds a short floor (``FLOOR`` stands in for 600 s). Rank 0 then waits ``WAIT``
seconds outside any collective (what a round on a slow link does) while rank 1 waits in one: on the derived
group, and on a group whose timeout is the floor alone, to show that the floor would have killed the cluster.
``python pg_timeout_probe.py OUT_DIR``: each rank writes ``rank<r>.json``."""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from open_diloco.config import HvConfig
from open_diloco.world import describe_world, join_process_group, leave_process_group, process_group_timeout

FLOOR, WAIT = 1.0, 2.5
HV = HvConfig(averaging_timeout=2.0, matchmaking_time=0.5, max_retries=0, join_timeout=1.0, final_wait=0.0)


def collective(group: dist.ProcessGroup | None) -> tuple[float, str | None]:
    """Seconds one all-reduce took here, and the error it ended with (``None``: it completed)."""
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=group)
    except RuntimeError as err:  # gloo's timeout
        return time.monotonic() - started, str(err).splitlines()[0]
    return time.monotonic() - started, None


def main(out: Path) -> None:
    world = describe_world("cpu", "gloo")
    timeout = process_group_timeout(HV, floor=FLOOR)
    join_process_group(world, timeout)
    floor_only = dist.new_group(backend="gloo", timeout=timedelta(seconds=FLOOR))
    dist.barrier()
    result: dict = {"timeout": timeout}
    if world.rank == 0:
        time.sleep(
            WAIT
        )  # never enters the floor-only group's collective: rank 1 waits there past its timeout
        result["derived"] = collective(None)
    else:
        result["floor_only"] = collective(floor_only)
        result["derived"] = collective(None)
    Path(out, f"rank{world.rank}.json").write_text(json.dumps(result))
    leave_process_group(synchronize=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
