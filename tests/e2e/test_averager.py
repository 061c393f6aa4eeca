"""End-to-end tests of ``open_diloco.galaxy`` on 127.0.0.1 with real hivemind.

Every peer runs in its own spawned process (its DHT, averager and p2pd daemon are its children). The test
records every descendant process by PID once the peers are up, and asserts at the end that all of them are
gone: no p2pd daemon or averager may outlive a test. Processes are only ever ended by PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import multiprocessing as mp
import os
import signal
import socket
import time
from dataclasses import asdict
from pathlib import Path

import psutil
import pytest
import torch

from open_diloco import processes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

CTX = mp.get_context("spawn")
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


def _buffer(round_id: int, rank: int, numel: int, scores: int = 0) -> torch.Tensor:
    """A peer's input: ``numel`` values, then ``scores`` block scores (powers of two, as the outer loop sends them)."""
    generator = torch.Generator().manual_seed(1000 * round_id + rank)
    values = torch.randn(numel, generator=generator)
    return torch.cat([values, 2.0 ** -torch.randint(0, 40, (scores,), generator=generator).float()])


def _power_of_two(values: torch.Tensor) -> torch.Tensor:
    """Each non-negative value truncated to the power of two at or below it (0 stays 0), written out."""
    return torch.tensor([2.0 ** math.floor(math.log2(v)) if v > 0 else 0.0 for v in values.tolist()])


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
    """Fault injection: every part this peer sends to another reducer is NaN (``nan``: a broken sender) or 1000x
    what it claimed (``liar``: a hostile one); the span it reduces itself stays as it is."""
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
    from open_diloco.galaxy.allreduce import CountingStub

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


def _peer(rank: int, kwargs: dict, rounds: int, queue, barrier, serve=False, download=0.0, crash=False,
          fault=None):
    """One cluster's shard averager: start, report ready, run ``rounds`` rounds (each after ``barrier``)."""
    from open_diloco.config import HvConfig
    from open_diloco.galaxy.build import ClusterShard, start_shard_averager
    from open_diloco.outer.codecs import score_values

    if crash:
        _crash_when_reducing()
    if fault in ("nan", "liar"):
        _send_garbage(fault)
    if fault == "slow reader":
        _read_averages_slowly(0.4)

    def on_sigterm(signum, frame):
        raise SystemExit(1)

    signal.signal(signal.SIGTERM, on_sigterm)
    handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    initial_peers, numel = kwargs.pop("initial_peers"), kwargs.pop("numel")
    try:
        hv = HvConfig(**kwargs)
        av = start_shard_averager(hv, ClusterShard.flat(numel), initial_peers=initial_peers)
    except Exception as e:
        queue.put(("error", rank, type(e).__name__, str(e)))
        return
    if handlers != (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)):
        queue.put(("error", rank, "SignalHandlers", "start_shard_averager changed SIGINT/SIGTERM handlers"))
    queue.put(("ready", rank, av.visible_maddrs, av.peer_id))
    try:
        if serve:
            av.serve_state(lambda: ({"outer_step": 7, "lr": 0.5}, [_buffer(7, 0, 1001), torch.arange(5)]))
        if download:
            start = time.monotonic()
            state = av.download_state(download)
            queue.put(("state", rank, state, time.monotonic() - start))
        n = hv.galaxy_size
        scores = score_values(numel, hv.compression, hv.sparse_rule)
        for round_id in range(rounds):
            barrier.wait(60)
            inputs = [_buffer(round_id, r, numel, scores) for r in range(n)]
            mine = inputs[rank] * 1000 if fault == "huge" else inputs[rank].clone()  # a finite, blown-up Δ
            start = time.monotonic()
            try:
                report = av.all_reduce(mine, round_id, {"fingerprint": f"rank{rank}"})
            except Exception as e:
                queue.put(("round_error", rank, round_id, type(e).__name__, str(e), time.monotonic() - start))
                continue
            present = torch.stack([inputs[r] for r in sorted(report.peers)]).double()
            mean = present.mean(0)
            honest_mean = torch.stack([inputs[r] for r in sorted(report.peers) if r not in report.rejected]).double()
            honest_mean = honest_mean.mean(0)
            error = (mine.double() - mean).abs()
            # fp16: every input is rounded on the wire (2^-11 of |x_i|), then the average once more
            fp16_tolerance = 2**-10 * (present.abs().max(0).values + mean.abs()) + 1e-7
            result = dict(
                sha256=hashlib.sha256(mine.numpy().tobytes()).hexdigest(),
                rel_err=float(error.max() / mean.abs().max()),
                fp16_ok=bool((error <= fp16_tolerance).all()),
                unchanged=bool(torch.equal(mine, inputs[rank])),
                each_mean_or_own=bool(((error <= 1e-6 * mean.abs().max()) | (mine == inputs[rank])).all()),
                finite=bool(torch.isfinite(mine).all()),
                honest_share=float(((mine.double() - honest_mean).abs() <= 1e-6 * honest_mean.abs().max()).double().mean()),
                wall=time.monotonic() - start,
                # the scores' average, kept to its power of two (what every peer decodes of the reducer's byte)
                scores_are_the_mean=bool(torch.equal(mine[numel:], _power_of_two(present[:, numel:].mean(0)))),
            )
            queue.put(("round", rank, round_id, asdict(report), result))
        if not rounds and not serve and not download:
            time.sleep(300)  # idle: waits to be killed
        if serve:
            barrier.wait(60)  # keep serving until the downloader is done
    finally:
        av.shutdown()
        queue.put(("done", rank))


