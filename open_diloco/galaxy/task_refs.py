"""Every asyncio task of a hivemind process held until it ends.

asyncio's loop holds its tasks only by weak reference: a pending task that nothing else references is
garbage, collected in the middle of whatever it awaits. hivemind's averager leaves such tasks behind. When a
round is cancelled, ``DecentralizedAverager._step`` cancels its matchmaking task and returns without awaiting
it; that task, its search task and its declare task then run their ``finally`` blocks, the last one awaiting
a DHT store (taking this peer's declaration back) through an ``MPFuture``, which hivemind's own registry also
holds only weakly. Until the DHT answers, those three tasks and the future reference only each other. A
collection in that window destroys them mid-``finally`` ("Task was destroyed but it is pending!",
"aclose(): asynchronous generator is already running"), and the search's and the declaration's locks
(``PotentialLeaders.lock_search``, ``lock_declare``) stay held for the life of the process: every later
round of that shard waits on them, never declares itself, and is never met. The 4 x 2 ``lan`` soak lost a
cluster's shard that way for the rest of its run, its sibling shard meeting everyone
(docs/results/chaos-soak.md); ``tests/e2e/test_averager.py`` reproduces it on loopback.

Holding every task until it is done gives the ``finally`` blocks the time hivemind wrote them to have. A task
that would never end stays held (it would have stayed pending anyway): hivemind's waits all have timeouts.

The same leftovers leave errors nobody reads. When a round is given up on while a reducer's stream breaks,
hivemind's ``amap_in_executor`` is cancelled at the moment its read of the stream fails: Python 3.11's
``wait_for`` then raises the read's ``BrokenPipeError`` instead of the cancel, and ``amap_in_executor`` puts
it into a future that its cancelled reader never takes. asyncio logs such a future as an ERROR with two
tracebacks ("Future exception was never retrieved"; 4 in the 4 x 2 ``lan`` soak of 2026-12-04, all at one
abandoned round). A connection that broke under a round nobody waits for is no error:
:func:`quiet_unread_connection_errors_in_loops_of` logs it at DEBUG; every other unread error still reaches
the loop's own handler.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from hivemind.averaging import averager as hivemind_averager

log = logging.getLogger(__name__)

_held: set[asyncio.Task] = set()
"""This process's pending tasks; each leaves the set as it ends."""


def _held_task(loop: asyncio.AbstractEventLoop, coro, **kwargs: Any) -> asyncio.Task:
    task = asyncio.Task(coro, loop=loop, **kwargs)
    _held.add(task)
    task.add_done_callback(_held.discard)
    return task


def hold_tasks_in_loops_of(module: ModuleType) -> None:
    """Make the event loops ``module`` makes (hivemind's ``switch_to_uvloop``, as imported there) hold every
    task they create until it ends. For the process that serves one hivemind averager or DHT alone: call it in
    that process, before its loop starts."""
    _set_up_loops_of(module, lambda loop: loop.set_task_factory(_held_task))


def _quiet_unread_connection_errors(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's exception handler: a future's unread connection error at DEBUG, anything else as before."""
    error = context.get("exception")
    if context.get("future") is not None and isinstance(error, ConnectionError):
        log.debug("%s: %r (a round nobody waits for any more)", context.get("message"), error)
        return
    loop.default_exception_handler(context)


def quiet_unread_connection_errors_in_loops_of(module: ModuleType) -> None:
    """Make the event loops ``module`` makes (``switch_to_uvloop``, as imported there) log a future's
    connection error that nobody read at DEBUG instead of as an ERROR (see the module's docstring). Call it in
    the process that serves one hivemind averager, before its loop starts."""
    _set_up_loops_of(module, lambda loop: loop.set_exception_handler(_quiet_unread_connection_errors))


def _set_up_loops_of(module: ModuleType, set_up: Callable[[asyncio.AbstractEventLoop], None]) -> None:
    """Make ``module``'s ``switch_to_uvloop`` (hivemind's, as imported there) pass every loop it makes to
    ``set_up`` before handing it out."""
    make_loop = module.switch_to_uvloop

    def switch_to_uvloop() -> asyncio.AbstractEventLoop:
        loop = make_loop()
        set_up(loop)
        return loop

    module.switch_to_uvloop = switch_to_uvloop


def tend_averager_loop() -> None:
    """In the process that serves one hivemind averager, before its loop starts: that loop holds every task
    until it ends, and logs a leftover future's unread connection error at DEBUG (see the module's
    docstring)."""
    hold_tasks_in_loops_of(hivemind_averager)
    quiet_unread_connection_errors_in_loops_of(hivemind_averager)
