"""The trainer under torchrun, with one Python warning raised on local rank 1 only, during step 2: what a
library might say on any rank. ``python warning_probe.py TRAINER_FLAGS`` (run by test_logs.py)."""

import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from open_diloco import steps as step_module  # noqa: E402
from open_diloco.cli import main  # noqa: E402

real_inner_step = step_module.inner_step
steps = 0


def inner_step_that_warns(*args, **kwargs):
    global steps
    steps += 1
    if steps == 2 and os.environ["LOCAL_RANK"] == "1":
        warnings.warn("probe: a warning on local rank 1", UserWarning, stacklevel=1)
    return real_inner_step(*args, **kwargs)


step_module.inner_step = inner_step_that_warns
main()
