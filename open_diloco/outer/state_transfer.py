"""How a shard's outer state leaves and enters :class:`~open_diloco.outer.state.OuterState`: the snapshot a
late joiner or a re-syncing cluster downloads and what taking one does, and the pieces a checkpoint stores and
what loading them does. A mixin: the buffers, the lock and the round bookkeeping it reads and writes are
``OuterState``'s (``outer/state.py`` says what each holds and why).
"""

from __future__ import annotations

from typing import Any

import torch

from open_diloco.outer.stateful import local_pieces, placed_like_params


def _flat_fp32(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Pieces shaped like the parameter shards (a checkpoint's) back into one flat fp32 buffer (a copy)."""
    return torch.cat([piece.reshape(-1).float() for piece in pieces])


class OuterStateTransfer:
    """Snapshots and checkpoint pieces of :class:`~open_diloco.outer.state.OuterState` (its mixin)."""

    # -- sharing with late joiners and re-syncing clusters ------------------------------------------------
    def snapshot(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """What a late joiner downloads: θ_outer, the outer momentum (if any), the sparse block scores (if
        any, last) and the round counter."""
        with self.lock:
            tensors = [self.params.clone()]
            if self.momentum_buffer is not None:
                tensors.append(self.momentum_buffer.clone())
            if self.sparse_scores is not None:
                tensors.append(self.sparse_scores.clone())
            metadata = {
                "outer_step": self.outer_step,
                "sparse_scores": self.sparse_scores is not None,
                "shard_hash": self.hash(),
                "committed_group": list(self.committed_group),
            }
            return metadata, tensors

    def adopt(self, metadata: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        """Take a peer's outer state and push θ_outer into the model: a re-sync or a join, onto another
        trajectory, so what this cluster kept of its own (a round in flight, the error feedback) is
        dropped."""
        with torch.no_grad(), self.lock:
            self._take(metadata, tensors)
            self.local_at_start = None  # a round in flight, if any, belonged to the trajectory we just left
            if self.error is not None:
                self.error.zero_()  # what we dropped belonged to the trajectory we just left
        self.scatter_into_model()

    @torch.no_grad()
    def _take(self, metadata: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        """θ_outer, the momentum, the block scores and the round counter from a peer's :meth:`snapshot`."""
        from open_diloco.errors import GalaxyMismatch

        if tensors[0].numel() != self.numel:
            raise GalaxyMismatch(
                f"the galaxy's shard has {tensors[0].numel()} values but this cluster's has {self.numel}: "
                "clusters must train the same model config with the same number of ranks"
            )
        tensors = list(tensors)
        scores = tensors.pop() if metadata.get("sparse_scores") else None
        self.params.copy_(tensors[0])
        self._hash = self._sq_norm = None
        self.momentum_buffer = tensors[1].clone() if len(tensors) > 1 else None
        if self.sparse_scores is not None:  # the same --hv.compression everywhere (the schema): they match
            if scores is None:
                self.sparse_scores.zero_()
            else:
                self.sparse_scores.copy_(scores.view_as(self.sparse_scores))
        self.outer_step = int(metadata["outer_step"])
        self.committed_group = [int(rank) for rank in metadata.get("committed_group", [])]

    # -- checkpoints (through DiLoCo.state_dict / load_state_dict) ------------------------------------------
    def checkpoint_state(self, streaming: bool) -> dict[str, Any]:
        """This shard's outer state for a checkpoint, pieces placed for DCP (``outer/stateful.py``): the round
        counter and ``fragments``; the momentum, the error feedback and this shard's block scores when kept;
        and where the model may not hold θ_outer at a save (``streaming``: other fragments, a sync delay; or a
        sparse round's unsent progress), θ_outer itself (``outer_params``) and, with a round in flight,
        ``sync_start`` (θ_outer with the fragment's θ_local at the round's start), so a resume can send that
        round again. Views where it can, as ``Module.state_dict``: copy before the state changes."""
        state: dict[str, Any] = {"outer_step": self.outer_step, "fragments": self.fragments}
        if self.momentum_buffer is not None:
            state["outer_momentum"] = self._placed(self.momentum_buffer)
        if self.error is not None:
            state["error_feedback"] = self._placed(self.error)
        if self.sparse_scores is not None:
            state["sparse_scores"] = self.sparse_scores
        if streaming or self.keeps_unsent:
            state["outer_params"] = self._placed(self.params)
            if self.local_at_start is not None:
                sync_start = self.params.clone()
                sync_start[self.region()] = self.local_at_start
                state["sync_start"] = self._placed(sync_start)
        return state

    @torch.no_grad()
    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Take what :meth:`checkpoint_state` gave, or the part of it a checkpoint of another kind of run
        holds, once the model's own state is loaded. Without ``outer_params`` θ_outer is read from the model
        (saves land on outer-step boundaries, where θ_local ← θ_outer); a piece it lacks keeps its fresh value
        (no momentum yet, zero error feedback), except the block scores, zeroed unless they fit
        (:meth:`sparse_scores_fit`)."""
        with self.lock:
            self.outer_step = int(state.get("outer_step", 0))
            self.fragment, self.local_at_start = self.outer_step % self.fragments, None  # the round after it
            if "outer_params" in state:
                self.params.copy_(self._flat(state["outer_params"]))
            else:
                self.gather_local_into(self.params)
            self._hash = self._sq_norm = None
            if "outer_momentum" in state:
                self.momentum_buffer = self._flat(state["outer_momentum"])
            if "error_feedback" in state and self.error is not None:
                self.error.copy_(self._flat(state["error_feedback"]))
            if "sync_start" in state:
                self.local_at_start = self._flat(state["sync_start"])[self.region()].clone()
            if self.sparse_scores is not None:
                scores = state.get("sparse_scores")
                fits = self.sparse_scores_fit(scores)
                self.sparse_scores.copy_(scores if fits else torch.zeros_like(self.sparse_scores))

    def sparse_scores_fit(self, scores: torch.Tensor | None) -> bool:
        """Whether a checkpoint's block scores can be taken: there are some, of this shard's shape (saved with
        another number of ranks they are cut from other shards). ``True`` when this run keeps none."""
        return self.sparse_scores is None or (scores is not None and scores.shape == self.sparse_scores.shape)

    def _placed(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``flat`` split and shaped like this rank's parameter shards (views), placed like the parameters."""
        pieces = [
            piece.view_as(shard) for piece, shard in zip(flat.split(self.numels), self._shards, strict=True)
        ]
        return placed_like_params(self._model, pieces)

    def _flat(self, placed: dict[str, torch.Tensor]) -> torch.Tensor:
        """A checkpoint's piece back into one flat fp32 buffer (a copy): the inverse of :meth:`_placed`."""
        return _flat_fp32(local_pieces(self._model, placed))
