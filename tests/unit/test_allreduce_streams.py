"""The all-reduce's stream ends (``open_diloco.galaxy.allreduce``): a sender holds its end open until it has read
every average, a reducer closes only after that end, and neither waits past hivemind's timeouts."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("hivemind")

from hivemind.proto import averaging_pb2  # noqa: E402

from open_diloco.galaxy.allreduce import CountingStub, _until_sender_read_all  # noqa: E402

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
    # hivemind's sender timeout ends the wait for the sender's end: all its parts are in, so that is no failure
    assert len(asyncio.run(_collect(_until_sender_read_all(_parts(3, asyncio.TimeoutError()), 3)))) == 3
    assert len(asyncio.run(_collect(_until_sender_read_all(_parts(3), 3)))) == 3
    with pytest.raises(asyncio.TimeoutError):  # a sender that stalls before its last part is one that failed
        asyncio.run(_collect(_until_sender_read_all(_parts(2, asyncio.TimeoutError()), 3)))


class _Runner:
    bytes_sent = bytes_received = 0
    reducer_timeout = 5.0


class _Reducer:
    """A reducer's stub: answers each part with ``answers`` (messages), as the sender's inputs arrive; records when
    the sender's input stream ended (the moment a real reducer may close)."""

    def __init__(self, answers):
        self.answers, self.inputs_ended_after = answers, None

    async def rpc_aggregate_part(self, inputs):
        consumed = asyncio.Event()
        read = []

        async def drain():
            async for _ in inputs:
                pass
            self.inputs_ended_after = list(read)
            consumed.set()

        task = asyncio.get_running_loop().create_task(drain())

        async def outputs():
            for message in self.answers:
                await asyncio.sleep(0.05)
                read.append(message.code)
                yield message
            await asyncio.wait_for(consumed.wait(), 2.0)
            await task

        return outputs()


def _exchange(answers, expected: int, runner=None):
    reducer = _Reducer(answers)

    async def run():
        stub = CountingStub(reducer, runner or _Runner(), expected)
        stream = await stub.rpc_aggregate_part(_parts(2))
        return [msg.code async for msg in stream]

    return asyncio.run(run()), reducer.inputs_ended_after


def test_a_sender_ends_its_stream_only_after_reading_every_average():
    codes, ended_after = _exchange([AVERAGE, AVERAGE, AVERAGE], expected=3)
    assert codes == [averaging_pb2.AVERAGED_PART] * 3
    assert len(ended_after) == 3  # not after its own last part (2 of them): after the third average


def test_a_sender_told_it_is_left_out_ends_its_stream_at_once():
    refused = averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
    codes, ended_after = _exchange([refused], expected=3)
    assert codes == [averaging_pb2.PROTOCOL_VIOLATION] and len(ended_after) == 1


def test_a_sender_gives_up_waiting_for_averages_at_the_reducer_timeout():
    runner = _Runner()
    runner.reducer_timeout = 0.3
    reducer = _Reducer([AVERAGE])

    async def run():
        stub = CountingStub(reducer, runner, 3)  # two averages never come
        stream = await stub.rpc_aggregate_part(_parts(2))
        await stream.__aiter__().__anext__()
        await asyncio.sleep(0.6)  # our end is released within the reducer timeout after the last average
        return reducer.inputs_ended_after

    assert asyncio.run(run()) == [averaging_pb2.AVERAGED_PART]
