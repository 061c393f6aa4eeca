"""Rank logging: one handler however often it is set up, our INFO shown, others' from WARNING, warnings as one
line."""

from __future__ import annotations

import logging
import re

from open_diloco.logs import HANDLER_NAME, log_from_every_rank


def test_rank_logging_is_idempotent_and_leveled(capfd):
    for _ in range(2):
        log_from_every_rank(galaxy_rank=3, rank=5, local_rank=1)
    assert [h.get_name() for h in logging.getLogger().handlers].count(HANDLER_NAME) == 1
    logging.getLogger("open_diloco.trainer").info("ours at info")
    logging.getLogger("some.library").info("theirs at info")
    # what logging.captureWarnings sends (pytest's own warning capture would intercept a real warnings.warn;
    # tests/dist/test_logs.py raises a real one under torchrun)
    logging.getLogger("py.warnings").warning(
        "%s", "x.py:1: UserWarning: careful\n  warnings.warn('careful')\n"
    )
    lines = capfd.readouterr().err.splitlines()
    assert any(
        line.endswith("INFO galaxy_rank=3 rank=5 local_rank=1 open_diloco.trainer: ours at info")
        for line in lines
    )
    assert not any("theirs at info" in line for line in lines)
    warned = [line for line in lines if "careful" in line]
    # hivemind, once imported, names the WARNING level "WARN"
    assert len(warned) == 1 and re.search(
        r" WARN(ING)? galaxy_rank=3 rank=5 local_rank=1 py.warnings: x.py:1: UserWarning: careful$", warned[0]
    ), lines
    log_from_every_rank(galaxy_rank=0, rank=0, local_rank=0, level_name="debug")
    assert logging.getLogger("open_diloco").level == logging.DEBUG