def _descendants(root: int) -> dict[int, str]:
    """Live descendants of ``root`` with their process names (p2pd, python ...)."""
    names = {}
    for pid in processes.descendants(root):
        with contextlib.suppress(psutil.Error):
            names[pid] = psutil.Process(pid).name()
    return names


_alive = processes.alive


class Galaxy:
    """Starts peers, collects their messages, and accounts for every process they start."""

    def __init__(self):
        self.queue = CTX.Queue()
        self.workers: list = []
        self.seen: dict[int, str] = {}
        self.messages: list[tuple] = []
        self.barriers: list = []

    def start(self, rank: int, rounds: int = 0, barrier=None, **kwargs) -> None:
        if barrier is not None and barrier not in self.barriers:
            self.barriers.append(barrier)
        extra = {k: kwargs.pop(k) for k in ("serve", "download", "crash", "fault") if k in kwargs}
        args = (rank, {**BASE, "world_rank": rank, "numel": NUMEL, **kwargs}, rounds, self.queue, barrier)
        worker = CTX.Process(target=_peer, args=args, kwargs=extra)  # not daemonic: it has children
        worker.start()
        self.workers.append(worker)

    def wait_for(self, kind: str, count: int, timeout: float = 45.0) -> list[tuple]:
        deadline = time.monotonic() + timeout
        while len(got := [m for m in self.messages if m[0] == kind]) < count:
            errors = [m for m in self.messages if m[0] == "error"]
            assert not errors or kind == "error", f"a peer failed to start: {errors}"
            self.messages.append(self.queue.get(timeout=max(0.1, deadline - time.monotonic())))
        self.snapshot()
        return got

    def snapshot(self) -> None:
        """Record every process our peers started (not multiprocessing's own resource tracker)."""
        for worker in self.workers:
            if worker.pid is not None:
                self.seen.update({worker.pid: "worker", **_descendants(worker.pid)})

    def kill_tree(self, worker) -> None:
        """SIGKILL a peer and everything it started, by PID: a crashed machine."""
        tree = {worker.pid: "worker", **_descendants(worker.pid)}
        self.seen.update(tree)
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
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
                self.kill_tree(worker)
                leftovers[worker.pid] = "worker (did not exit)"
        deadline = time.monotonic() + 10
        while _alive(self.seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in _alive(self.seen):
            leftovers[pid] = self.seen[pid]
            os.kill(pid, signal.SIGKILL)
        assert not leftovers, f"processes left behind: {leftovers}"


@pytest.fixture
def galaxy():
    g = Galaxy()
    try:
        yield g
    finally:
        g.close()
        assert "p2pd" in g.seen.values() or not any(m[0] == "ready" for m in g.messages), "never saw a p2pd"


def _start_galaxy(galaxy: Galaxy, n: int, rounds: int, barrier, **kwargs) -> list[tuple]:
    galaxy.start(0, rounds, barrier, initial_peers=[], galaxy_size=n, **kwargs)
    ((_, _, maddrs, _),) = galaxy.wait_for("ready", 1)
    for rank in range(1, n):
        galaxy.start(rank, rounds, barrier, initial_peers=maddrs, galaxy_size=n, **kwargs)
    return galaxy.wait_for("ready", n)


@pytest.mark.parametrize("compression", ["none", "fp16"])
@pytest.mark.parametrize("n", [2, 3])
def test_rounds_are_bitwise_identical(galaxy, n, compression):
    rounds = 3
    barrier = CTX.Barrier(n + 1)
    _start_galaxy(galaxy, n, rounds, barrier, compression=compression)
    for round_id in range(rounds):
        barrier.wait(60)
        results = [m for m in galaxy.wait_for("round", n * (round_id + 1)) if m[2] == round_id]
        assert not [m for m in galaxy.messages if m[0] == "round_error"]
        for _, _, _, report, _ in results:  # a round that broke is reported so (and DiLoCo's policy decides)
            assert report["group_size"] == n and report["complete"], report
        assert len({r[4]["sha256"] for r in results}) == 1, "peers disagree on the averaged bytes"
        for _, _, _, report, result in results:
            assert sorted(report["peers"]) == list(range(n))
            assert all(
                p["round_id"] == round_id and p["fingerprint"] == f"rank{r}"
                for r, p in report["peers"].items()
            )
            if compression == "none":
                assert result["rel_err"] < 1e-6
            else:
                assert result["fp16_ok"], result
            assert report["bytes_sent"] > 0 and report["bytes_received"] > 0 and report["seconds"] > 0
        # every tensor part is counted once by its sender and once by its receiver
        assert sum(r[3]["bytes_sent"] for r in results) == sum(r[3]["bytes_received"] for r in results)
        # a span goes to its reducer from n-1 peers and comes back to n-1 peers
        payload = 2 * (n - 1) * NUMEL * (4 if compression == "none" else 2)
        assert payload <= sum(r[3]["bytes_sent"] for r in results) <= payload * 1.01


CODEC_NUMEL = 1_100_003  # int8 and int4 parts hold 2^19 and 2^20 values: several parts, several reducers


@pytest.mark.parametrize("fault", ["nan", "huge", "liar"])
def test_a_sender_of_garbage_is_left_out_of_the_average(galaxy, fault):
    # peer 2 sends NaN parts (nan), a finite Δ 1000x the others' (huge) or parts 1000x the norm it claimed (liar):
    # the other reducers leave it out of their spans and name it; the others end the round with identical, finite
    # bytes, the mean of the honest peers' buffers on the spans they reduced (the span peer 2 reduces itself is
    # its own to spoil: docs/security.md). CODEC_NUMEL: parts enough for every peer to reduce a span.
    n, barrier = 3, CTX.Barrier(4)
    galaxy.start(0, 1, barrier, initial_peers=[], galaxy_size=n, numel=CODEC_NUMEL)
    ((_, _, maddrs, _),) = galaxy.wait_for("ready", 1)
    for rank in (1, 2):
        extra = {"fault": fault} if rank == 2 else {}
        galaxy.start(rank, 1, barrier, initial_peers=maddrs, galaxy_size=n, numel=CODEC_NUMEL, **extra)
    galaxy.wait_for("ready", n)
    barrier.wait(60)
    results = {m[1]: m for m in galaxy.wait_for("round", n)}
    honest = [results[0], results[1]]
    for _, _, _, report, result in honest:
        assert report["rejected"] == [2] and report["complete"], report
        assert result["finite"], result
        assert result["honest_share"] > 0.5, result  # the two honest reducers' spans: about 2/3 of the buffer
    assert honest[0][4]["sha256"] == honest[1][4]["sha256"]


# sparse magnitude: int2 values plus a second tensor of block scores, one byte per 128 values (1/512 of fp32)
MIN_RATIO = {"bf16": 1.99, "int8": 3.9, "int4": 7.4, "int2": 14.8, "sparse random": 14.8, "sparse magnitude": 14.5}
MAX_ERROR = {"bf16": 0.01, "int8": 0.03, "int4": 0.3, "int2": 1.0, "sparse random": 1.0, "sparse magnitude": 1.0}


@pytest.mark.parametrize("codec", sorted(MIN_RATIO))
def test_codec_rounds_are_bitwise_identical(galaxy, codec):
    """Our codecs: every peer ends each round with the same bytes, near the mean, at the codec's byte count
    (sparse's wire is int2 with empty trailing blocks skipped; its selection is the outer loop's, not tested here).
    Sparse ``magnitude``'s block scores end as the peers' mean kept to its power of two (the reducer encodes it
    once, like the values)."""
    rounds, n = 2, 2
    barrier = CTX.Barrier(n + 1)
    compression, _, rule = codec.partition(" ")
    rule_flag = {"sparse_rule": rule} if rule else {}
    _start_galaxy(galaxy, n, rounds, barrier, compression=compression, numel=CODEC_NUMEL, **rule_flag)
    for round_id in range(rounds):
        barrier.wait(60)
        results = [m for m in galaxy.wait_for("round", n * (round_id + 1), timeout=60) if m[2] == round_id]
        assert not [m for m in galaxy.messages if m[0] == "round_error"]
        assert len({r[4]["sha256"] for r in results}) == 1, "peers disagree on the averaged bytes"
        for _, _, _, report, result in results:
            assert report["group_size"] == n and report["complete"], report
            assert result["rel_err"] < MAX_ERROR[codec] and result["scores_are_the_mean"], result
        sent = sum(r[3]["bytes_sent"] for r in results)
        assert sent == sum(r[3]["bytes_received"] for r in results)
        fp32_payload = 2 * (n - 1) * CODEC_NUMEL * 4
        assert fp32_payload / sent >= MIN_RATIO[codec], (fp32_payload, sent)


def test_a_peer_slow_to_read_gets_every_average(galaxy):
    """A reducer's stream ends only once its sender has read every average (the fix of the one-sided race,
    docs/LOG.md): the sender holds its end open until then, the reducer waits for that end within hivemind's
    sender timeout. Peer 1 here reads each average 0.4 s late (CODEC_NUMEL in fp32 is several parts per span),
    and still gets them all, at once after the last. This checks the fix neither stalls nor cuts off a slow
    reader; it does not reproduce the race (it passes on the code before the fix as well:
    `scripts/bench/stream_race.py` does)."""
    rounds, n = 2, 2
    barrier = CTX.Barrier(n + 1)
    galaxy.start(0, rounds, barrier, initial_peers=[], galaxy_size=n, numel=CODEC_NUMEL)
    ((_, _, maddrs, _),) = galaxy.wait_for("ready", 1)
    galaxy.start(1, rounds, barrier, initial_peers=maddrs, galaxy_size=n, numel=CODEC_NUMEL, fault="slow reader")
    galaxy.wait_for("ready", n)
    for round_id in range(rounds):
        barrier.wait(60)
        results = [m for m in galaxy.wait_for("round", n * (round_id + 1), timeout=60) if m[2] == round_id]
        assert not [m for m in galaxy.messages if m[0] == "round_error"]
        for _, _, _, report, result in results:
            assert report["group_size"] == n and report["complete"], report
            assert result["rel_err"] < 1e-6, result
        assert len({r[4]["sha256"] for r in results}) == 1, "peers disagree on the averaged bytes"
        assert sum(r[3]["bytes_sent"] for r in results) == sum(r[3]["bytes_received"] for r in results)


def test_group_of_one_returns_at_once_unchanged(galaxy):
    barrier = CTX.Barrier(2)
    _start_galaxy(galaxy, 1, 1, barrier)
    barrier.wait(60)
    ((_, _, _, report, result),) = galaxy.wait_for("round", 1)
    assert report["group_size"] == 1 and report["complete"] and list(report["peers"]) == [0]
    assert result["unchanged"] and result["wall"] < 1.0


def test_peer_killed_before_round_does_not_hang_survivor(galaxy):
    barrier = CTX.Barrier(2)
    galaxy.start(0, 1, barrier, initial_peers=[], galaxy_size=2, averaging_timeout=6.0)
    ((_, _, maddrs, _),) = galaxy.wait_for("ready", 1)
    galaxy.start(1, 0, None, initial_peers=maddrs, galaxy_size=2, averaging_timeout=6.0)  # idles
    galaxy.wait_for("ready", 2)
    galaxy.kill_tree(galaxy.workers[1])
    barrier.wait(60)
    start = time.monotonic()
    ((_, _, _, report, result),) = galaxy.wait_for("round", 1, timeout=20)
    assert time.monotonic() - start < 6.0 + 3.0
    assert report["group_size"] == 1 and list(report["peers"]) == [0] and result["unchanged"]


def test_peer_killed_mid_round_does_not_hang_survivor(galaxy):
    barrier = CTX.Barrier(3)
    galaxy.start(0, 1, barrier, initial_peers=[], galaxy_size=2, averaging_timeout=8.0)
    ((_, _, maddrs, _),) = galaxy.wait_for("ready", 1)
    galaxy.start(1, 1, barrier, initial_peers=maddrs, galaxy_size=2, averaging_timeout=8.0, crash=True)
    galaxy.wait_for("ready", 2)
    barrier.wait(60)
    start = time.monotonic()
    deadline = start + 25
    while not [m for m in galaxy.messages if m[0] in ("round", "round_error") and m[1] == 0]:
        galaxy.messages.append(galaxy.queue.get(timeout=max(0.1, deadline - time.monotonic())))
    assert time.monotonic() - start < 8.0 + 3.0
    assert _alive([galaxy.workers[1].pid]) == [], "the crashing peer did not die"
    (outcome,) = [m for m in galaxy.messages if m[0] in ("round", "round_error") and m[1] == 0]
    if outcome[0] == "round_error":
        assert outcome[3] == "RoundFailed", outcome
    else:  # a result from a round that lost a peer must say so
        report, result = outcome[3], outcome[4]
        assert not report["complete"] and report["group_size"] == 2, report
        assert result["each_mean_or_own"], "a failed span must keep our own values, the rest the average"


def test_trainer_killed_alone_takes_dht_averager_and_p2pd_along(galaxy):
    galaxy.start(0, 0, None, initial_peers=[], galaxy_size=2)  # idles
    galaxy.wait_for("ready", 1)
    children = _descendants(galaxy.workers[0].pid)
    assert "p2pd" in children.values() and len(children) == 3, children  # DHT, averager, p2pd
    # p2pd dials from fresh ports (galaxy.dht.REUSEPORT_ENV: a reconnect after a partition must not reuse the
    # dead connection's ports)
    (p2pd,) = [pid for pid, name in children.items() if name == "p2pd"]
    environ = Path(f"/proc/{p2pd}/environ").read_bytes().split(b"\0")
    assert b"LIBP2P_TCP_REUSEPORT=false" in environ, [e for e in environ if b"LIBP2P" in e]
    os.kill(galaxy.workers[0].pid, signal.SIGKILL)  # only the trainer process, as the OOM killer would
    deadline = time.monotonic() + 10
    while _alive(children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(children), {pid: children[pid] for pid in _alive(children)}


def test_late_joiner_downloads_state(galaxy):
    barrier = CTX.Barrier(2)
    galaxy.start(0, 0, barrier, initial_peers=[], galaxy_size=2, serve=True)
    ((_, _, maddrs, _),) = galaxy.wait_for("ready", 1)
    galaxy.start(1, 0, None, initial_peers=maddrs, galaxy_size=2, download=15.0)
    ((_, _, state, seconds),) = galaxy.wait_for("state", 1)
    barrier.wait(60)
    assert state is not None, "no state downloaded"
    metadata, tensors = state
    assert metadata == {"outer_step": 7, "lr": 0.5}
    assert (
        len(tensors) == 2
        and torch.equal(tensors[0], _buffer(7, 0, 1001))
        and torch.equal(tensors[1], torch.arange(5))
    )
    assert tensors[0].dtype == torch.float32 and tensors[1].dtype == torch.int64


def test_download_state_without_server_returns_none(galaxy):
    galaxy.start(0, 0, None, initial_peers=[], galaxy_size=2, download=3.0)
    ((_, _, state, seconds),) = galaxy.wait_for("state", 1)
    assert state is None and seconds < 3.0 + 2.0


def test_duplicate_galaxy_rank_is_an_error(galaxy):
    barrier = CTX.Barrier(3)
    galaxy.start(0, 1, barrier, initial_peers=[], galaxy_size=2)
    ((_, _, maddrs, peer0),) = galaxy.wait_for("ready", 1)
    galaxy.start(0, 1, barrier, initial_peers=maddrs, galaxy_size=2)  # same galaxy rank 0
    ready = galaxy.wait_for("ready", 2)
    barrier.wait(60)
    errors = galaxy.wait_for("round_error", 2)
    ids = [m[3] for m in ready]
    for _, _, _, kind, message, _ in errors:
        assert kind == "DuplicateGalaxyRank"
        assert "\n" not in message
    assert {next(i for i in ids if i in m[4]) for m in errors} == set(ids), "each must name the other peer"


def _busy_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PEER = "12D3KooWR2sdW3bUWbZyZhcegL51hKAq9VtJLcc658zQ9gbu7py8"


@pytest.mark.parametrize(
    "case",
    ["malformed", "no_peer_id", "nothing_listening", "silent_listener", "port_in_use"],
)
def test_bad_network_config_is_a_one_line_config_error(galaxy, case):
    busy = _busy_port()
    port = busy.getsockname()[1]
    kwargs = dict(initial_peers=[], join_timeout=4.0)
    if case == "malformed":
        kwargs["initial_peers"] = ["/ip4/127.0.0.1/tcp/notaport"]
    elif case == "no_peer_id":
        kwargs["initial_peers"] = ["/ip4/127.0.0.1/tcp/1234"]
    elif case == "nothing_listening":
        kwargs["initial_peers"] = [f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{PEER}"]
    elif case == "silent_listener":  # something accepts TCP but never speaks libp2p: join_timeout applies
        kwargs["initial_peers"] = [f"/ip4/127.0.0.1/tcp/{port}/p2p/{PEER}"]
    else:
        kwargs["host_maddrs"] = [f"/ip4/127.0.0.1/tcp/{port}"]
    start = time.monotonic()
    try:
        galaxy.start(0, 0, None, galaxy_size=2, **kwargs)
        ((_, _, kind, message),) = galaxy.wait_for("error", 1, timeout=40)
    finally:
        busy.close()
    assert kind == "ConfigError" and "\n" not in message and "--hv." in message, message
    assert time.monotonic() - start < 4.0 + 10.0  # join_timeout, plus spawning a Python with torch
