"""Peers of one shard averager for tests/e2e/test_averager.py, each in a spawned process of its own (its DHT,
averager and p2pd daemon are its children), with the faults a test may inject (a crash while reducing, garbage
parts, a slow reader), and :class:`Galaxy`, which starts them, collects their messages and accounts for every
process they start, by PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import gc
import logging
import multiprocessing as mp
import os
import signal
import time
from dataclasses import asdict, replace

import psutil
import torch

from open_diloco import processes
from tests.support.peer_rounds import peer_input, round_result

CTX = mp.get_context("forkserver")
# Each peer is forked from one server process that imported torch and hivemind once (a clean,
# single-threaded process: what a fork needs), instead of a fresh interpreter that spends ~3 s of CPU on
# imports per peer; the suite starts about a hundred of them.
CTX.set_forkserver_preload(["torch", "hivemind", "open_diloco.galaxy.build", "tests.support.averager_peers"])
NUMEL = 250_007  # odd, and more than one 512 KiB part so every peer reduces a span
BASE = dict(
    host_maddrs=["/ip4/127.0.0.1/tcp/0"],
    run_id="e2e",
    matchmaking_time=2.0,
    averaging_timeout=15.0,
    join_timeout=10.0,
    member_expiry=15.0,
)
"""The ``--hv.*`` settings of every peer here; a test adds its own (``galaxy_size``, ``world_rank``, ...)."""


def _crash_when_reducing() -> None:
    """Fault injection: the first time this peer's averager serializes an averaged part (the all-reduce is
    under way), SIGKILL the whole peer: worker, DHT, averager and p2pd, as if the machine died."""
    from open_diloco.galaxy.allreduce import CanonicalAllReduce

    def crash(*args, **kwargs):
        worker = os.getppid()  # we run inside the averager process, a child of the worker
        tree = [worker, *processes.descendants(worker)]
        for pid in sorted(set(tree), key=lambda pid: pid == os.getpid()):  # ourselves last
            os.kill(pid, signal.SIGKILL)

    CanonicalAllReduce._serialize_result = crash


def _send_garbage(fault: str) -> None:
    """Fault injection: every part this peer sends to another reducer is NaN (``nan``: a broken sender) or
    1000x what it claimed (``liar``: a hostile one); the span it reduces itself stays as it is."""
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor

    from open_diloco.galaxy.allreduce import CanonicalAllReduce

    honest = CanonicalAllReduce._generate_input_for_peer

    async def garbage(self, peer_index):
        async for msg in honest(self, peer_index):
            part = deserialize_torch_tensor(msg.tensor_part)
            bad = torch.full_like(part, float("nan")) if fault == "nan" else part * 1000
            msg.tensor_part.CopyFrom(serialize_torch_tensor(bad))
            yield msg

    CanonicalAllReduce._generate_input_for_peer = garbage


def _read_averages_slowly(seconds: float) -> None:
    """Fault injection: this peer waits ``seconds`` before it reads each average a reducer sends it (a loaded
    machine, a slow link), so the reducer has written them all long before they are read."""
    from open_diloco.galaxy.span_streams import CountingStub

    original = CountingStub.rpc_aggregate_part

    async def slowly(self, inputs):
        stream = (await original(self, inputs)).__aiter__()

        async def averages():
            while True:
                await asyncio.sleep(seconds)
                try:
                    yield await stream.__anext__()
                except StopAsyncIteration:
                    return

        return averages()

    CountingStub.rpc_aggregate_part = slowly


def _drop_state_parts() -> None:
    """This peer pins its state for a striped download but answers every part empty (a holder that fails
    while it serves)."""
    from open_diloco.galaxy.state_pins import Pin

    Pin.part = lambda self, index, start, end: None


def _pin_nothing() -> None:
    """This peer answers every pin empty, as a peer from before striped downloads (no such RPC) would fail."""
    from open_diloco.galaxy.canonical_averager import CanonicalAverager

    async def nothing(self, outer_step):
        return None

    CanonicalAverager._pinned = nothing


def _collect_garbage_on_request() -> None:
    """Give this peer's averager process a ``_collect_garbage`` command: collections back to back for a while,
    as Python's automatic collector may run there at any moment."""
    from open_diloco.galaxy.canonical_averager import CanonicalAverager

    async def collect_garbage(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            gc.collect()
            await asyncio.sleep(0.002)

    CanonicalAverager._collect_garbage = collect_garbage


def _cancel_a_round_collecting_garbage(av) -> None:
    """Fault injection: start a round nobody else comes to, cancel it while it looks for a group (a round the
    galaxy applied without this cluster), and collect garbage in the averager process meanwhile."""
    cancelled = av.start_round(10_000, {"fingerprint": "cancelled"})
    time.sleep(0.7)
    cancelled.control.cancel()
    av.averager._outer_pipe.send(("_collect_garbage", [], dict(seconds=2.0)))
    time.sleep(2.5)


def _report_striped_downloads(queue, rank: int, fault: str | None) -> None:
    """Send this peer's striped download lines to the test (``fault``: and answer no part, or no pin)."""
    if fault == "drop parts":
        _drop_state_parts()
    if fault == "no pin":
        _pin_nothing()
    stripe_log = logging.getLogger("open_diloco.galaxy.canonical_averager")
    stripe_log.setLevel(logging.INFO)
    stripe_log.addHandler(_StripeLines(queue, rank))


class _StripeLines(logging.Handler):
    """Sends the striped download's log line to the test's queue."""

    def __init__(self, queue, rank: int):
        super().__init__(logging.INFO)
        self.queue, self.rank = queue, rank

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("striped state download"):
            self.queue.put(("stripe", self.rank, record.getMessage()))


def _inject(fault: str | None, crash: bool) -> None:
    """Set up this peer's fault before its averager's process is forked (it inherits them)."""
    if crash:
        _crash_when_reducing()
    if fault in ("nan", "liar"):
        _send_garbage(fault)
    if fault == "slow reader":
        _read_averages_slowly(0.4)
    if fault == "cancelled round":
        _collect_garbage_on_request()


def _round_plan(av, n: int, round_id: int, rank: int, min_groups=None, windows=None):
    """The round's matchmaking plan as a test sets it (a floor per round, a window per peer); ``None``: the
    averager's own."""
    if not (min_groups or windows):
        return None
    plan = av.matchmaking_plan(n)
    plan = replace(plan, min_group=min_groups[round_id]) if min_groups else plan
    return replace(plan, window=windows[rank]) if windows else plan


def _peer(
    rank: int,
    kwargs: dict,
    rounds: int,
    queue,
    barrier,
    serve=False,
    download=0.0,
    crash=False,
    fault=None,
    holders=(),
):
    """One cluster's shard averager: start, report ready, run ``rounds`` rounds (each after ``barrier``).
    ``serve``: serve a state (``True``, or the number of values of its first tensor); ``download``: download
    one within that many seconds (from ``holders``, the first the source, when given)."""
    from open_diloco.config import HvConfig
    from open_diloco.galaxy.build import ClusterShard, start_shard_averager
    from open_diloco.outer.codecs import score_values

    _inject(fault, crash)
    _report_striped_downloads(queue, rank, fault)

    def on_sigterm(signum, frame):
        raise SystemExit(1)

    signal.signal(signal.SIGTERM, on_sigterm)
    faulthandler.register(signal.SIGUSR1)  # Galaxy.close asks a hung peer where it hangs, before killing it
    handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    initial_peers, numel = kwargs.pop("initial_peers"), kwargs.pop("numel")
    weights = kwargs.pop("peer_weights", None)  # each peer's averaging weight (--hv.round-steps by-speed)
    plan_with = {k: kwargs.pop(k) for k in ("min_groups", "windows") if k in kwargs}  # floors, windows
    arrive_after = kwargs.pop("arrive_after", None)  # each peer's delay after the round's barrier
    try:
        # (a client must name its DHT peers; the others are checked by start_shard_averager itself)
        hv = HvConfig(
            **kwargs, **({"initial_peers": list(initial_peers)} if kwargs.get("client_mode") else {})
        )
        av = start_shard_averager(hv, ClusterShard.flat(numel), initial_peers=initial_peers)
    except Exception as e:
        queue.put(("error", rank, type(e).__name__, str(e)))
        return
    if handlers != (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)):
        queue.put(("error", rank, "SignalHandlers", "start_shard_averager changed SIGINT/SIGTERM handlers"))
    queue.put(("ready", rank, av.visible_maddrs, av.peer_id))
    try:
        if serve:
            served = peer_input(7, 0, 1001 if serve is True else serve)
            av.serve_state(lambda: ({"outer_step": 7, "lr": 0.5}, [served, torch.arange(5)]))
        if download:
            start = time.monotonic()
            state = av.download_state(download, *([holders[0], list(holders[1:])] if holders else []))
            queue.put(("state", rank, _by_value(state), time.monotonic() - start))
        if fault == "cancelled round":
            _cancel_a_round_collecting_garbage(av)
        n = hv.galaxy_size
        scores = score_values(numel, hv.compression, hv.sparse_rule)
        for round_id in range(rounds):
            barrier.wait(60)
            inputs = [peer_input(round_id, r, numel, scores) for r in range(n)]
            mine = inputs[rank] * 1000 if fault == "huge" else inputs[rank].clone()  # a finite, blown-up Δ
            time.sleep(arrive_after[rank] if arrive_after else 0.0)
            start = time.monotonic()
            try:
                fingerprint = {"fingerprint": f"rank{rank}"}
                if weights:
                    fingerprint["weight"] = weights[rank]
                plan = _round_plan(av, n, round_id, rank, **plan_with)
                report = av.all_reduce(mine, round_id, fingerprint, plan=plan)
            except Exception as e:
                queue.put(("round_error", rank, round_id, type(e).__name__, str(e), time.monotonic() - start))
                continue
            result = round_result(mine, inputs, rank, report, numel, started=start, weights=weights)
            queue.put(("round", rank, round_id, asdict(report), result))
        if not rounds and not serve and not download:
            time.sleep(300)  # idle: waits to be killed
        if serve:
            barrier.wait(60)  # keep serving until the downloader is done
    finally:
        av.shutdown()
        queue.put(("done", rank))


