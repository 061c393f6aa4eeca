"""Process trees, by PID (psutil). One helper for the galaxy's children, the tests and the benchmarks.

torchrun starts every rank in a session of its own and hivemind forks DHT and averager processes that start
p2pd daemons, so neither process groups nor sessions cover "everything this run started": only the tree of
parent links does. Ending a tree is always by PID, with a bounded wait.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil


def descendants(pid: int) -> list[int]:
    """PIDs of every live descendant of ``pid`` (children first); empty when ``pid`` is gone."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def descendants_of(roots: list[int] | set[int]) -> set[int]:
    """PIDs of every live descendant of any of ``roots``, from one pass over the process table.
    (``descendants`` once per root reads the whole table once per root: a test polling three clusters five
    times a second spent ~10 % of a core on it.)"""
    children: dict[int, list[int]] = {}
    for process in psutil.process_iter(["ppid"]):
        children.setdefault(process.info["ppid"], []).append(process.pid)
    found: set[int] = set()
    todo = [child for root in roots for child in children.get(root, [])]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return found


def alive(pids: list[int] | set[int]) -> list[int]:
    """The PIDs that still exist and are not zombies."""
    living = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                living.append(pid)
    return living


def unix_socket_files(pids: list[int] | set[int]) -> set[str]:
    """The files of the unix sockets ``pids`` hold (abstract sockets have none): hivemind's p2pd and its
    clients listen on such files in /tmp, which a clean exit must leave gone. Read from each process's own
    ``/proc/<pid>/net/unix``, the table of its network namespace: a process of the WAN lab lives in a
    namespace of its own, whose sockets the caller's table does not list."""
    paths = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            inodes = set()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[len("socket:[") : -1])
            with open(f"/proc/{pid}/net/unix") as table:
                next(table)  # Num RefCount Protocol Flags Type St Inode Path
                for line in table:
                    fields = line.split()
                    if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith("/"):
                        paths.add(fields[7])
    return paths


def hivemind_socket_files(pids: list[int] | set[int]) -> set[str]:
    """The socket files of hivemind's p2pd daemons and P2P clients among :func:`unix_socket_files`: each is
    made by the one process that listens on it (p2pd is exec'd, the clients are made after hivemind's forks),
    so once that process is gone the file is garbage. Other listeners can be inherited across a fork
    (multiprocessing's, from a trainer to hivemind's processes): a child that held one says nothing about its
    owner."""
    return {path for path in unix_socket_files(pids) if os.path.basename(path).startswith("hivemind-")}


def signal_pids(pids: list[int], sig: int) -> None:
    """Send ``sig`` to each PID that still exists."""
    for pid in pids:
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            psutil.Process(pid).send_signal(sig)


def wait_gone(pids: list[int] | set[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds for ``pids`` to end; return the ones still alive."""
    deadline = time.monotonic() + timeout
    while (left := alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def end_tree(pid: int, *, include_root: bool = True, grace: float = 3.0, timeout: float = 5.0) -> list[int]:
    """End ``pid``'s descendants (and ``pid`` itself with ``include_root``): SIGTERM, then SIGKILL for
    whatever is left after ``grace`` seconds. Returns what is still alive after ``timeout`` more (normally
    nothing). The hivemind socket files the ended processes listened on are removed
    (:func:`hivemind_socket_files`)."""
    targets = descendants(pid) + ([pid] if include_root else [])
    sockets = hivemind_socket_files(targets)
    signal_pids(targets, signal.SIGTERM)
    left = wait_gone(targets, grace)
    signal_pids(left, signal.SIGKILL)
    still = wait_gone(left, timeout)
    remove_socket_files(sockets, still)
    return still


def kill_tree(pid: int, sig: int = signal.SIGKILL, timeout: float = 20.0) -> list[int]:
    """Send ``sig`` to ``pid`` and all its descendants at once; return what is still alive after
    ``timeout``. The hivemind socket files the tree listened on are removed once it is gone
    (:func:`hivemind_socket_files`)."""
    targets = [pid, *descendants(pid)]
    sockets = hivemind_socket_files(targets)
    signal_pids(targets, sig)
    left = wait_gone(targets, timeout)
    remove_socket_files(sockets, left)
    return left


def remove_socket_files(paths: set[str], alive_pids: list[int]) -> None:
    """Unlink ``paths`` (from :func:`hivemind_socket_files` of processes since ended) but those that
    ``alive_pids`` still listen on. A killed p2pd and its hivemind clients cannot remove their socket files
    in /tmp, and nothing else ever will: every killed galaxy member, test and bench run would leave them."""
    for path in paths - unix_socket_files(alive_pids):
        with contextlib.suppress(OSError):
            os.unlink(path)
