"""How a rank stops: promptly, in every phase, and without leaving a process behind.

A stop request is SIGTERM (what torchrun forwards, and what ``scancel``, ``docker stop`` and Kubernetes send),
SIGINT (Ctrl+C), or the launcher disappearing (torchrun SIGKILLed: its ranks are re-parented). The request
raises :class:`~open_diloco.errors.Stop` in the main thread, so the loop unwinds through its ``finally``
blocks and shuts the galaxy down in order. That is the polite path. It can fail: the main thread may sit in C
code (a gloo collective waiting for a dead rank) where Python cannot raise, or a shutdown step may hang. So
every request also arms a deadline, watched by a thread that learns of signals from the C-level wakeup fd
(it does not need the main thread): when the deadline passes, or a second signal comes, the rank ends its
descendants by PID and exits with ``os._exit``. A rank therefore never outlives a stop request by more than
``grace`` seconds plus the time to kill its children.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time

from open_diloco.errors import Stop
from open_diloco.processes import end_tree

GRACE_SECONDS = 8.0
"""Seconds between a stop request and the forced exit: within the 15 s a batch system gives before SIGKILL."""
SHUTDOWN_SECONDS = 30.0
"""Bound on an orderly shutdown that no signal asked for (end of run, an error): the last barrier, the
averager's and the DHT's own shutdown timeouts, metrics flush."""

_NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}
_EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}


class StopGuard:
    """Turns stop signals into :class:`Stop` and guarantees an exit within ``grace`` seconds of the first one.

    Install once, from the main thread, before anything that can block for long (rendezvous, DHT start)."""

    def __init__(self, grace: float = GRACE_SECONDS):
        self.grace = grace
        self._reason: str | None = None
        self._deadline: float | None = None
        self._exit_code = 143
        self._read_fd, self._write_fd = os.pipe()
        self._launcher = os.getppid()

    def install(self) -> StopGuard:
        os.set_blocking(self._write_fd, False)
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for sig in _NAMES:
            signal.signal(sig, self._on_signal)
        threading.Thread(target=self._watch, name="stop-guard", daemon=True).start()
        return self

    def _on_signal(self, signum: int, frame) -> None:
        # Runs in the main thread when it next executes Python; the watcher has already armed the deadline.
        self._request(_NAMES[signum], _EXIT_CODES[signum])
        raise Stop(f"signal {_NAMES[signum]}", self._exit_code)

    def _request(self, reason: str, exit_code: int, grace: float | None = None) -> None:
        if self._deadline is None:
            self._reason, self._exit_code = reason, exit_code
            self._deadline = time.monotonic() + (self.grace if grace is None else grace)

    def begin_shutdown(self, reason: str = "the run ended", exit_code: int = 1) -> None:
        """Bound the shutdown that starts now (no-op if a stop request already set a deadline). A rank still
        tearing down after :data:`SHUTDOWN_SECONDS` is ended with ``exit_code``."""
        self._request(reason, exit_code, SHUTDOWN_SECONDS)

    def _watch(self) -> None:
        signals_seen = 0
        while True:
            timeout = 1.0 if self._deadline is None else max(0.0, min(1.0, self._deadline - time.monotonic()))
            ready, _, _ = select.select([self._read_fd], [], [], timeout)
            if ready:
                received = os.read(self._read_fd, 64)
                stops = [b for b in received if b in _NAMES]
                if stops:
                    signals_seen += len(stops)
                    self._request(_NAMES[signal.Signals(stops[0])], _EXIT_CODES[signal.Signals(stops[0])])
                    if signals_seen > 1:
                        self._force_exit("a second stop signal")
            if self._deadline is None and os.getppid() != self._launcher:
                self._request("the launcher is gone", 143)
                os.kill(os.getpid(), signal.SIGTERM)  # raise Stop in the main thread, the polite path first
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._force_exit(f"still running after {self._reason}")

    def _force_exit(self, why: str) -> None:
        print(f"open-diloco: {why}: ending this rank and its processes now", file=sys.stderr, flush=True)
        end_tree(os.getpid(), include_root=False, grace=1.0, timeout=2.0)
        os._exit(self._exit_code)
