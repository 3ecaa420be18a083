"""The rank grid: one frozen object that owns every degree, coordinate and mesh fact of a job.

Pure arithmetic (no torch at import), shared by the controller (spec checks, placement, recovery) and the
workers (process groups, stage ownership, data slices), so no module computes "which rank is where" by hand.

Order, outermost to innermost: ``dp × pp × cp × tp``. Tensor-parallel peers are consecutive ranks (the ones a
placement group packs onto one node), then context, then pipeline, then data parallel: the bandwidth order of
the seed articles (TP innermost, DP outermost; Llama 3's [TP, CP, PP, DP]). Expert parallelism adds no ranks:
its groups are carved out of the data × context-parallel ranks (the ``dp · cp`` ranks of one pp stage and tp
index, cp innermost: cp ranks hold different tokens of the same sequences, and routing is per token), so ``ep``
must divide ``dp · cp`` and does not count in the world size.

Why our own and not torchtitan's ``ParallelDims``: that one lives inside torchtitan and builds its meshes on
construction; ours must also run where torch is not imported (the planner, the CLI) and carry the
recovery facts (replica peers) that only raymesh needs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

AXES = ("dp", "pp", "cp", "ep", "tp")
_RANK_AXES = ("dp", "pp", "cp", "tp")  # the axes that multiply into the world size, outermost first


@dataclass(frozen=True)
class Coordinates:
    """Where one rank sits: its index along each rank axis (``ep`` is derived from ``dp`` and ``cp``)."""

    dp: int
    pp: int
    tp: int
    cp: int = 0
    ep: int = 0


@dataclass(frozen=True)
class Grid:
    """Degrees of a job's parallel axes and everything derived from them."""

    dp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    tp: int = 1
    dp_shard: int | None = None  # hybrid sharding: ZeRO shards inside groups of this many dp ranks; None: all of dp

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Grid.{axis}={value!r}: every degree is a whole number >= 1")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"Grid.ep={self.ep} does not divide dp*cp={self.dp * self.cp}: expert groups are carved "
                             "out of the data x context-parallel ranks; pick ep from the divisors of dp*cp")
        shard = self.dp_shard
        if shard is not None and (not isinstance(shard, int) or isinstance(shard, bool) or shard < 1
                                  or self.dp % shard):
            raise ValueError(f"Grid.dp_shard={shard!r} does not divide dp={self.dp}: shard groups split the "
                             "data-parallel ranks evenly; pick dp_shard from the divisors of dp")

    @classmethod
    def from_parallel(cls, parallel: Any) -> Grid:
        """The grid of a job's ``parallel`` section: a ``ParallelSpec``, a worker spec or a plain mapping.

        Axes the section does not name (``ep`` before its issue lands, ``cp`` in older worker dicts) are 1.
        """
        get = parallel.get if isinstance(parallel, Mapping) else lambda k, d: getattr(parallel, k, d)
        shard = get("dp_shard", None)
        return cls(**{axis: int(get(axis, 1) or 1) for axis in AXES}, dp_shard=None if shard is None else int(shard))

    # -- sizes and switches ------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def positions(self) -> int:
        """Ranks in one data-parallel replica: each holds a different piece of the model."""
        return self.pp * self.cp * self.tp

    @property
    def node_block(self) -> int:
        """Consecutive ranks placed on one node together: a tp group times its cp peers (the two dims with traffic
        every layer; ``orchestrator.runtime.placement`` packs each block into one placement group)."""
        return self.tp * self.cp

    @property
    def shard_size(self) -> int:
        """Data-parallel ranks one ZeRO shard group spans: ``dp_shard``, or all of dp."""
        return self.dp if self.dp_shard is None else self.dp_shard

    @property
    def replicas(self) -> int:
        """Shard groups (hybrid sharding's replicas): each holds the whole sharded state once."""
        return self.dp // self.shard_size

    @property
    def hybrid(self) -> bool:
        """Whether ZeRO shards within groups smaller than dp and replicates across them (HSDP): the mesh then
        splits dp into ``dp_replicate × dp_shard`` (``mesh_dims``)."""
        return self.shard_size < self.dp

    def describe(self) -> str:
        """``dp*pp*tp = 2*2*2`` style, naming the enabled optional axes too (for messages)."""
        axes = [a for a in _RANK_AXES if a != "cp" or self.cp_enabled]
        return f"{'*'.join(axes)} = {'*'.join(str(getattr(self, a)) for a in axes)}"

    def with_dp(self, dp: int) -> Grid:
        """The same grid at another data-parallel degree (elastic resize); ``ep`` kept where it still divides."""
        shard = self.dp_shard if self.dp_shard is not None and dp % self.dp_shard == 0 else None
        return Grid(dp=dp, pp=self.pp, cp=self.cp, ep=self.ep if dp * self.cp % self.ep == 0 else 1, tp=self.tp,
                    dp_shard=shard)

    # -- ranks <-> coordinates ---------------------------------------------------------------

    def ranks(self) -> range:
        return range(self.world_size)

    def coords(self, rank: int) -> Coordinates:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in this {self.world_size}-rank grid ({self.describe()})")
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        pp = (rank // (self.tp * self.cp)) % self.pp
        dp = rank // self.positions
        return Coordinates(dp=dp, pp=pp, tp=tp, cp=cp, ep=(dp * self.cp + cp) % self.ep)

    def rank_of(self, dp: int = 0, pp: int = 0, cp: int = 0, tp: int = 0) -> int:
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp

    def coords_dict(self, rank: int) -> dict[str, int]:
        """A rank's coordinates as the layout JSON shows them: dp, pp, tp, plus cp/ep where enabled."""
        c = self.coords(rank)
        out = {"dp": c.dp, "pp": c.pp, "tp": c.tp}
        if self.cp_enabled:
            out["cp"] = c.cp
        if self.ep_enabled:
            out["ep"] = c.ep
        return out

    def position(self, rank: int) -> tuple[int, int, int]:
        """``(pp, cp, tp)``: which piece of the model a rank holds; dp replicas of one position hold the same."""
        c = self.coords(rank)
        return c.pp, c.cp, c.tp

    # -- meshes --------------------------------------------------------------------------------

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """Named dims of the job's ``DeviceMesh``: dp, pp, tp always (code indexes them unconditionally),
        cp only where enabled, in rank order. Under hybrid sharding dp is two dims, ``dp_replicate`` (outer)
        and ``dp_shard`` (inner, so a shard group is the nearest dp ranks); the mesh also names their
        flattening ``dp``, so ``mesh["dp"]`` still means every data-parallel rank."""
        dims = tuple(a for a in _RANK_AXES if a != "cp" or self.cp_enabled)
        return ("dp_replicate", "dp_shard", *dims[1:]) if self.hybrid else dims

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        sizes = {"dp_replicate": self.replicas, "dp_shard": self.shard_size}
        return tuple(sizes[a] if a in sizes else getattr(self, a) for a in self.mesh_dims)

    def shard_peers(self, rank: int) -> list[int]:
        """The ranks ``rank``'s ZeRO state is sharded over: its position in each dp index of its shard group
        (dp indices ``[g * dp_shard, (g + 1) * dp_shard)``), times cp where enabled (cp ranks shard with dp)."""
        c = self.coords(rank)
        first = c.dp - c.dp % self.shard_size
        return [self.rank_of(dp=d, pp=c.pp, cp=cp, tp=c.tp)
                for d in range(first, first + self.shard_size) for cp in range(self.cp)]

    EXPERT_MESH_DIMS = ("edp", "ep", "pp", "tp")

    @property
    def expert_mesh_shape(self) -> tuple[int, int, int, int]:
        """Shape of the expert mesh (dims ``EXPERT_MESH_DIMS``): the data index ``dp * cp + cp_index`` split as
        ``edp * ep + ep_index``, then the pp stage and tp.

        ``ep`` groups are ranks of one pp stage and tp index whose data index differs only in ``% ep`` (they split
        the experts; with cp > 1, cp peers first); ``edp`` groups are the ``dp * cp / ep`` ranks of one stage and
        tp index holding the same experts (they reduce the experts' gradients, as dp x cp does for dense weights);
        ``tp`` is the tensor-parallel group, over which expert tensor parallelism (``parallel.expert_tp``) splits
        each expert. ``expert_mesh_ranks`` says which rank sits where (the rank order puts pp between dp and cp).
        """
        return self.dp * self.cp // self.ep, self.ep, self.pp, self.tp

    @property
    def expert_stride(self) -> int:
        """How many dp indices apart the nearest ranks of one position holding the same experts sit: ep, or with
        ep carved from dp x cp, ep / gcd(ep, cp) (1 when the cp peers alone split the experts)."""
        return self.ep // math.gcd(self.ep, self.cp)

    def expert_mesh_ranks(self) -> list:
        """The ranks of the expert mesh, nested lists of ``expert_mesh_shape``."""
        edp, ep, pp, tp = self.expert_mesh_shape
        return [[[[self.rank_of(dp=d // self.cp, pp=p, cp=d % self.cp, tp=t) for t in range(tp)] for p in range(pp)]
                 for d in range(g * ep, (g + 1) * ep)] for g in range(edp)]

    # -- recovery ------------------------------------------------------------------------------

    def replica_peer(self, rank: int) -> int | None:
        """Where a rank's in-memory replica lives: the same position in the next data-parallel replica holding
        the same experts (another node when replicas span nodes), else the same position in the next replica,
        else the next rank; None in a one-rank job. Under hybrid sharding, the same position and shard in the next
        replica (a whole shard group on): that rank holds the same ZeRO shard, so a holder there holds what a
        replacement needs in another group, one the rank's own failure domain (its shard group's node) spares."""
        if self.world_size == 1:
            return None
        step = 1
        if self.hybrid:
            step = self.positions * self.shard_size
        elif self.dp_enabled:
            step = self.positions * (self.expert_stride if self.dp > self.expert_stride else 1)
        return (rank + step) % self.world_size

    def same_state(self, a: int, b: int) -> bool:
        """Whether ranks ``a`` and ``b`` hold the same piece of the model: same position and, with expert
        parallelism, the same experts (the same ep index)."""
        return self.position(a) == self.position(b) and self.coords(a).ep == self.coords(b).ep
