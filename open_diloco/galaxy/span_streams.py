"""The two ends of a span's stream in the canonical all-reduce (``galaxy/allreduce.py``), held open until the
sender has read every average.

A span's stream ends only once its sender has read every average (:class:`CountingStub` holds the sender's end
open until then; the reducer waits for that end before closing its own, :func:`until_sender_read_all`). It
used to end as soon as the reducer had written its last average, and under load the sender then lost the
averages still on their way (its p2pd logs a stream reset, its Python sees the stream end: "peer … sent 3
parts, but we expected 5"): a round partial on one side only. ``scripts/bench/stream_race.py`` counts such
incidents with and without the hold (docs/results/wan.md, docs/LOG.md). That p2pd turns the reducer's early
close into the reset is our reading of its logs, not traced in its source; the measured effect is what the
change rests on.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol

from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.utils import P2PHandlerError
from hivemind.proto import averaging_pb2


class SpanRunner(Protocol):
    """What a stub needs of its all-reduce (``galaxy/allreduce.py``'s ``CanonicalAllReduce``): the servicer
    whose handler it calls, how long a reducer may stay silent, and the byte counters it adds to."""

    _servicer_type: Any
    reducer_timeout: float | None
    bytes_sent: int
    bytes_received: int


class CountingStub:
    """A reducer's stub for our parts: counts the parts we send it and the averages it returns, and keeps our
    end of the stream open until we have read all ``expected`` averages (or the reducer said it is done with
    us, or closed the stream, or went silent for hivemind's reducer timeout). Our end's close is what lets the
    reducer close its own (see :func:`until_sender_read_all`): closed any earlier, averages still on their way
    could be dropped.

    It drives the stream itself, as hivemind's ``P2P._iterate_protobuf_stream_handler`` does, but for one
    thing: a reducer that closes the stream early (nothing more to say) ends our wait at once, where
    hivemind's reader would first wait for our writer, which waits for averages that never come."""

    def __init__(self, stub, runner: SpanRunner, expected: int):
        self._stub, self._runner, self._expected = stub, runner, expected

    async def rpc_aggregate_part(self, inputs):
        stub, runner, expected = self._stub, self._runner, self._expected
        if not hasattr(stub, "_p2p"):  # not a p2p stub (the allowlist's refusal): it answers by itself
            return await stub.rpc_aggregate_part(inputs)
        handle_name = runner._servicer_type._get_handle_name(stub._namespace, "rpc_aggregate_part")
        _info, reader, writer = await stub._p2p.call_binary_stream_handler(stub._peer, handle_name)
        progress = asyncio.Event()
        read = {"averages": 0, "over": False}

        async def write() -> None:
            async for msg in inputs:
                runner.bytes_sent += msg.ByteSize()
                await P2P.send_protobuf(msg, writer)
            while not read["over"] and read["averages"] < expected:
                progress.clear()
                try:
                    await asyncio.wait_for(
                        progress.wait(), runner.reducer_timeout or _READ_ALL_FALLBACK_SECONDS
                    )
                except asyncio.TimeoutError:
                    break  # hivemind's own reading gives up on this reducer at the same time
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)

        writing = asyncio.create_task(write())
        writing.add_done_callback(
            lambda task: task.cancelled() or task.exception()
        )  # (an error is read below)

        async def averages():
            with contextlib.closing(writer):
                try:
                    while True:
                        try:
                            msg, err = await P2P.receive_protobuf(averaging_pb2.AveragingData, reader)
                        except asyncio.IncompleteReadError:  # the reducer closed the stream
                            break
                        if err is not None:
                            raise P2PHandlerError(f"the reducer {stub._peer} failed: {err.message}")
                        runner.bytes_received += msg.ByteSize()
                        if msg.code == averaging_pb2.AVERAGED_PART:
                            read["averages"] += 1
                        else:  # the reducer is done with us (refused, dropped, failed): hivemind raises on it
                            read["over"] = True
                        progress.set()
                        yield msg
                    if writing.done() and not writing.cancelled() and writing.exception() is not None:
                        # sending our parts failed: that, not a short stream, is news
                        raise writing.exception()
                finally:
                    read["over"] = True
                    progress.set()
                    writing.cancel()

        return averages()


async def until_sender_read_all(stream, num_parts: int):
    """A sender's stream of parts, which ends once the sender has read all our averages (:class:`CountingStub`
    ends it then), so the reducer closes the stream only when nothing is left in flight. A sender that does
    not end it within hivemind's sender timeout after its last part (one whose peer predates this, or that is
    gone) is let go then: every part is averaged by that time."""
    received = 0
    try:
        async for msg in stream:
            received += 1
            yield msg
    except asyncio.TimeoutError:
        if received < num_parts:
            raise


_READ_ALL_FALLBACK_SECONDS = 30.0
"""How long a sender keeps its end open for missing averages when hivemind sets no reducer timeout."""
