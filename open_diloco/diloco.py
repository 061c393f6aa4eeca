"""The DiLoCo outer loop, in pure torch. It talks to the galaxy through the :class:`Averager` protocol and
imports nothing from hivemind, so the math is unit-testable with an in-process averager."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist


@dataclass
class RoundReport:
    """What one all-reduce of one shard did.

    ``peers`` maps each participating cluster's galaxy rank to the metadata it sent with the round
    (its ``fingerprint``: e.g. the hash of its θ_outer shard before the round), so every cluster can check
    that it and every other cluster started the round from the same weights.
    """

    group_size: int
    """Clusters whose pseudo-gradient went into the average (this one included)."""
    complete: bool
    """True when every span of the buffer was averaged over the whole group (no failed reducer)."""
    peers: dict[int, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0


class Averager(Protocol):
    """Averages one FSDP shard's flat fp32 buffer with the same shard of every other cluster."""

    def all_reduce(self, buffer: torch.Tensor, round_id: int, fingerprint: dict[str, Any]) -> RoundReport:
        """Replace ``buffer`` (flat, fp32, CPU, contiguous) in place by the galaxy average.

        Promise: every participant of the round ends with *bitwise-identical* contents (a canonical result,
        not ``own + (avg - own)``), also under compression. On a failed or partial round the report says so;
        the buffer then holds whatever could be averaged and the caller decides what to do.
        """
        ...

    def serve_state(self, get_state: Any) -> None:
        """Let late joiners download the outer state: ``get_state()`` returns ``(metadata, tensors)``."""
        ...

    def download_state(self, timeout: float) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """Fetch ``(metadata, tensors)`` from a peer serving this shard; ``None`` when none answers in time."""
        ...

    def shutdown(self) -> None:
        """Stop the averager and its DHT; idempotent; leaves no process behind."""
        ...


class OuterLoop(Protocol):
    """What the trainer calls: once to join the galaxy, then after every inner step."""

    def join_galaxy(self) -> int:
        """Adopt the galaxy's current state if it is ahead; return the inner step to continue after."""
        ...

    def after_inner_step(self, inner_step: int) -> dict[str, Any]:
        """Run an outer step if ``inner_step`` (1-based) ends a round; return its metrics, else ``{}``."""
        ...

    def inner_step_of_galaxy(self) -> int:
        """The inner step the galaxy's current round started at (a cluster behind it catches up)."""
        ...

    def close(self) -> None: ...


