"""θ_outer, the outer momentum and the round counter of one FSDP shard, and what a round does to them
(the outer optimizer's math: ``outer/optimizer.py``; snapshots and checkpoint pieces:
``outer/state_transfer.py``).

Memory is the point of this module: for a 70B model every extra fp32 copy of the shard is hundreds of GB of
host memory. The outer state is exactly two flat fp32 buffers (θ_outer and the momentum); the pseudo-gradient
lives in the averager's buffer (the one that goes on the wire) and the outer step updates in place, so a
round holds three fp32 copies of the shard in all. θ_local needs no backup: it does not change until the round
ends, so a retried round recomputes Δ from it.

With a lossy dense ``--hv.compression`` and error feedback, a fourth: the error feedback ``e`` (fp32, 4 bytes
per value of the shard, like the momentum; bf16 would halve it but round away 2^-9 of what is carried each
round). A sparse round keeps no ``e``: what it does not send (and what its encoding dropped of what it sent)
stays in the model, so the model differs from θ_outer between rounds and checkpoints store θ_outer beside it
(as streaming does). ``e`` is private to the cluster: a checkpoint stores it (resharded
like the momentum), a late joiner or a re-synced cluster starts from zero (it has dropped nothing of the
galaxy's state it adopts). The residual e ← Δ_fb − Q(Δ_fb) is computed when the round is applied, from
θ_local, θ_outer and the old ``e``, all unchanged since the round started: no copy of what was sent is kept,
and a retried round sends the very same Q(Δ + e) again. The sparse ``magnitude`` rule adds the galaxy's block
scores (4 bytes per 128 values): unlike ``e`` they are shared state, the same in every cluster, since they
pick what every cluster sends.

Streaming (``--hv.fragments`` P, ``--hv.sync-delay`` τ, ``outer/streaming.py``): a round averages one
fragment, a slice of ``params``; its Δ, error feedback and outer step touch that slice only. With τ > 0 the
model moves on while the round is in flight, so θ_local of the fragment is kept as it was when the round
started (``local_at_start``, 4 bytes per value of one fragment): a retried round and the error feedback read
it instead of the model, and the landing mixes what the inner steps did since with the new θ_outer.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from open_diloco.outer.codecs import PseudoGradCompressor
from open_diloco.outer.digests import fingerprint_bytes, square_sum, sum_of_squares
from open_diloco.outer.optimizer import outer_sgd_step_, round_hparams
from open_diloco.outer.sparse import Selection
from open_diloco.outer.state_transfer import OuterStateTransfer
from open_diloco.outer.streaming import fragment_length


def local_shards(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's slice of every parameter: the FSDP2 local shard (a view, so writes reach the model), or
    the whole tensor for an unsharded model."""
    shards = []
    for param in model.parameters():
        data = param.data
        shards.append(data.to_local() if hasattr(data, "to_local") else data)
    return shards


