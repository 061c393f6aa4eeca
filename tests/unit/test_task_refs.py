"""The averager process's event loop (``galaxy/task_refs.py``): a leftover future's unread connection error is
logged at DEBUG, every other unread error still as asyncio's ERROR."""

from __future__ import annotations

import gc
import logging
import types

import uvloop

from open_diloco.galaxy import task_refs
from open_diloco.galaxy.task_refs import quiet_unread_connection_errors_in_loops_of


def test_an_unread_connection_error_is_no_error_and_any_other_still_is(caplog, monkeypatch):
    # a loop made as hivemind makes the averager's (uvloop), without installing uvloop's policy in this worker
    module = types.SimpleNamespace(switch_to_uvloop=uvloop.new_event_loop)
    quiet_unread_connection_errors_in_loops_of(module)
    loop = module.switch_to_uvloop()

    async def leave_unread(error: Exception) -> None:
        loop.create_future().set_exception(error)  # as amap_in_executor leaves it: nobody reads it

    # read off the module's logger itself: another test in this worker may have set the package's loggers'
    # level or propagation (the full suite did), which caplog would not see past
    quiet: list[str] = []
    monkeypatch.setattr(task_refs.log, "debug", lambda message, *args: quiet.append(message % args))
    errors = [BrokenPipeError(32, "Broken pipe"), ConnectionResetError(104, "reset"), ValueError("a bug")]
    try:
        with caplog.at_level(logging.WARNING):
            for error in errors:
                loop.run_until_complete(leave_unread(error))
                gc.collect()
    finally:
        loop.close()
    logged = [(r.levelno, r.getMessage(), r.exc_info and r.exc_info[1]) for r in caplog.records]
    loud = [entry for entry in logged if entry[0] >= logging.ERROR]
    assert len(loud) == 1 and "never retrieved" in loud[0][1] and isinstance(loud[0][2], ValueError), logged
    assert len(quiet) == 2 and all("never retrieved" in line for line in quiet), quiet
    assert "BrokenPipeError" in quiet[0] and "ConnectionResetError" in quiet[1], quiet
