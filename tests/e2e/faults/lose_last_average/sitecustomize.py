"""Fault injection for the e2e tests, on the PYTHONPATH of one cluster only: in the all-reduce number
``OPEN_DILOCO_TEST_LOSE_LAST_AVERAGE_OF`` (1-based, counted per averager process) this cluster's reducers
never send the last average of their span, as a stream cut short did under load ("sent 2 parts, but we
expected 3"): the round is whole here and partial at the other peer. With
``OPEN_DILOCO_TEST_LOSE_LAST_AVERAGE_RANK`` set, only that local rank's averager (that shard) loses it. With
``OPEN_DILOCO_TEST_LOSE_LAST_AVERAGE_MARK`` set to a path, the moment it strikes is appended there (Unix
seconds, one line per reducer stream cut): the chaos soak times the fault by it, not by counting the records'
syncs (a retry whose matchmaking failed, or a held round, made no all-reduce: the count ran up to 5 minutes
early).
Applied when ``open_diloco.galaxy.allreduce`` is first imported (the averager process is forked after that and
inherits it); nothing else changes."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/e2e/faults
from fault_patch import patch_on_import  # noqa: E402

_TARGET = "open_diloco.galaxy.allreduce"


def _mark_strike() -> None:
    mark = os.environ.get("OPEN_DILOCO_TEST_LOSE_LAST_AVERAGE_MARK")
    if mark:
        with open(mark, "a") as f:
            f.write(f"{time.time()}\n")


def _lose_last_average(module) -> None:
    runner = module.CanonicalAllReduce
    lose_in = int(os.environ["OPEN_DILOCO_TEST_LOSE_LAST_AVERAGE_OF"])
    started = [0]
    original_init, original_stream = runner.__init__, runner._accumulate_parts_streaming

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        started[0] += 1
        self.ordinal_for_test = started[0]

    async def _accumulate_parts_streaming(self, stream, sender_index):
        sent = 0
        async for message in original_stream(self, stream, sender_index):
            sent += 1
            if self.ordinal_for_test == lose_in and sent == self.tensor_part_reducer.num_parts:
                _mark_strike()
                return  # the stream is cut short: the last average never leaves
            yield message

    runner.__init__ = __init__
    runner._accumulate_parts_streaming = _accumulate_parts_streaming


_RANK = os.environ.get("OPEN_DILOCO_TEST_LOSE_LAST_AVERAGE_RANK")
if os.environ.get("OPEN_DILOCO_TEST_LOSE_LAST_AVERAGE_OF") and _RANK in (None, os.environ.get("LOCAL_RANK")):
    patch_on_import(_TARGET, _lose_last_average)
