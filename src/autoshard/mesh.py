"""The run's parallel layout, resolved once, and the one DeviceMesh that names it.

``ParallelDims`` (replicas x shard ranks x tensor-parallel ranks) is resolved from the intent and the world once,
when the Trainer is built; everything later reads it.

One DeviceMesh is built, with Lightning's names ``("data_parallel", "tensor_parallel")`` (what ModelParallelStrategy
builds and a user's ``configure_model`` or ``parallelize_fn`` indexes); ``ParallelMesh`` takes views of it by name.
For hybrid sharding ``DeviceMesh._unflatten`` splits the ``data_parallel`` dim in place, so FSDP2 composes its
placements with tensor parallel's on the same root mesh.

Ranks are numbered (replica, shard, tensor parallel), tensor parallel innermost: torchrun and SLURM number a node's
ranks consecutively, so tensor-parallel groups, then shard groups, stay inside a node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autoshard.errors import AutoShardError, BackendUnavailableError, IntentError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from autoshard.intent import ShardingIntent

DATA_PARALLEL = "data_parallel"
TENSOR_PARALLEL = "tensor_parallel"
REPLICATE = "dp_replicate"
SHARD = "dp_shard"
MESH_DIMS = (DATA_PARALLEL, TENSOR_PARALLEL)  # the one DeviceMesh: Lightning's names, what users index
HYBRID_DIMS = (REPLICATE, SHARD)  # the data_parallel dim split for hybrid sharding (HSDP)


@dataclass(frozen=True)
class ParallelDims:
    """How the world's ranks split: ``dp_replicate`` replicas of ``dp_shard``-rank shard groups, times ``tp``
    tensor-parallel ranks. ``dp_replicate == 1`` is pure FSDP over the ``dp_shard`` ranks."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AutoShardError(f"ParallelDims.{name} must be a positive integer, got {value!r}. Fix: resolve it with ParallelDims.resolve")

    @classmethod
    def resolve(cls, intent: ShardingIntent, world_size: int, num_nodes: int = 1) -> ParallelDims:
        """The dims for this world, refusing sizes that do not fit it: the one place a world is checked against the
        intent's data_parallel_size, tensor_parallel_size and shard_size, before any process starts."""
        dp, tp = _dp_tp(intent, world_size)
        replicas, shard = hybrid_sizes(intent, world_size, num_nodes) or (1, dp)
        return cls(replicas, shard, tp)

    @classmethod
    def of(cls, dp: int, tp: int = 1, hsdp: tuple[int, int] | None = None) -> ParallelDims:
        """From sizes already resolved: ``dp`` data-parallel ranks, split as ``hsdp`` = (replicas, shard) if given."""
        replicas, shard = hsdp or (1, dp)
        if replicas * shard != dp:
            raise AutoShardError(
                f"hybrid sharding {replicas} x {shard} does not cover the {dp} data-parallel ranks. Fix: resolve the"
                f" sizes with ParallelDims.resolve(intent, world_size, num_nodes)"
            )
        return cls(replicas, shard, tp)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads its own part of the batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @property
    def hybrid(self) -> bool:
        return self.dp_replicate > 1

    @property
    def hsdp(self) -> tuple[int, int] | None:
        """(replicas, shard_size) under hybrid sharding; None: pure FSDP."""
        return (self.dp_replicate, self.dp_shard) if self.hybrid else None

    @property
    def node_group(self) -> int:
        """Consecutive ranks one shard group spans with its tensor-parallel ranks (a node for shard_size='node')."""
        return self.dp_shard * self.tp

    def describe(self) -> dict[str, Any]:
        """The sizes the plan's summary prints (``settings_in_words``)."""
        return {
            "data_parallel_size": self.dp,
            "tensor_parallel_size": self.tp,
            "world_size": self.world_size,
            **({"hsdp": self.hsdp} if self.hsdp else {}),
        }


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_world_size(world_size: int) -> None:
    """Refuse a world size that is not a positive integer."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise IntentError(f"world size must be a positive integer, got {world_size!r}. Fix: Trainer(devices=N, num_nodes=M) with N, M >= 1")


def check_num_nodes(world_size: int, num_nodes: int) -> None:
    """Refuse a number of nodes the world's ranks cannot fill evenly."""
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1 or world_size % num_nodes:
        raise IntentError(f"num_nodes={num_nodes!r} does not divide the world size {world_size}. Fix: Trainer(devices=N, num_nodes=M) with N, M >= 1")