class OuterState(OuterStateTransfer):
    """The outer state of one shard, and the copies between it and the model's local shards.

    Late joiners' downloads call :meth:`snapshot` from the averager's thread while the loop may be stepping,
    hence the lock around every change."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        momentum: float,
        nesterov: bool = True,
        warmup_rounds: int = 0,
        compressor: PseudoGradCompressor | None = None,
        error_feedback: bool = True,
        fragments: int = 1,
        sync_alpha: float = 0.5,
    ):
        self.lr, self.momentum, self.nesterov, self.warmup_rounds = lr, momentum, nesterov, warmup_rounds
        self.fragments, self.sync_alpha = fragments, sync_alpha
        self.compressor = compressor
        self._model = model  # its parameters' names and placements place the checkpoint pieces
        self._shards = local_shards(model)
        self.numels = [shard.numel() for shard in self._shards]
        self.on_gpu = any(shard.is_cuda for shard in self._shards)
        self.params = torch.empty(sum(self.numels), dtype=torch.float32, pin_memory=self.on_gpu)
        """θ_outer, flat fp32 on CPU (pinned when the model is on a GPU)."""
        self.momentum_buffer: torch.Tensor | None = None
        self.outer_step = 0
        self.lock = threading.Lock()
        self._hash: str | None = None
        self._sq_norm: float | None = None
        """:meth:`hash` of ``params``, kept until they change (a round ends with the hash the next one starts
        with). Everything that writes ``params`` goes through this class and clears it."""
        self.keeps_unsent = compressor is not None and compressor.sparse is not None
        """A sparse round sends a share of Δ: what it does not send stays in the model (see :meth:`land`), so
        the model is not θ_outer between rounds, and no error-feedback buffer is needed."""
        self.error: torch.Tensor | None = (
            torch.zeros_like(self.params)
            if compressor is not None and error_feedback and not self.keeps_unsent
            else None
        )
        """Error feedback: what the encodings dropped so far, added to the next Δ (``None``: off)."""
        self.error_feedback = error_feedback
        self._sparse_landing: tuple[Selection, torch.Tensor | None] | None = None
        """Between :meth:`apply` and :meth:`land` of a sparse round: what it sent and, with error feedback,
        what the encoding dropped of it (compact), which stays in the model."""
        self.fragment = 0
        """The fragment the current (or next) round averages."""
        self.local_at_start: torch.Tensor | None = None
        """θ_local of ``fragment`` when its round started, fp32, while that round is in flight with a sync
        delay (``None``: the model still holds it)."""
        sparse = compressor.sparse if compressor is not None else None
        self.score_numel = sparse.score_blocks(self.wire_numel) if sparse is not None else 0
        """Block scores a round carries after the values (sparse ``magnitude`` rule; 0: none)."""
        self.sparse_scores: torch.Tensor | None = (
            torch.zeros(fragments, self.score_numel) if self.score_numel else None
        )
        """The galaxy's block scores of each fragment from its last round, which pick what its next round
        sends: shared state, identical in every cluster like θ_outer (averaged in the round itself, part of
        :meth:`hash`, of snapshots and of checkpoints)."""
        self.committed_group: list[int] = []
        """The galaxy ranks whose Δ went into the last round this state holds (as its committing cluster saw
        it; empty when unknown, e.g. after a resume): a cluster that sent its Δ to that round and takes this
        state from a peer knows from it whether its own Δ is in (:meth:`adopt_round`) or not
        (:meth:`adopt`)."""
        self.gather_local_into(self.params)

    @property
    def numel(self) -> int:
        return self.params.numel()

    @property
    def wire_numel(self) -> int:
        """Values one round carries: a fragment's length (the whole shard when P = 1)."""
        return fragment_length(self.numel, self.fragments)

    @property
    def wire_buffer_numel(self) -> int:
        """The averager's buffer: a round's values, then its block scores (if any)."""
        return self.wire_numel + self.score_numel

    def region(self, fragment: int | None = None) -> slice:
        """Where ``fragment`` (default: the current one) lies in the flat shard."""
        fragment = self.fragment if fragment is None else fragment
        length = self.wire_numel
        return slice(fragment * length, min((fragment + 1) * length, self.numel))

    def codec_round(self) -> int:
        """The round id a codec derives its choices from (the sparse selection): the fragment's own round
        count, so that every fragment walks through every selection."""
        return self.outer_step // self.fragments

    def _local_pieces(self, region: slice):
        """(model piece, start, stop) for every parameter shard overlapping ``region``; offsets into the
        region."""
        offset = 0
        for shard, numel in zip(self._shards, self.numels, strict=True):
            lo, hi = max(region.start, offset), min(region.stop, offset + numel)
            if lo < hi:
                yield shard.reshape(-1)[lo - offset : hi - offset], lo - region.start, hi - region.start
            offset += numel

    def _local_region_into(self, flat: torch.Tensor, region: slice) -> None:
        """θ_local of ``region`` into ``flat``, fp32: what the round started from."""
        if self.local_at_start is not None:
            flat.copy_(self.local_at_start)
            return
        if region.start == 0 and region.stop == self.numel:
            self.gather_local_into(flat)
            return
        for piece, lo, hi in self._local_pieces(region):
            flat[lo:hi].copy_(piece, non_blocking=True)
        if self.on_gpu:
            torch.cuda.synchronize()

    def begin_round(self, fragment: int, keep_local: bool) -> None:
        """The round of ``fragment`` starts; with ``keep_local`` (a sync delay), θ_local of the fragment is
        kept as it is now, since the inner steps go on while the round is in flight."""
        with self.lock:
            self.fragment = fragment
            self.local_at_start = None
            if keep_local:
                region = self.region()
                kept = torch.empty(region.stop - region.start, dtype=torch.float32)
                self._local_region_into(kept, region)
                self.local_at_start = kept

    def land(self) -> None:
        """The current fragment's update reaches the model: θ_local ← θ_outer on the fragment, or with a sync
        delay α·θ_local + (1 − α)·θ_outer, α = ``--hv.sync-alpha`` (``outer/streaming.py`` says why); a sparse
        round lands on the values it sent only (:meth:`_land_sparse`)."""
        if self._sparse_landing is not None:
            self._land_sparse()
            return
        region = self.region()
        if self.local_at_start is None and region.start == 0 and region.stop == self.numel:
            self.scatter_into_model()
            return
        kept = self.local_at_start
        for piece, lo, hi in self._local_pieces(region):
            theta = self.params[region][lo:hi]
            if kept is None:
                piece.copy_(theta, non_blocking=True)
            else:
                mixed = (
                    piece.to("cpu", torch.float32)
                    .mul_(self.sync_alpha)
                    .add_(theta, alpha=1 - self.sync_alpha)
                )
                piece.copy_(mixed, non_blocking=True)
        self.local_at_start = None

    def drop_progress(self) -> None:
        """θ_local ← θ_outer on the whole shard, every fragment, unmixed: a held round's landing
        (``Round._hold``). Landing only the held fragment (and by ``--hv.sync-alpha`` only half of it) let
        the other fragments keep the progress of every stride the cluster trained again, so their next Δ grew
        with each hold until the guard called it out of bound (chaos soak of 2026-12-02, 20:33: 37.5 against
        a bound of 28.6, after 15 held attempts). Nothing is lost: a held cluster's progress is in no
        committed round, and it takes the majority's state when it is back."""
        self.local_at_start = None
        self.scatter_into_model()

    def _selection(self) -> Selection:
        """What the current round of a sparse run sends: a function of the round id and (``magnitude``) of the
        fragment's block scores, both the same in every cluster and unchanged from the round's start to its
        landing."""
        region = self.region()
        scores = None if self.sparse_scores is None else self.sparse_scores[self.fragment]
        return self.compressor.sparse.select(region.stop - region.start, self.codec_round(), scores)

    def _sparse_residual(self, selection: Selection) -> torch.Tensor:
        """What the encoding drops of the values a sparse round sends, r = Δ_sel − Q(Δ_sel), compact:
        recomputed from θ_outer and θ_local, unchanged since the round started (the very bits
        :meth:`pseudo_grad_into` and the codec gave the wire)."""
        local = torch.empty_like(self.params)
        self.gather_local_into(local)
        delta = selection.gather(torch.sub(self.params, local, out=local))
        sent = delta.clone()
        self.compressor.codec.round_trip_(sent)
        return delta.sub_(sent)

    def _land_sparse(self) -> None:
        """θ_local ← θ_outer on the values the round sent (less what their encoding dropped, with error
        feedback: that stays in the model, which is what error feedback means here); every other value keeps
        its local progress, to be sent in a later round. Resetting those too would make every cluster re-learn
        them each round while an error-feedback buffer counted them again: measured, that made the selection's
        period a stale step of that many rounds and diverged (docs/compression.md)."""
        selection, residual = self._sparse_landing
        self._sparse_landing = None
        local = torch.empty_like(self.params)
        self.gather_local_into(local)
        synced = selection.gather(self.params)
        if residual is not None:
            synced.sub_(residual)
        selection.scatter_(local, synced)
        for piece, shard in zip(local.split(self.numels), self._shards, strict=True):
            shard.copy_(piece.view_as(shard), non_blocking=True)

    def gather_local_into(self, flat: torch.Tensor) -> None:
        """Copy θ_local (the model's shards) into ``flat``, in fp32."""
        for piece, shard in zip(flat.split(self.numels), self._shards, strict=True):
            piece.copy_(shard.reshape(-1), non_blocking=True)
        if self.on_gpu:
            torch.cuda.synchronize()

    @torch.no_grad()
    def pseudo_grad_into(self, flat: torch.Tensor, chunk: int = 1 << 18) -> float:
        """Δ = θ_outer − θ_local of the current fragment, computed in ``flat`` (the averager's wire buffer,
        padded with zeros past a short last fragment); returns ‖Δ‖², summed a chunk at a time while the chunk
        is in cache (the same number :func:`sum_of_squares` gives, one pass over the shard fewer)."""
        region = self.region()
        delta_flat = flat[: region.stop - region.start]
        flat[delta_flat.numel() :].zero_()
        self._local_region_into(delta_flat, region)
        total = 0.0
        for theta, delta in zip(self.params[region].split(chunk), delta_flat.split(chunk), strict=True):
            torch.sub(theta, delta, out=delta)
            total += square_sum(delta)
        return total

    def pseudo_grad_for_wire_into(self, flat: torch.Tensor) -> float:
        """What this cluster sends this round, in ``flat`` (:attr:`wire_buffer_numel` values): Δ, or with a
        codec Q(Δ + e) in its wire layout, then (sparse ``magnitude``) this cluster's block scores; returns
        ‖Δ‖² (before the error feedback)."""
        total = self.pseudo_grad_into(flat)
        if self.compressor is not None and math.isfinite(total):  # a non-finite Δ is never encoded nor sent
            region = self.region()
            selection = self._selection() if self.keeps_unsent else None
            scores = flat[self.wire_numel :] if self.score_numel else None
            self.compressor.to_wire_(
                flat[: region.stop - region.start], self._error(region), selection, scores
            )
        return total

    def _error(self, region: slice) -> torch.Tensor | None:
        return None if self.error is None else self.error[region]

    @torch.no_grad()
    def _commit_error_feedback(self, chunk: int = 1 << 18) -> None:
        """e ← Δ_fb − Q(Δ_fb) with Δ_fb = Δ + e on the current fragment, Δ recomputed as
        :meth:`pseudo_grad_into` does (same operations, same bits) a chunk at a time, without a full-size
        temporary."""
        region = self.region()
        error, theta = self.error[region], self.params[region]
        if self.local_at_start is not None:
            error.add_(torch.sub(theta, self.local_at_start))
        else:
            for piece, lo, hi in self._local_pieces(region):
                for start in range(lo, hi, chunk):
                    local = piece[start - lo : start - lo + chunk].to("cpu", torch.float32)
                    span = slice(start, start + local.numel())
                    error[span].add_(torch.sub(theta[span], local))
        self.compressor.residual_(error)

    def apply(self, averaged_pseudo_grad: torch.Tensor) -> None:
        """The outer step of the current fragment with the galaxy's average Δ (consumed; with a codec, in its
        wire layout), then count the round. The model is not touched: :meth:`land` (or
        :meth:`scatter_into_model`)."""
        with self.lock:
            region = self.region()
            averaged = averaged_pseudo_grad[: region.stop - region.start]
            selection = self._settle_own_round()
            if self.compressor is not None:
                self.compressor.from_wire_(averaged, selection)
            # the galaxy's scores pick what this fragment's next round sends
            if self.sparse_scores is not None:
                self.sparse_scores[self.fragment].copy_(
                    averaged_pseudo_grad[self.wire_numel : self.wire_buffer_numel]
                )
            lr, momentum = self.hparams(self.outer_step // self.fragments + 1)
            if self.momentum_buffer is None and momentum and self.fragments > 1:
                # fragments start their momentum at different rounds: one zeroed buffer, each slice fed from 0
                self.momentum_buffer = torch.zeros_like(self.params)
            momentum_buffer = outer_sgd_step_(
                self.params[region],
                averaged,
                None if self.momentum_buffer is None else self.momentum_buffer[region],
                lr=lr,
                momentum=momentum,
                nesterov=self.nesterov,
            )
            if self.momentum_buffer is None:
                self.momentum_buffer = (
                    momentum_buffer  # one fragment: the buffer SGD made (None without momentum)
                )
            self.outer_step += 1
            self._hash = self._sq_norm = None

    def _settle_own_round(self) -> Selection | None:
        """What applying this cluster's round changes besides θ_outer, all from its own Δ (θ_outer, θ_local
        and ``e`` are unchanged since the round started): a sparse round's selection and residual for the
        landing, and the error feedback. Returns the selection (``None`` unless sparse)."""
        selection = None
        if self.keeps_unsent:
            selection = self._selection()
            residual = self._sparse_residual(selection) if self.error_feedback else None
            self._sparse_landing = (selection, residual)
        if self.compressor is not None and self.error is not None:
            self._commit_error_feedback()
        return selection

    def adopt_round(self, metadata: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        """Take a committed cluster's state after the round this cluster sent its Δ to (its Δ is in that
        average) as if this cluster had applied the round itself: the error feedback and a sparse landing
        follow its own Δ, exactly as :meth:`apply` would leave them, and the round's landing (:meth:`land`)
        keeps the inner steps taken while it was in flight. Nothing this cluster did is lost: this is a
        commit, not a re-sync."""
        with self.lock:
            self._settle_own_round()
            self._take(metadata, tensors)

    def hparams(self, round_no: int) -> tuple[float, float]:
        """(outer lr, outer momentum) of outer step ``round_no`` (1-based), warm-up included."""
        return round_hparams(round_no, lr=self.lr, momentum=self.momentum, warmup_rounds=self.warmup_rounds)

    def scatter_into_model(self) -> None:
        """θ_local ← θ_outer, in the model's dtype (the whole model: a sparse round's unsent progress too)."""
        self._sparse_landing = None
        for piece, shard in zip(self.params.split(self.numels), self._shards, strict=True):
            shard.copy_(piece.view_as(shard), non_blocking=True)

    def sq_norm(self) -> float:
        """‖θ_outer‖² of this shard (fp64), kept until θ_outer changes: the rounds' metrics and the guard's θ
        bound read it, one pass over the shard per change."""
        if self._sq_norm is None:
            self._sq_norm = sum_of_squares(self.params)
        return self._sq_norm

    def fragment_hash(self, fragment: int) -> str:
        """:func:`fingerprint_bytes` of one fragment of θ_outer (the ``fragment_hash`` metric)."""
        return fingerprint_bytes(self.params[self.region(fragment)])

    def hash(self) -> str:
        """:func:`fingerprint_bytes` of θ_outer (and the sparse block scores, which every cluster must share
        too)."""
        if self._hash is None:
            shared = (self.params,) if self.sparse_scores is None else (self.params, self.sparse_scores)
            self._hash = fingerprint_bytes(*shared)
        return self._hash