def _by_value(state: tuple | None) -> tuple | None:
    """A downloaded state with numpy arrays for tensors, so the queue carries its values: a tensor travels
    as a handle the receiver fetches from the sender, which may have ended (the suite: "Connection reset")."""
    return None if state is None else (state[0], [tensor.numpy() for tensor in state[1]])


def _as_tensors(message: tuple) -> tuple:
    """A peer's message with a state's arrays as tensors again (:func:`_by_value`)."""
    if message[0] != "state" or message[2] is None:
        return message
    kind, rank, (metadata, arrays), seconds = message
    return kind, rank, (metadata, [torch.from_numpy(array) for array in arrays]), seconds


def descendants_named(root: int) -> dict[int, str]:
    """Live descendants of ``root`` with their process names (p2pd, python ...)."""
    names = {}
    for pid in processes.descendants(root):
        with contextlib.suppress(psutil.Error):
            names[pid] = psutil.Process(pid).name()
    return names


class Galaxy:
    """Starts peers, collects their messages, and accounts for every process they start."""

    def __init__(self):
        self.queue = CTX.Queue()
        self.workers: list = []
        self.seen: dict[int, str] = {}
        self.messages: list[tuple] = []
        self.barriers: list = []
        self.sockets: set[str] = set()  # the socket files the peers' processes listened on, removed at close

    def start(self, rank: int, rounds: int = 0, barrier=None, **kwargs) -> None:
        if barrier is not None and barrier not in self.barriers:
            self.barriers.append(barrier)
        extra = {k: kwargs.pop(k) for k in ("serve", "download", "crash", "fault", "holders") if k in kwargs}
        args = (rank, {**BASE, "world_rank": rank, "numel": NUMEL, **kwargs}, rounds, self.queue, barrier)
        worker = CTX.Process(target=_peer, args=args, kwargs=extra)  # not daemonic: it has children
        worker.start()
        self.workers.append(worker)

    def wait_for(self, kind: str, count: int, timeout: float = 45.0) -> list[tuple]:
        deadline = time.monotonic() + timeout
        while len(got := [m for m in self.messages if m[0] == kind]) < count:
            errors = [m for m in self.messages if m[0] == "error"]
            assert not errors or kind == "error", f"a peer failed to start: {errors}"
            self.messages.append(_as_tensors(self.queue.get(timeout=max(0.1, deadline - time.monotonic()))))
        self.snapshot()
        return got

    def snapshot(self) -> None:
        """Record every process our peers started (not multiprocessing's own resource tracker), and the socket
        files they listen on."""
        for worker in self.workers:
            if worker.pid is not None:
                self.seen.update({worker.pid: "worker", **descendants_named(worker.pid)})
        self.sockets |= processes.hivemind_socket_files(processes.alive(self.seen))

    def kill_tree(self, worker) -> None:
        """SIGKILL a peer and everything it started, by PID: a crashed machine."""
        self.seen.update({worker.pid: "worker", **descendants_named(worker.pid)})
        processes.kill_tree(worker.pid, timeout=10)  # and the socket files it leaves in /tmp
        worker.join(10)

    def close(self) -> None:
        self.snapshot()
        for barrier in self.barriers:
            barrier.abort()  # a failed test must not leave peers waiting for rounds that never come
        for worker in self.workers:
            worker.join(20)
        leftovers = {}
        for worker in self.workers:
            if worker.is_alive():
                os.kill(worker.pid, signal.SIGUSR1)  # its threads' stacks, to the test's captured stderr
                time.sleep(1.0)
                self.kill_tree(worker)
                leftovers[worker.pid] = "worker (did not exit)"
        deadline = time.monotonic() + 10
        while processes.alive(self.seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in processes.alive(self.seen):
            leftovers[pid] = self.seen[pid]
            os.kill(pid, signal.SIGKILL)
        # a crashed (SIGKILLed) peer's p2pd and clients could not remove theirs
        processes.remove_socket_files(self.sockets, processes.wait_gone(self.seen, 10))
        assert not leftovers, f"processes left behind: {leftovers}"


def start_galaxy(galaxy: Galaxy, n: int, rounds: int, barrier, **kwargs) -> list[tuple]:
    galaxy.start(0, rounds, barrier, initial_peers=[], galaxy_size=n, **kwargs)
    ((_, _, maddrs, _),) = galaxy.wait_for("ready", 1)
    for rank in range(1, n):
        galaxy.start(rank, rounds, barrier, initial_peers=maddrs, galaxy_size=n, **kwargs)
    return galaxy.wait_for("ready", n)
