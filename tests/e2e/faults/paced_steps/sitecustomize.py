"""A test cluster's pace, on the PYTHONPATH of the clusters a test starts with it: each inner step
(``open_diloco.steps.inner_step``) first sleeps ``OPEN_DILOCO_TEST_STEP_SECONDS``, as on a device whose step
takes that long. A test that only needs clusters alive and rounds going (the status command's) then does not
have them train flat out on the 2-core machine, starving the commands it runs beside them and the other xdist
worker's test. Nothing else changes: the same steps, rounds and records, at a device's pace."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/e2e/faults
from fault_patch import patch_on_import  # noqa: E402

_TARGET = "open_diloco.steps"


def _pace(module) -> None:
    seconds, real = float(os.environ["OPEN_DILOCO_TEST_STEP_SECONDS"]), module.inner_step

    def paced(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    module.inner_step = paced


if os.environ.get("OPEN_DILOCO_TEST_STEP_SECONDS"):
    patch_on_import(_TARGET, _pace)
