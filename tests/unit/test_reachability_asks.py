"""``galaxy/reachability.py``'s ask loop leaves no failed ask unread: asyncio logs an unread task exception as
an ERROR with two tracebacks ("Task exception was never retrieved"), which the 4 × 2 `home` chaos soak showed
in cluster logs: an ask cancelled once another peer had answered, whose p2p stream call then ended in its own
error rather than the cancel. The dial-back between real DHT nodes is tests/e2e/test_reachability.py's."""

from __future__ import annotations

import asyncio
import gc
import json
from types import SimpleNamespace

from open_diloco.galaxy import reachability


class Peer:
    def __init__(self, name: str):
        self.name = name

    def to_base58(self) -> str:
        return self.name


class Writer:
    def close(self) -> None:
        pass


class Wire:
    """Stands for hivemind's ``P2P`` framing: every answer says the address is reachable."""

    @staticmethod
    async def send_raw_data(data: bytes, writer: Writer) -> None:
        pass

    @staticmethod
    async def receive_raw_data(reader: object) -> bytes:
        return json.dumps([{"maddr": "/ip4/127.0.0.1/tcp/1", "reachable": True, "error": None}]).encode()


def test_an_ask_cancelled_after_another_answered_ends_read_whatever_its_stream_call_raises(monkeypatch):
    answering, slow = Peer("answering"), Peer("slow")

    async def call_binary_stream_handler(peer, protocol):
        if peer is slow:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:  # as p2pd's stream call may end when cancelled
                raise ConnectionError("Connect failed. msg=failed to dial: dial backoff") from None
        return None, object(), Writer()

    async def candidates(node, timeout):
        return [slow, answering]

    node = SimpleNamespace(p2p=SimpleNamespace(call_binary_stream_handler=call_binary_stream_handler))
    monkeypatch.setattr(reachability, "_candidates", candidates)
    monkeypatch.setattr(reachability, "P2P", Wire)
    unread: list[dict] = []

    async def scenario():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unread.append(context))
        answer = await reachability._ask(None, node, ["/ip4/127.0.0.1/tcp/1"], seconds=5.0)
        for _ in range(3):  # let the cancelled ask end
            await asyncio.sleep(0)
        gc.collect()  # an unread task exception is reported when its task is collected
        return answer

    who, results, undialled = asyncio.run(scenario())
    assert (who, undialled) == ("answering", []) and results[0]["reachable"]
    assert not unread, [context.get("message") for context in unread]


def test_a_refusal_that_ends_an_ask_once_it_was_cancelled_is_read(monkeypatch):
    """The outer ask done with the error before the cancel reached it (``wait_for`` then raises the error)."""

    async def scenario():
        unread: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unread.append(context))

        async def refused():
            raise ConnectionError("failed to negotiate protocol: protocols not supported")

        ask = asyncio.ensure_future(refused())
        ask.add_done_callback(reachability._read_outcome)
        await asyncio.sleep(0)
        ask.cancel()  # too late: it is done with its error
        del ask
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
        return unread

    assert not asyncio.run(scenario())