def nodes_for(world_size: int, devices_per_node: int) -> int:
    """Nodes a world of ``world_size`` ranks fills, ``devices_per_node`` ranks each (one node when it is smaller)."""
    if isinstance(devices_per_node, bool) or not isinstance(devices_per_node, int) or devices_per_node < 1:
        raise AutoShardError(f"devices per node must be a positive integer, got {devices_per_node!r}. Fix: e.g. --devices-per-node 8")
    if world_size <= devices_per_node:
        return 1
    if world_size % devices_per_node:
        raise AutoShardError(
            f"world size {world_size} does not fill whole nodes of {devices_per_node} devices."
            f" Fix: use a multiple of {devices_per_node} (e.g. {world_size - world_size % devices_per_node}),"
            f" or set the devices per node to what your nodes have"
        )
    return world_size // devices_per_node


def _dp_tp(intent: ShardingIntent, world_size: int) -> tuple[int, int]:
    """(data_parallel, tensor_parallel) for this world; pure FSDP (dp = world, tp = 1) by default."""
    check_world_size(world_size)
    tp = intent.tensor_parallel_size
    dp = intent.data_parallel_size if intent.data_parallel_size is not None else world_size // tp
    if dp * tp == world_size:
        return dp, tp
    world = f"the world size {world_size} (nodes x devices)"
    if world_size % tp:
        raise IntentError(
            f"tensor_parallel_size={tp} does not divide {world}. Fix: tensor_parallel_size= one of {', '.join(map(str, divisors(world_size)))}"
        )
    raise IntentError(
        f"data_parallel_size * tensor_parallel_size = {dp} * {tp} = {dp * tp} does not match {world}. Fix: set"
        f" data_parallel_size={world_size // tp}, or leave it unset to use every rank"
    )