class NullOuterLoop:
    """No galaxy: plain data-parallel training inside the cluster."""

    def join_galaxy(self) -> int:
        return 0

    def inner_step_of_galaxy(self) -> int:
        return 0

    def after_inner_step(self, inner_step: int) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def local_shards(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's slice of every parameter: the FSDP2 local shard (a view, so writes reach the model), or
    the whole tensor for an unsharded model."""
    shards = []
    for param in model.parameters():
        data = param.data
        shards.append(data.to_local() if hasattr(data, "to_local") else data)
    return shards


def fingerprint_bytes(buffer: torch.Tensor) -> str:
    """A short hash of a tensor's exact bytes: two clusters agree on it iff their tensors are bitwise equal."""
    import xxhash

    return xxhash.xxh3_128(buffer.detach().contiguous().view(torch.uint8).numpy()).hexdigest()[:16]


def sum_of_squares(buffer: torch.Tensor, chunk: int = 1 << 18) -> float:
    """Σ x² in fp64, a chunk at a time: ``buffer.double().square().sum()`` without materialising an fp64 copy
    of the whole buffer (10x faster on a 25M-value shard). Deterministic: equal bytes give equal sums."""
    total = 0.0
    for piece in buffer.reshape(-1).split(chunk):
        total += float(piece.double().square().sum())
    return total


def combine_hashes(hashes: list[str]) -> str:
    """One hash of the whole model from its shards' hashes, in shard order."""
    import xxhash

    return xxhash.xxh3_64("".join(hashes).encode()).hexdigest()


class DiLoCo:
    """DiLoCo's outer loop for one shard of one cluster.

    θ_outer and the outer momentum live in fp32 on CPU as one flat buffer per shard, so the pseudo-gradient,
    the all-reduce and the outer SGD-Nesterov step are a few vector ops on a contiguous buffer and no rank
    ever gathers the full model. The inner optimizer is untouched: its state carries across rounds.

    Cluster-level decisions (retry a partial round, re-sync after a mismatch) are taken by all local ranks
    together through ``cluster_all_reduce`` so every shard of a cluster follows the same path.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        averager: Averager,
        *,
        local_steps: int,
        outer_lr: float,
        outer_momentum: float,
        galaxy_rank: int,
        galaxy_size: int,
        on_partial_round: str = "retry",
        max_retries: int = 2,
        cluster: ClusterComm | None = None,
        warn: Any = print,
        join_timeout: float = 60.0,
        skip_load_from_peers: bool = False,
    ):
        self.averager = averager
        self.local_steps = local_steps
        self.galaxy_rank, self.galaxy_size = galaxy_rank, galaxy_size
        self.on_partial_round, self.max_retries = on_partial_round, max_retries
        self.cluster = cluster or ClusterComm(next(model.parameters()).device)
        self.warn = warn
        self.join_timeout, self.skip_load_from_peers = join_timeout, skip_load_from_peers
        self.outer_step = 0
        self._shards = local_shards(model)
        self._numels = [shard.numel() for shard in self._shards]
        pin = any(shard.is_cuda for shard in self._shards)
        flat = torch.empty(sum(self._numels), dtype=torch.float32, pin_memory=pin)
        self._gather_local_into(flat)
        self.outer_params = torch.nn.Parameter(flat, requires_grad=False)
        self.outer_optimizer = torch.optim.SGD(
            [self.outer_params], lr=outer_lr, momentum=outer_momentum, nesterov=True
        )
        self._pseudo_grad = torch.empty_like(flat, pin_memory=pin)
        self._pseudo_grad_backup = torch.empty_like(flat)
        # Late joiners' downloads call outer_state() from the averager's thread while the loop may be stepping.
        self._state_lock = threading.Lock()
        self.averager.serve_state(self.outer_state)

    # -- state -------------------------------------------------------------------------------------------
    def outer_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """What a late joiner downloads: θ_outer, the outer momentum, and the round counter."""
        with self._state_lock:
            momentum = self.outer_optimizer.state.get(self.outer_params, {}).get("momentum_buffer")
            tensors = [self.outer_params.detach().clone()]
            if momentum is not None:
                tensors.append(momentum.clone())
            return {"outer_step": self.outer_step, "galaxy_rank": self.galaxy_rank}, tensors

    def load_outer_state(self, metadata: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        """Adopt a peer's outer state and push θ_outer into the model."""
        if tensors[0].numel() != self.outer_params.numel():
            raise ValueError(
                f"the galaxy's shard has {tensors[0].numel()} values but this cluster's has {self.outer_params.numel()}: "
                "clusters must train the same model config with the same number of ranks"
            )
        with torch.no_grad(), self._state_lock:
            self.outer_params.copy_(tensors[0])
            if len(tensors) > 1:
                self.outer_optimizer.state[self.outer_params]["momentum_buffer"] = tensors[1].clone()
            self.outer_step = int(metadata["outer_step"])
        self._scatter_outer_into_model()

    def momentum_pieces(self) -> list[torch.Tensor] | None:
        """The outer momentum split and shaped like this rank's parameter shards (for checkpoints)."""
        momentum = self.outer_optimizer.state.get(self.outer_params, {}).get("momentum_buffer")
        if momentum is None:
            return None
        return [
            piece.view_as(shard)
            for piece, shard in zip(momentum.split(self._numels), self._shards, strict=True)
        ]

    def restore_after_checkpoint(self, outer_step: int, momentum_pieces: list[torch.Tensor] | None) -> None:
        """After a checkpoint load: the model holds θ_outer (saves land on outer-step boundaries), so θ_outer
        is re-read from it; the momentum comes back from its reshardable pieces."""
        with torch.no_grad(), self._state_lock:
            self._gather_local_into(self.outer_params.data)
            if momentum_pieces is not None:
                flat = torch.cat([piece.reshape(-1).float() for piece in momentum_pieces])
                self.outer_optimizer.state[self.outer_params]["momentum_buffer"] = flat
            self.outer_step = outer_step

    def join_galaxy(self) -> int:
        """Adopt the galaxy's outer state if a peer serves a newer one than this cluster holds (a late joiner,
        or a resume from an older checkpoint); return the inner step to continue after. All local ranks must
        agree, else the shards would mix two galaxy states, so the state is adopted on every rank or none."""
        wanted = self.galaxy_size > 1 and not self.skip_load_from_peers
        downloaded = self.averager.download_state(self.join_timeout) if wanted else None
        newer = downloaded is not None and int(downloaded[0].get("outer_step", -1)) > self.outer_step
        if self.cluster.min_int(int(newer)) == 1:
            previous = self.outer_step
            self.load_outer_state(*downloaded)
            self.warn(
                f"the galaxy is at outer step {self.outer_step} (this cluster was at {previous}): "
                "downloaded θ_outer and the outer momentum from a peer"
            )
        return self.outer_step * self.local_steps

    def inner_step_of_galaxy(self) -> int:
        return self.outer_step * self.local_steps

    # -- the outer step --------------------------------------------------------------------------------
    def after_inner_step(self, inner_step: int) -> dict[str, Any]:
        """Run an outer step when ``inner_step`` ends a round (see :class:`OuterLoop`)."""
        if inner_step % self.local_steps:
            return {}
        return self.step()

    @torch.no_grad()
    def step(self) -> dict[str, Any]:
        """Pseudo-gradient, galaxy average, verification, outer SGD-Nesterov step, θ_local ← θ_outer."""
        own_hash = fingerprint_bytes(self.outer_params)
        self._gather_local_into(self._pseudo_grad)  # θ_local
        torch.sub(self.outer_params, self._pseudo_grad, out=self._pseudo_grad)  # Δ = θ_outer − θ_local
        self._pseudo_grad_backup.copy_(self._pseudo_grad)

        attempts = 0
        while True:
            report = self._average_once(own_hash)
            clusters = self.cluster.min_int(
                report.group_size if report.complete else min(report.group_size, 1)
            )
            if clusters >= self.galaxy_size or self.on_partial_round == "proceed":
                break
            if self.on_partial_round == "fail":
                raise RuntimeError(
                    f"outer step {self.outer_step + 1}: only {clusters} of {self.galaxy_size} clusters averaged and "
                    "--hv.on-partial-round is `fail`: stopping (use `retry` or `proceed` to tolerate missing clusters)"
                )
            if attempts >= self.max_retries:
                self.warn(
                    f"outer step {self.outer_step + 1}: still {clusters} of {self.galaxy_size} clusters after "
                    f"{attempts} retries: proceeding with the clusters present"
                )
                break
            attempts += 1
            self.warn(
                f"outer step {self.outer_step + 1}: partial round ({clusters} of {self.galaxy_size} clusters): "
                f"retry {attempts}/{self.max_retries}"
            )
            self._pseudo_grad.copy_(self._pseudo_grad_backup)
        if clusters < self.galaxy_size:
            self.warn(
                f"outer step {self.outer_step + 1}: proceeding with {clusters} of {self.galaxy_size} clusters"
            )

        shard_in_sync = all(meta.get("param_hash") == own_hash for meta in report.peers.values())
        in_sync = self.cluster.min_int(int(shard_in_sync)) == 1
        # After a mismatch, every cluster but the most advanced one (latest round, then lowest rank) adopts
        # that one's state. Ranks of a cluster may have seen different peers, so they agree on the outcome.
        reference = max(
            ((meta.get("round_id", self.outer_step), -rank) for rank, meta in report.peers.items()),
            default=(self.outer_step, -self.galaxy_rank),
        )
        behind = reference > (self.outer_step, -self.galaxy_rank)
        must_resync = not in_sync and self.cluster.min_int(-int(behind)) == -1
        wanted_step = -self.cluster.min_int(-(reference[0] + 1))

        with self._state_lock:
            self.outer_params.grad = self._pseudo_grad
            self.outer_optimizer.step()
            self.outer_params.grad = None
            self.outer_step += 1

        resynced = self._resync(wanted_step) if must_resync else False
        self._scatter_outer_into_model()

        return {
            "outer_step": self.outer_step,
            "galaxy_peers": report.group_size,
            "galaxy_complete": bool(report.complete),
            "allreduce_seconds": report.seconds,
            "bytes_sent": report.bytes_sent,
            "bytes_received": report.bytes_received,
            "retries": attempts,
            "in_sync": in_sync,
            "resynced": resynced,
            "pseudo_grad_norm": self.cluster.sum_float(sum_of_squares(self._pseudo_grad_backup)) ** 0.5,
            "param_checksum": self.cluster.sum_float(sum_of_squares(self.outer_params.detach())),
            "param_hash": combine_hashes(self.cluster.gather_strings(fingerprint_bytes(self.outer_params))),
        }

    def _average_once(self, own_hash: str) -> RoundReport:
        fingerprint = {"param_hash": own_hash, "numel": self.outer_params.numel()}
        try:
            report = self.averager.all_reduce(self._pseudo_grad, self.outer_step, fingerprint)
        except Exception as err:  # a failed round is a policy decision, not a crash
            self.warn(f"outer step {self.outer_step + 1}: all-reduce failed ({type(err).__name__}: {err})")
            self._pseudo_grad.copy_(self._pseudo_grad_backup)
            return RoundReport(group_size=1, complete=False)
        for rank, meta in report.peers.items():
            if rank != self.galaxy_rank and meta.get("numel") not in (None, self.outer_params.numel()):
                raise RuntimeError(
                    f"cluster {rank} averages a shard of {meta['numel']} values, this one {self.outer_params.numel()}: "
                    "every cluster must train the same model config with the same number of ranks"
                )
        return report

    def _resync(self, wanted_step: int) -> bool:
        """Adopt the outer state (θ_outer, momentum, round counter) of the galaxy's most advanced cluster after
        a hash mismatch, and say whether it worked.

        The peer may still be applying the round we want, so an older state is refused and asked for again,
        for at most ``join_timeout`` in all. Every local rank takes part and all must end on the same round,
        else the cluster keeps its own state on every shard (never a mix)."""
        deadline = time.monotonic() + self.join_timeout
        downloaded = None
        while (left := deadline - time.monotonic()) > 0:
            downloaded = self.averager.download_state(left)
            if downloaded is not None and int(downloaded[0].get("outer_step", -1)) >= wanted_step:
                break
            downloaded = None
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        step = int(downloaded[0]["outer_step"]) if downloaded is not None else -1
        ok = step >= 0 and self.cluster.min_int(step) == step == -self.cluster.min_int(-step)
        if ok:
            previous = self.outer_step
            self.load_outer_state(*downloaded)
            self.warn(
                f"outer step {previous}: θ_outer differed from the galaxy: adopted a peer's state at outer step "
                f"{self.outer_step}"
            )
        else:
            self.warn(f"outer step {self.outer_step}: θ_outer differs from the galaxy and re-sync failed")
        return ok

    def _gather_local_into(self, flat: torch.Tensor) -> None:
        for piece, shard in zip(flat.split(self._numels), self._shards, strict=True):
            piece.copy_(shard.reshape(-1), non_blocking=True)
        if any(shard.is_cuda for shard in self._shards):
            torch.cuda.synchronize()

    def _scatter_outer_into_model(self) -> None:
        for piece, shard in zip(self.outer_params.detach().split(self._numels), self._shards, strict=True):
            shard.copy_(piece.view_as(shard), non_blocking=True)

    def close(self) -> None:
        self.averager.shutdown()


class ClusterComm:
    """Agreement between the ranks of one cluster (torch.distributed), or trivial for a single process.

    Kept tiny and injectable so :class:`DiLoCo` can be tested without a process group. ``device`` is where
    the backend wants its tensors (CUDA for nccl, CPU for gloo)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def _group_active(self) -> bool:
        return dist.is_initialized() and dist.get_world_size() > 1

    def all_reduce_min(self, tensor: torch.Tensor) -> None:
        if self._group_active():
            on_device = tensor.to(self.device)
            dist.all_reduce(on_device, op=dist.ReduceOp.MIN)
            tensor.copy_(on_device.cpu())

    def min_int(self, value: int) -> int:
        tensor = torch.tensor([float(value)])
        self.all_reduce_min(tensor)
        return int(tensor.item())

    def sum_float(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        if self._group_active():
            dist.all_reduce(tensor)
        return float(tensor.item())

    def gather_strings(self, value: str) -> list[str]:
        if not self._group_active():
            return [value]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, value)
        return gathered
