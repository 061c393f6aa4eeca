"""A rank's death under ``torchrun --max-restarts``: the cluster restarts by itself, resumes from its newest
checkpoint (or starts fresh when it has none yet) and is back in the galaxy's rounds, in sync, while the other
cluster never stops (issue 51). ``--ckpt.resume auto`` is the one value that serves both cases."""

from __future__ import annotations

import json
import signal
import time

import psutil
import pytest

from open_diloco.local_galaxy import outer_records
from open_diloco.processes import descendants
from tests.conftest import read_metrics

pytestmark = pytest.mark.e2e

STEPS = ["--max-steps", "80", "--hv.local-steps", "5", "--warmup-steps", "2"]


def rank_pid(torchrun_pid: int, local_rank: int) -> int:
    """The PID of the trainer process of ``local_rank`` under a torchrun (its environment names it)."""
    for pid in descendants(torchrun_pid):
        try:
            process = psutil.Process(pid)
            if "train_fsdp.py" in " ".join(process.cmdline()) and (
                process.environ().get("LOCAL_RANK") == str(local_rank)
            ):
                return pid
        except psutil.Error:
            continue
    raise AssertionError(f"no trainer of local rank {local_rank} under torchrun {torchrun_pid}")


def wait_for_text(galaxy, name: str, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in galaxy.log(name):
        assert time.monotonic() < deadline, f"{name} did not print {text!r} in {timeout:.0f}s"
        time.sleep(0.5)


# the fresh start is the same path as a late joiner's (tests/e2e/test_galaxy.py): slow tier, ~90 s
@pytest.mark.parametrize(
    "checkpointed", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["resumes", "starts-fresh"]
)
def test_a_rank_killed_under_max_restarts_brings_its_cluster_back_in_sync(galaxy, tmp_path, checkpointed):
    ckpt = ["--ckpt.path", str(tmp_path / "ckpt0"), "--ckpt.resume", "auto"]
    if checkpointed:
        ckpt += ["--ckpt.interval", "10"]
    metrics = [
        galaxy.start_cluster(0, 2, *STEPS, *ckpt, nproc=2, launcher=("--max-restarts=2",)),
        galaxy.start_cluster(1, 2, *STEPS, nproc=2),
    ]
    galaxy.wait_for_step(metrics[0], 22 if checkpointed else 12, 240)
    killed_at = max(r["step"] for r in read_metrics(metrics[0]))
    galaxy.track()
    # cluster 1 paused while torchrun restarts cluster 0. Why: the killed cluster's SIGTERMed rank says it
    # left, so the other trains on alone, at full speed; on a loaded host (CI) it used to finish its run while
    # torchrun was still restarting the killed cluster, and there was no galaxy left to be back in
    with galaxy.paused("cluster1"):
        psutil.Process(rank_pid(galaxy.procs["cluster0"].pid, 1)).send_signal(signal.SIGKILL)
        wait_for_text(galaxy, "cluster0", "torchrun restarted this cluster (restart 1)", 240)
    for rank in (0, 1):
        assert galaxy.wait(f"cluster{rank}", 420) == 0, galaxy.log(f"cluster{rank}")[-3000:]

    records = [json.loads(line) for line in metrics[0].read_text().splitlines()]  # the start records too
    starts = [r for r in records if r.get("event") == "start"]
    assert [s["restarts"] for s in starts] == [0, 1], starts
    log = galaxy.log("cluster0")
    assert "torchrun restarted this cluster (restart 1)" in log
    if checkpointed:
        assert starts[1]["resumed_from"].endswith("step_00000020"), starts[1]
    else:
        assert starts[1]["resumed_from"] is None and "starting fresh" in log
    # the other cluster never stopped: one launch, every step. A round it held while cluster 0 restarted (one
    # of two, without rank 0: no quorum) trained its stride again, so the steps after a held round go back a
    # stride (it stays on the galaxy's clock and ends with it), and nowhere else
    other = read_metrics(metrics[1])
    steps = [r["step"] for r in other]
    assert sorted(set(steps)) == list(range(1, 81)) and steps[-1] == 80, steps
    back = [i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]]
    assert all(other[i - 1].get("round_outcome") == "held" and steps[i] == steps[i - 1] - 4 for i in back), [
        (steps[i - 1], steps[i], other[i - 1].get("round_outcome")) for i in back
    ]
    # back in the galaxy's rounds after the restart: within 2 rounds of its first, in sync with cluster 1
    theirs = outer_records(metrics[1])
    after = [r for r in records[records.index(starts[1]) :] if "outer_step" in r]
    assert after, log[-3000:]
    back = next(
        (
            i
            for i, r in enumerate(after)
            if r["in_sync"] and r["param_hash"] == theirs.get(r["outer_step"], {}).get("param_hash")
        ),
        None,
    )
    assert back is not None and back <= 2, [
        (r["outer_step"], r["round_outcome"], r["in_sync"]) for r in after
    ]
    assert after[-1]["param_hash"] == theirs[max(theirs)]["param_hash"]
    assert killed_at < after[0]["step"] or checkpointed
