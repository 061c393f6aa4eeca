"""The canonical butterfly all-reduce: every peer ends a round with bitwise-identical bytes.

Stock hivemind (1.1.x) gives each peer ``own + decompress(compress(avg - own))``, so peers end up with
different bytes (~1e-7 relative uncompressed, ~1e-3 of |avg - own| with fp16) and clusters drift apart round
after round. Here every reducer sends back ``compress(avg)`` (not the delta) and every peer, the reducer
included for its own span, *copies* ``decompress(compress(avg))`` into its buffer. The overrides:

- ``_accumulate_parts_streaming``: send the average, compressed with the reducer's own codec (not the
  sender's choice), so each span has exactly one serialized form;
- ``_communicate_with_peer`` (own span only): round-trip the average through the same serializer the wire
  uses, so the reducer keeps what it sent, not its more precise local value;
- :class:`InPlaceParts` (the tensor part container): each averaged part is copied into the slice of the
  buffer it came from as it arrives, instead of hivemind collecting every part and ``torch.cat``-ing them into
  a second full-size tensor (2x the shard in flight); a failed reducer's span keeps our own values (not zeros,
  which under copy semantics would erase the span); we count it and report the round incomplete.

Our own codecs (``--hv.compression`` bf16/int8/int4/int2/sparse, ``open_diloco.outer.codecs``) cannot ride
hivemind's wire format, a fixed protobuf enum: a part travels as the codec's bytes in a uint8 tensor
serialized with ``NONE`` (:class:`CodecCompression`). Senders encode their parts (the outer loop already
rounded them to the codec's grid, so this is lossless); the reducer decodes each sender's part, averages in
fp32 (its own part round trips through the codec too, like everyone's), and encodes the average once; every
peer, the reducer too, decodes those bytes and copies them. Part sizes are powers of two times the codec's
block, so no block straddles parts.

A reducer judges every sender (``open_diloco.outer.guard``): one whose claimed ‖Δ‖ is missing or out of bound
is left out of its span before its first part; one whose part is not finite, whose weight is not the one it
gathered (in (0, 1]), or whose parts add up to more than it claimed is left out from there on, like a sender
that failed. Either way it is named in the round's report (``rejected``). With ``--hv.robust-mean`` every
sender's parts are scaled to the round's median claim.

A span's stream ends only once its sender has read every average (``galaxy/span_streams.py`` says why and
how).

Bytes are measured on the wire messages (protobuf ``ByteSize`` of every tensor part we send and receive).
Every codec must go through this copy-the-decoded-average path, or the hash check will catch it.
"""

from __future__ import annotations

import asyncio
import logging

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartContainer
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    NoCompression,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import amap_in_executor

from open_diloco.galaxy.span_streams import CountingStub, until_sender_read_all
from open_diloco.outer.codecs import WireCodecs, all_finite
from open_diloco.outer.guard import ClaimCheck, valid_weight

log = logging.getLogger(__name__)


