"""Stopping a cluster: what `scancel`, `docker stop`, Kubernetes and an impatient user do must end every rank
and every hivemind process within 15 s, in one line, whatever the cluster was doing; a galaxy-wide
misconfiguration stops every cluster with its line instead of turning into retries."""

from __future__ import annotations

import re
import signal
import time

import pytest

from open_diloco.local_galaxy import STOP_BUDGET, Galaxy
from open_diloco.processes import alive, descendants, wait_gone

pytestmark = pytest.mark.e2e

# A lonely cluster of a galaxy of 2 waits in its first round: matchmaking never finds the partner.
WAITING_IN_A_ROUND = ["--max-steps", "50", "--hv.local-steps", "3", "--hv.averaging-timeout", "120"]


def _whole_tree(galaxy: Galaxy, name: str) -> list[int]:
    proc = galaxy.procs[name]
    return [proc.pid, *descendants(proc.pid)]


def _wait_in_round(galaxy: Galaxy, name: str) -> list[int]:
    """Start ``name`` alone in a galaxy of 2 and return its whole process tree once it waits in round 1."""
    metrics = galaxy.start_cluster(0, 2, *WAITING_IN_A_ROUND, name=name)
    galaxy.wait_for_step(metrics, 2, 240)
    time.sleep(4.0)  # step 3 ends the round: the cluster now sits in matchmaking for 120 s
    tree = _whole_tree(galaxy, name)
    assert len(tree) >= 1 + 2 + 2 * 3, (
        f"expected torchrun, 2 ranks, and per rank DHT + averager + p2pd: {tree}"
    )
    return tree


def _tracebacks_other_than_torchruns_signal(log: str) -> list[str]:
    """The tracebacks in ``log`` that are not torchrun's SignalException or an exception chained to it
    ("During handling of the above exception"): torch's own elastic agent can raise one more while handling
    the signal (an UnboundLocalError in its metrics wrapper when the signal lands before its timer starts)."""
    others, previous_was_torchruns, chained = [], False, False
    for traceback in log.split("Traceback (most recent call last):")[1:]:
        torchruns = "SignalException" in traceback.split("\n\n")[0] or (chained and previous_was_torchruns)
        if not torchruns:
            others.append(traceback)
        previous_was_torchruns = torchruns
        chained = "During handling of the above exception, another exception occurred:" in traceback
    return others


def test_tracebacks_chained_to_torchruns_signal_are_torchruns():
    signal_tb = '\n  File "api.py", line 86\nSignalException: Process 1 got signal: 15\n\n'
    chained = "During handling of the above exception, another exception occurred:\n\n"
    torch_bug = "\n  File \"run.py\"\nUnboundLocalError: cannot access local variable 'start'\n"
    ours = '\n  File "open_diloco/trainer.py"\nRuntimeError: boom\n'
    header = "Traceback (most recent call last):"
    assert _tracebacks_other_than_torchruns_signal(header + signal_tb + chained + header + torch_bug) == []
    assert _tracebacks_other_than_torchruns_signal(header + signal_tb + header + ours) == [ours]
    assert _tracebacks_other_than_torchruns_signal(header + ours + chained + header + torch_bug) == [
        ours + chained,
        torch_bug,
    ]


def test_sigterm_while_waiting_in_a_round_ends_everything_in_one_line(galaxy):
    tree = _wait_in_round(galaxy, "lonely")
    galaxy.stop("lonely", signal.SIGTERM)  # every rank and hivemind process within STOP_BUDGET
    assert not alive(tree)
    log = galaxy.log("lonely")
    assert galaxy.procs["lonely"].returncode != 0
    assert log.count("stopping: signal SIGTERM") == 1, log[-3000:]
    # torchrun prints its own traceback for the signal it received (SignalException); nothing else may
    ours = _tracebacks_other_than_torchruns_signal(log)
    assert not ours, "traceback from the cluster:\n" + ours[0][:3000]
    assert not re.search(r"\[(ERROR|WARN)\]", log), log[-3000:]


def test_sigterm_then_sigkill_of_torchrun_alone_leaves_nothing(galaxy):
    tree = _wait_in_round(galaxy, "orphaned")
    torchrun = galaxy.procs["orphaned"]
    started = time.monotonic()
    torchrun.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    torchrun.send_signal(signal.SIGKILL)  # a batch system's kill -9 after its grace, or an impatient user
    torchrun.wait(5)
    left = wait_gone(tree, STOP_BUDGET - (time.monotonic() - started))
    assert not left, f"ranks or hivemind processes outlived their launcher: {alive(left)}"


# slow: the averager's check is test_averager's test_duplicate_galaxy_rank_is_an_error
@pytest.mark.slow
def test_duplicate_galaxy_rank_stops_both_clusters_with_the_line(galaxy):
    steps = ["--max-steps", "20", "--hv.local-steps", "3"]
    # one rank a cluster: the claim is checked on the galaxy's records, whatever the ranks
    galaxy.start_cluster(0, 2, *steps, nproc=1, name="first")
    galaxy.start_cluster(0, 2, *steps, nproc=1, name="second")  # the same --hv.world-rank
    for name in ("first", "second"):
        assert galaxy.wait(name, 180) != 0, galaxy.log(name)[-3000:]
        log = galaxy.log(name)
        errors = [line for line in log.splitlines() if line.startswith("open-diloco: error:")]
        assert errors and all(
            "also claims galaxy rank 0" in line and "--hv.world-rank" in line for line in errors
        ), log[-3000:]
        assert "retry" not in log


def test_clusters_that_cannot_average_together_stop_both_with_what_differs(galaxy):
    # hivemind's matchmaking would silently never group them (each training alone behind partial rounds)
    steps = ["--max-steps", "20", "--hv.local-steps", "3"]
    galaxy.start_cluster(0, 2, *steps, nproc=1)
    galaxy.start_cluster(1, 2, *steps, "--hv.compression", "int8", nproc=1)
    for rank, (theirs, mine) in ((0, ("'int8'", "'none'")), (1, ("'none'", "'int8'"))):
        assert galaxy.wait(f"cluster{rank}", 180) != 0, galaxy.log(f"cluster{rank}")[-3000:]
        log = galaxy.log(f"cluster{rank}")
        errors = [line for line in log.splitlines() if line.startswith("open-diloco: error:")]
        expected = f"cannot average with this one: its codec is {theirs}, here {mine}"
        assert errors and all(expected in line for line in errors), log[-3000:]