def hybrid_sizes(intent: ShardingIntent, world_size: int, num_nodes: int = 1) -> tuple[int, int] | None:
    """(replicas, shard_size) of the hybrid-sharding split of the data-parallel ranks; None: pure FSDP (a shard size
    equal to the data-parallel size included). ``'node'``: the data-parallel ranks of one node."""
    if intent.shard_size is None:
        return None
    dp, _ = _dp_tp(intent, world_size)
    check_num_nodes(world_size, num_nodes)
    shard = world_size // num_nodes if intent.shard_size == "node" else int(intent.shard_size)
    stated = f"shard_size={intent.shard_size!r}" + (f" (= {shard} devices per node)" if intent.shard_size == "node" else "")
    tp = intent.tensor_parallel_size
    if intent.shard_size == "node" and tp > 1:  # a node holds shard groups x tensor-parallel groups
        if shard % tp:
            raise IntentError(
                f"shard_size='node' with tensor_parallel_size={tp}: a node's {shard} devices cannot hold whole"
                f" tensor-parallel groups of {tp}, so a group would span nodes. Fix: tensor_parallel_size= one of"
                f" {', '.join(map(str, divisors(shard)))}, or shard_size= a number of data-parallel ranks"
            )
        shard //= tp
        stated = f"shard_size='node' (= {shard} data-parallel ranks per node of {shard * tp} devices)"
    if shard > dp:
        raise IntentError(
            f"{stated} exceeds the data-parallel size {dp} (world size {world_size}): a shard group cannot hold more"
            f" ranks than there are. Fix: shard_size= one of {', '.join(map(str, divisors(dp)))}, or leave it unset"
        )
    if dp % shard:
        raise IntentError(
            f"{stated} does not divide the data-parallel size {dp}, so the ranks cannot form whole replicas of"
            f" the shard group. Fix: shard_size= one of {', '.join(map(str, divisors(dp)))}"
        )
    return None if shard == dp else (dp // shard, shard)


def _names(mesh: DeviceMesh) -> tuple[str, ...]:
    return tuple(getattr(mesh, "mesh_dim_names", None) or ())


@dataclass(frozen=True)
class ParallelMesh:
    """The one DeviceMesh (``root``: 2-D with Lightning's names, or 1-D data parallel) and its views by name;
    ``hybrid_view`` under hybrid sharding only."""

    dims: ParallelDims
    root: DeviceMesh
    hybrid_view: DeviceMesh | None = None

    @classmethod
    def of(cls, mesh: DeviceMesh, dims: ParallelDims | None = None, hsdp: tuple[int, int] | None = None) -> ParallelMesh:
        """View ``mesh`` with ``dims`` (None: read from the mesh, split as ``hsdp``); refuses dims that do not fit it."""
        names = _names(mesh)
        two_d = mesh.ndim == 2 and names == MESH_DIMS
        if mesh.ndim > 1 and not two_d:
            raise AutoShardError(
                f"autoshard shards on a 1-D data-parallel mesh or a 2-D {MESH_DIMS} mesh, got dims {names or mesh.shape}."
                f" Fix: build it with autoshard.mesh.build_mesh(dims, device_type)"
            )
        dp, tp = (mesh.size(0), mesh.size(1)) if two_d else (mesh.size(), 1)
        dims = dims or ParallelDims.of(dp, tp, hsdp)
        if (dims.dp, dims.tp) != (dp, tp):
            raise AutoShardError(
                f"the mesh has {dp} data-parallel x {tp} tensor-parallel ranks, but the run was resolved for"
                f" {dims.dp} x {dims.tp}. Fix: build the mesh from the same ParallelDims (autoshard.mesh.build_mesh)"
            )
        return cls(dims, mesh, _hybrid_view(mesh, dims) if dims.hybrid else None)

    @property
    def dp(self) -> DeviceMesh:
        """Every data-parallel rank (replicas x shard ranks) of this rank's tensor-parallel coordinate."""
        return self.root[DATA_PARALLEL] if self.root.ndim > 1 else self.root

    @property
    def tp(self) -> DeviceMesh | None:
        """This rank's tensor-parallel group; None on a mesh built without a tensor-parallel dim."""
        return self.root[TENSOR_PARALLEL] if self.root.ndim > 1 else None

    @property
    def shard(self) -> DeviceMesh:
        """What ``fully_shard`` takes: the data-parallel ranks, as (replicas, shard) under hybrid sharding."""
        return self.hybrid_view[HYBRID_DIMS] if self.hybrid_view is not None else self.dp


_VIEWS = "_autoshard_hybrid_views"  # on a root DeviceMesh: {(replicas, shard): its hybrid view}


def _hybrid_view(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The root with its data_parallel dim split into (dp_replicate, dp_shard), made once per root mesh and split:
    it creates process groups (a collective on every rank), and a second setup on the same mesh reuses it."""
    views: dict[tuple[int, int], DeviceMesh] = vars(mesh).setdefault(_VIEWS, {})
    key = (dims.dp_replicate, dims.dp_shard)
    if key not in views:
        views[key] = _split_data_parallel(mesh, dims)
    return views[key]


def _split_data_parallel(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    if hasattr(mesh, "_unflatten"):
        return mesh._unflatten(0, (dims.dp_replicate, dims.dp_shard), HYBRID_DIMS)
    if dims.tp > 1 or mesh.ndim > 1:  # torch before DeviceMesh._unflatten: only a separate 2-D mesh of the whole world
        import torch

        raise BackendUnavailableError(
            f"hybrid sharding with tensor parallel needs DeviceMesh._unflatten, which torch {torch.__version__} lacks."
            f" Fix: pip install 'torch>=2.13', or set tensor_parallel_size=1"
        )
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(mesh.device_type, (dims.dp_replicate, dims.dp_shard), mesh_dim_names=HYBRID_DIMS)


def build_mesh(dims: ParallelDims, device_type: str) -> ParallelMesh:
    """The one DeviceMesh for ``dims`` on ``device_type``, and its views; the process group must exist."""
    from torch.distributed.device_mesh import init_device_mesh

    root = init_device_mesh(device_type, (dims.dp, dims.tp), mesh_dim_names=MESH_DIMS)
    return ParallelMesh.of(root, dims)


def dp_mesh(mesh: ParallelMesh | DeviceMesh) -> DeviceMesh:
    """Every data-parallel rank (sampler, buffers, unsharded gradients, SyncBatchNorm)."""
    return mesh.dp if isinstance(mesh, ParallelMesh) else ParallelMesh.of(mesh).dp
