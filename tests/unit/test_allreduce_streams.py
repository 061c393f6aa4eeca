"""The all-reduce's stream ends (``open_diloco.galaxy.span_streams``): a sender holds its end open until it
has read every average, a reducer closes only after that end, and neither waits past hivemind's timeouts."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("hivemind")

from hivemind.proto import averaging_pb2  # noqa: E402

from open_diloco.galaxy.span_streams import CountingStub, until_sender_read_all  # noqa: E402

AVERAGE = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART)
PART = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING)


async def _parts(count: int, then: BaseException | None = None):
    for _ in range(count):
        yield PART
    if then is not None:
        raise then


async def _collect(stream) -> list:
    return [msg async for msg in stream]


def test_a_reducer_lets_a_sender_go_after_its_last_part_at_the_sender_timeout():
    # hivemind's sender timeout ends the wait for the sender's end: all its parts are in, so that is no
    # failure
    assert len(asyncio.run(_collect(until_sender_read_all(_parts(3, asyncio.TimeoutError()), 3)))) == 3
    assert len(asyncio.run(_collect(until_sender_read_all(_parts(3), 3)))) == 3
    with pytest.raises(asyncio.TimeoutError):  # a sender that stalls before its last part is one that failed
        asyncio.run(_collect(until_sender_read_all(_parts(2, asyncio.TimeoutError()), 3)))


class _Runner:
    bytes_sent = bytes_received = 0
    reducer_timeout = 5.0
    _servicer_type = None  # set below: the class whose handle names hivemind uses


class _Servicer:
    @staticmethod
    def _get_handle_name(namespace, method_name):
        return f"{namespace}::{method_name}"


_Runner._servicer_type = _Servicer


class _Stub:
    """A p2p stub whose stream is one end of a socket pair; the reducer (:func:`_reducer`) holds the other."""

    _namespace, _peer = "test", "reducer"

    def __init__(self, ends):
        self._p2p, self._ends = self, ends

    async def call_binary_stream_handler(self, peer, handle_name):
        reader, writer = self._ends
        return None, reader, writer


async def _reducer(reader, writer, answers, close_after: int | None = None) -> int | None:
    """The reducer's side: reads the sender's messages, answers each of its two parts with the next of
    ``answers`` (the rest after the second part), closes after ``close_after`` answers if given, else once the
    sender ended its stream; returns how many answers had been written when the sender's end came (or
    None)."""
    from hivemind.p2p import P2P

    written = 0
    for _ in range(2):
        await P2P.receive_protobuf(averaging_pb2.AveragingData, reader)
    for answer in answers:
        await asyncio.sleep(0.05)
        await P2P.send_protobuf(answer, writer)
        written += 1
        if close_after is not None and written == close_after:
            writer.close()
            return None
    _msg, err = await asyncio.wait_for(P2P.receive_protobuf(averaging_pb2.AveragingData, reader), 5.0)
    assert err is not None  # hivemind's END_OF_STREAM: an empty RPCError
    writer.close()
    return written


def _exchange(answers, expected: int, reducer_timeout: float = 5.0, close_after: int | None = None):
    """Our parts (two) to a reducer over a real socket pair; returns (the codes we read, when our end came,
    the seconds it took)."""
    import socket

    async def run():
        ours, theirs = socket.socketpair()
        our_reader, our_writer = await asyncio.open_connection(sock=ours)
        their_reader, their_writer = await asyncio.open_connection(sock=theirs)
        reducer = asyncio.create_task(_reducer(their_reader, their_writer, answers, close_after))
        runner = _Runner()
        runner.reducer_timeout = reducer_timeout
        start = asyncio.get_running_loop().time()
        stream = await CountingStub(_Stub((our_reader, our_writer)), runner, expected).rpc_aggregate_part(
            _parts(2)
        )
        codes = [msg.code async for msg in stream]
        return codes, await reducer, asyncio.get_running_loop().time() - start

    return asyncio.run(run())


def test_a_sender_ends_its_stream_only_after_reading_every_average():
    codes, ended_after, _ = _exchange([AVERAGE, AVERAGE, AVERAGE], expected=3)
    assert codes == [averaging_pb2.AVERAGED_PART] * 3
    assert ended_after == 3  # not after its own last part: after the third average


def test_a_sender_told_it_is_left_out_ends_its_stream_at_once():
    refused = averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
    codes, ended_after, _ = _exchange([refused], expected=3)
    assert codes == [averaging_pb2.PROTOCOL_VIOLATION] and ended_after == 1


def test_a_stream_the_reducer_cuts_short_ends_at_once():
    # a reducer that closes after one of three averages (as a cut stream looks): no wait for the other two
    codes, _, seconds = _exchange([AVERAGE, AVERAGE, AVERAGE], expected=3, close_after=1)
    assert codes == [averaging_pb2.AVERAGED_PART] and seconds < 2.0


def test_a_sender_gives_up_waiting_for_averages_at_the_reducer_timeout():
    # a reducer that answers once of three, then neither answers nor closes: our end comes at the reducer
    # timeout
    codes, ended_after, seconds = _exchange([AVERAGE], expected=3, reducer_timeout=0.5)
    assert codes == [averaging_pb2.AVERAGED_PART] and ended_after == 1 and 0.5 <= seconds < 3.0