class CodecCompression(CompressionBase):
    """Our codecs as a hivemind compression: an encoding travels as a uint8 tensor serialized with ``NONE``.
    ``compress`` is the senders' side (their parts are already on the codec's grid), with the codec of the
    tensor the part belongs to (``info.key``: the values, or the sparse rule's block scores);
    ``estimate_compression_ratio`` sizes the parts (a power of two: parts start on block boundaries)."""

    compression_type = runtime_pb2.CompressionType.NONE

    def __init__(self, codecs: WireCodecs):
        self.codecs = codecs

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> runtime_pb2.Tensor:
        return encoded_message(
            self.codecs.for_key(info.key).encode(tensor.detach().reshape(-1), on_grid=True)
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return self.codecs.decode(NoCompression().extract(serialized_tensor))

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.codecs.for_key(info.key).wire_ratio


def encoded_message(blob: torch.Tensor) -> runtime_pb2.Tensor:
    return NoCompression().compress(blob, CompressionInfo.from_tensor(blob))


class CanonicalAllReduce(AllReduceRunner):
    """Butterfly all-reduce whose result is bitwise identical on every peer (see the module docstring)."""

    def __init__(self, *args, claims: ClaimCheck | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.claims = claims
        """The senders' claimed ‖Δ‖ and the bound they are held to; ``None``: only finiteness is checked."""
        self.tensor_part_container = InPlaceParts.like(self.tensor_part_container)
        own_index = self.ordered_peer_ids.index(self.peer_id)
        self.parts_for_local_averaging = self.tensor_part_container.get_raw_input_parts(own_index)
        self.tensor_part_container.own_span_parts = list(
            self.tensor_part_container._input_parts_by_peer[own_index]
        )
        compression = self.tensor_part_container.compression
        self.result_compression = compression.compression_type
        self.codecs: WireCodecs | None = (
            compression.codecs if isinstance(compression, CodecCompression) else None
        )
        self.tensor_part_container.codecs = self.codecs
        self.bytes_sent = self.bytes_received = 0
        self.rejected_senders: set = set()
        """Senders left out of the spans we reduce (and named in the report): see the module docstring."""
        self._serving, self._served = 0, asyncio.Event()

    def _codec_of_part(self, part_index: int):
        """The codec of part ``part_index`` of the span we reduce: that of the tensor it was cut from (every
        peer cuts the same tensors into the same parts)."""
        _part, info = self.tensor_part_container.own_span_parts[part_index]
        return self.codecs.for_key(info.key)

    def _serialize_result(self, averaged_part: torch.Tensor, part_index: int):
        if self.codecs is not None:  # the average is encoded once, here; everyone decodes these bytes
            return encoded_message(self._codec_of_part(part_index).encode(averaged_part))
        return serialize_torch_tensor(averaged_part, self.result_compression)

    def _deserialize_part(self, serialized: runtime_pb2.Tensor) -> torch.Tensor:
        """A sender's part as fp32 values (our codecs: decoded)."""
        part = deserialize_torch_tensor(serialized)
        return self.codecs.decode(part) if self.codecs is not None else part

    def _as_sent(self, part: torch.Tensor, part_index: int) -> torch.Tensor:
        """Our own part as the reducer would see it had it come over the wire: through our codec, or through
        hivemind's (fp16). Without the fp16 round trip the reducer's own span skipped the rounding every other
        sender's went through, so which peer reduced which span (drawn anew each round) moved the average's
        last bits: still the same bytes in every cluster (one reducer per span), but a galaxy resumed from its
        checkpoints did not retrace the straight run under fp16."""
        if self.codecs is None:
            compression = self.tensor_part_container.compression
            if isinstance(compression, NoCompression):
                return part
            return deserialize_torch_tensor(compression.compress(part, CompressionInfo.from_tensor(part)))
        codec = self._codec_of_part(part_index)
        return codec.decode(codec.encode(part.reshape(-1), on_grid=True)).view_as(part)

    async def _communicate_with_peer(self, peer_id):
        if peer_id != self.peer_id:
            try:
                return await super()._communicate_with_peer(peer_id)
            except (
                Exception
            ) as err:  # hivemind says why only at DEBUG; a partial round should say which peer, why
                log.warning(
                    "all-reduce: the exchange with peer %s failed: %r (its span keeps our values)",
                    peer_id,
                    err,
                )
                raise
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        scale = self.claims.scale(peer_id) if self.claims is not None else 1.0
        weight = self.weight
        # we started elsewhere: the cohort's average
        if self.claims is not None and peer_id in self.claims.stale:
            weight = 0.0
            self.rejected_senders.add(peer_id)
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            own = self._as_sent(tensor_part, part_index)
            averaged = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, own if scale == 1.0 else own * scale, weight=weight
            )
            if self.codecs is not None:
                codec = self._codec_of_part(part_index)
                canonical = codec.decode(codec.encode(averaged))  # what the others decode
            elif (
                self.result_compression == runtime_pb2.CompressionType.NONE
                and averaged.dtype == torch.float32
            ):
                canonical = averaged  # fp32 on the wire is exact: the others got these very bytes
            else:
                canonical = deserialize_torch_tensor(
                    self._serialize_result(averaged, part_index)
                )  # what the others got
            self.tensor_part_container.register_processed_part(peer_index, part_index, canonical)

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        # Copy of AllReduceRunner._accumulate_parts_streaming, sending compress(avg) instead of
        # compress(avg - part), compressed with our codec rather than the sender's.
        part_index = 0
        sender = self.sender_peer_ids[sender_index]
        claims = self.claims
        try:
            if claims is not None and not claims.admits(sender):
                self.rejected_senders.add(
                    sender
                )  # no valid claim, or a Δ far larger than ours: not even read
                yield _REFUSED
                return
            scale = claims.scale(sender) if claims is not None else 1.0
            loop = asyncio.get_event_loop()
            async for tensor_part, weight in amap_in_executor(
                lambda msg: (self._deserialize_part(msg.tensor_part), msg.weight),
                until_sender_read_all(stream, self.tensor_part_reducer.num_parts),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                # garbage (diverged, broken or hostile sender): averaged without it from here on. Every peer
                # of ours sends the weight it gathered, 1 at most; more would give one sender the say of many
                gathered = claims.weight(sender) if claims is not None else 1.0
                honest = all_finite(tensor_part) and weight == gathered and valid_weight(weight) is not None
                if not honest or (claims is not None and not claims.within_claim(sender, tensor_part)):
                    self.rejected_senders.add(sender)
                    yield _REFUSED
                    break
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index,
                        part_index,
                        tensor_part if scale == 1.0 else tensor_part * scale,
                        weight=weight,
                    )
                    this_part, part_index = part_index, part_index + 1
                except BannedException:  # too late (hivemind's sender timeout): averaged without it
                    yield _DROPPED
                    break
                serialized = await loop.run_in_executor(None, self._serialize_result, averaged, this_part)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    async def rpc_aggregate_part(self, stream, context):
        """We reduce a span for a peer: count its parts in and our averages out."""

        async def counted(incoming):
            async for msg in incoming:
                self.bytes_received += msg.ByteSize()
                yield msg

        self._serving += 1
        self._served.clear()
        try:
            async for msg in super().rpc_aggregate_part(counted(stream), context):
                self.bytes_sent += msg.ByteSize()
                yield msg
        finally:
            self._serving -= 1
            if self._serving == 0:
                self._served.set()

    async def finish_serving(self) -> None:
        """Our own result is ready before the last averages went out to the peers we reduce for; wait for them
        (bounded by the reducer timeout) so the byte counts are complete."""
        if self._serving:
            try:
                await asyncio.wait_for(self._served.wait(), self.reducer_timeout)
            except asyncio.TimeoutError:
                pass

    def should_delay_results(self, peer_id) -> bool:
        """Never: hivemind holds a client peer's averages (``--hv.client-mode``) until that peer has sent all
        its parts, on both ends, while our sender keeps its end open until it has read every average
        (``galaxy/span_streams.py``): each waited for the other until the reducer timeout, every round (15 s a
        round at the default timeout, measured). A client's stream runs over a connection it dialled out
        itself, which carries both directions at once: there is nothing to hold back."""
        return False

    def _get_peer_stub(self, peer):
        expected = self.tensor_part_container.num_parts_by_peer[self.ordered_peer_ids.index(peer)]
        return CountingStub(super()._get_peer_stub(peer), self, expected)

    def stats(self) -> dict[str, int]:
        return dict(
            failed_size=self.tensor_part_container.failed_size,
            banned_senders=len(self.banned_senders - self.rejected_senders),
            rejected=sorted(peer.to_base58() for peer in self.rejected_senders),
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
        )


class InPlaceParts(TensorPartContainer):
    """Hivemind's part container, writing each averaged part straight into the local buffer's slice it was cut
    from, as it arrives. Hivemind's own keeps every received part until the last one is in, then concatenates
    them: two extra full-size copies of the shard per round.

    Overwriting is safe: a part's average can only arrive after that part was serialized and sent (the reducer
    needs everyone's part first), and our own span's part was added to the reducer's accumulator before its
    average exists. A failed reducer's remaining parts are "registered" as themselves: they keep our values.
    The iteration yields nothing: when it ends, the local tensors hold the round's result."""

    @classmethod
    def like(cls, other: TensorPartContainer) -> InPlaceParts:
        return cls(
            other.local_tensors,
            other.peer_fractions,
            compression=other.compression,
            part_size_bytes=other.part_size_bytes,
            tensor_infos=other.tensor_infos,
            return_deltas=False,
            prefetch=other.prefetch,
        )

    codecs: WireCodecs | None = None
    """Set by the runner for our codecs: averages then arrive as encodings, decoded here before the copy."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._slices = [[part for part, _info in parts] for parts in self._input_parts_by_peer]
        self.own_span_parts: list = []
        """(part, info) of the span this peer reduces, set by the runner: which tensor each part belongs
        to."""

    def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor) -> None:
        if self.finished.is_set():  # a straggler after the round was torn down: the buffer is not ours now
            return
        if part_index != self._outputs_registered_by_peer[peer_index]:
            raise ValueError(
                f"part {part_index} from peer {peer_index} arrived out of order "
                f"(expected {self._outputs_registered_by_peer[peer_index]})"
            )
        target = self._slices[peer_index][part_index]
        if self.codecs is not None and part.dtype == torch.uint8:
            part = self.codecs.decode(part)
        if part is not target:
            target.copy_(part.reshape(target.shape))
        self._outputs_registered_by_peer[peer_index] += 1
        self._output_part_available[peer_index].set()

    async def iterate_output_tensors(self):
        assert not self._outputs_consumed, "output tensors are already iterated and no longer available."
        self._outputs_consumed = True
        for peer_index in range(self.group_size):
            while self._outputs_registered_by_peer[peer_index] < self.num_parts_by_peer[peer_index]:
                self._output_part_available[peer_index].clear()
                await self._output_part_available[peer_index].wait()
                if self.finished.is_set():
                    raise AllreduceException("All-reduce was terminated during iteration")
        return
        yield  # an async generator that yields nothing: the results are already in place

    def finalize(self) -> None:
        super().finalize()
        self._slices = []


_REFUSED = averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
"""What a reducer tells a sender the guard left out (``open_diloco.outer.guard``): it stops waiting at
once."""
_DROPPED = averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
"""What a reducer tells a sender it averages without (it came later than hivemind's sender timeout)."""
