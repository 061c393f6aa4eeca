"""How hivemind's forked processes (the DHT, each averager) live and die next to a trainer rank.

They start by calling :func:`become_galaxy_child`, which fixes three things measured on hivemind 1.1.x:
- torchrun stops a rank by signalling its whole process group, which reached these children and their p2pd
  daemons before the rank could shut them down in order (p2pd errors, uvloop tracebacks). The children move
  to a process group of their own; the rank shuts them down, or they notice it is gone.
- A fork inherits the trainer's Python signal handlers: SIGTERM raised the trainer's ``Stop`` inside uvloop's
  callbacks, where it was logged and swallowed, so the child survived SIGTERM, and a rank exiting through
  ``multiprocessing``'s atexit (which terminates, then joins daemonic children without a timeout) hung
  forever. Here SIGTERM ends the child and its own children (p2pd) at once; SIGINT is ignored (Ctrl+C is the
  trainer's to handle). The trainer's signal wakeup fd is dropped too, else the child's signals would look
  like the trainer's.
- A SIGKILLed trainer tells nobody: a watchdog thread notices the re-parenting and exits the same way.

It also keeps p2pd's report of its own socket closing at shutdown out of the log (not an error).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time

from open_diloco.processes import end_tree, hivemind_socket_files, remove_socket_files


def become_galaxy_child(parent_pid: int) -> None:
    """Call first thing in the main thread of a forked hivemind process whose parent is ``parent_pid``."""
    logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(_drop_listener_closed_at_shutdown)
    os.setpgid(0, 0)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, lambda signum, frame: _exit_with_children(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="exit-with-parent", daemon=True).start()


def _drop_listener_closed_at_shutdown(record: logging.LogRecord) -> bool:
    """p2pd reports its own control socket being closed as it shuts down ("error accepting connection: accept
    unix ...: use of closed network connection"), and hivemind relays that as an ERROR: seen on a rank stopped
    with SIGTERM while it waited in a round. Nothing failed; other p2pd errors pass."""
    message = record.getMessage()
    return not ("error accepting connection" in message and "use of closed network connection" in message)


def end_child(process: multiprocessing.Process) -> None:
    """In the parent: end whatever is left of a hivemind child and its own children (p2pd) by PID, after its
    orderly shutdown had its chance. Bounded: a few seconds at most."""
    if process.pid is None:  # never started
        return
    end_tree(process.pid, include_root=process.is_alive(), grace=1.0, timeout=2.0)
    process.join(1.0)


def _exit_with_children(exit_code: int) -> None:
    """End p2pd (``end_tree`` removes its socket file) and exit at once. hivemind removes its P2P client's
    socket file only in an orderly shutdown, which this is not: remove it here, or every SIGKILLed trainer
    and every SIGTERM would leave one per hivemind process in /tmp."""
    p2p_clients = hivemind_socket_files([os.getpid()])
    end_tree(os.getpid(), include_root=False, grace=1.0, timeout=1.0)
    remove_socket_files(p2p_clients, [])
    os._exit(exit_code)


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    _exit_with_children(1)
