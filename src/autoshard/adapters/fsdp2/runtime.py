"""What keeps the ranks equal for whatever the plan (or the user) left unsharded: gradients averaged across the
data-parallel ranks at the end of each backward, rank 0's copy broadcast at setup and for buffers (BUFFER_RULE).
The torch privates used here come from ``autoshard.privates.in_torch``.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoshard.mesh import ParallelMesh, dp_mesh
from autoshard.privates import in_torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

BUFFER_RULE = (
    "rank 0's copy is broadcast to every data-parallel rank at setup, before every training batch, at the start of"
    " validation, before every checkpoint save and at the end of fit (DDP's broadcast_buffers rule)"
)


GRAD_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb default
_UNSHARDED_GRADS = "_autoshard_unsharded_grads"
_ARMS = "_autoshard_arms_grad_average"  # on an FSDP unit: its forward hook queues the reduction (UnshardedGradients.arm)


def spans_data_parallel(t: torch.Tensor, dp_ranks: AbstractSet[int]) -> bool:
    """A DTensor over several data-parallel ranks keeps itself equal across them; a plain tensor, or a DTensor on the
    tensor-parallel ranks alone (a layout's ``Replicate()`` parameters), is one copy per rank that autoshard keeps equal."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) and len(dp_ranks.intersection(t.device_mesh.mesh.flatten().tolist())) > 1


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local tensor (itself, not a copy, under no_grad), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def average_unsharded_gradients(module: nn.Module, mesh: DeviceMesh | ParallelMesh, bucket_bytes: int = GRAD_BUCKET_BYTES) -> int:
    """Keep every trainable parameter left unsharded (probes, root or 0-dim parameters) identical across ranks;
    returns how many parameters got their first hook.

    Averaged over every data-parallel rank (replicas and shard ranks: over one shard group the replicas would drift
    apart). Hooks, not ``replicate()``: callback optimizers already hold these very Parameter objects. Idempotent; called
    again once Lightning has moved or materialized the parameters, it hooks what the module holds now.
    """
    import torch.distributed as dist

    group = dp_mesh(mesh).get_group()
    if dist.get_world_size(group) == 1:
        return 0
    dp_ranks = frozenset(dist.get_process_group_ranks(group))
    state: UnshardedGradients | None = getattr(module, _UNSHARDED_GRADS, None)
    if state is None:
        state = UnshardedGradients(group, bucket_bytes, dp_ranks)
        object.__setattr__(module, _UNSHARDED_GRADS, state)  # not a submodule, not a buffer
    state.group, state.bucket_bytes, state.dp_ranks, state.buckets = group, bucket_bytes, dp_ranks, None
    state.refresh()  # homes registered before: the parameters they hold now, hooked
    registered = {(id(owner), attr) for owner, attr in state.homes}
    # nn.Embedding(sparse=True): a sparse gradient cannot join a flat bucket; it keeps its own all_reduce.
    sparse = {id(p) for m in module.modules() if getattr(m, "sparse", False) is True for p in m.parameters(recurse=False)}
    count = 0
    for name, p in module.named_parameters():
        if p.requires_grad and not spans_data_parallel(p, dp_ranks) and not getattr(p, "_autoshard_grad_hook", False):
            if id(p) in sparse:
                p.register_post_accumulate_grad_hook(state.reduce_alone)
                p._autoshard_grad_hook = True  # type: ignore[attr-defined]
            else:
                path, _, attr = name.rpartition(".")
                owner = module.get_submodule(path)
                if (id(owner), attr) in registered:
                    continue
                state.params.append(p)
                state.homes.append((owner, attr))
                state.hook(p)
            count += 1
    fsdp_module = in_torch.fsdp2_api()[1]
    for unit in module.modules():
        if state.params and isinstance(unit, fsdp_module) and not getattr(unit, _ARMS, False):
            unit.register_forward_hook(torch.compiler.disable(state.arm))  # eager: adapters.compile
            object.__setattr__(unit, _ARMS, True)
    return count


@dataclass(eq=False)
class UnshardedGradients:
    """One module's unsharded trainable parameters, whose gradients are averaged at the end of each backward.

    The backward's first gradient of one of them, or of an FSDP unit's output, queues one reduction at the engine's
    final callback (where DDP and FSDP2 finish too). Every parameter goes into the same buckets on every rank, reached
    or not (zeros and a flag then), so all ranks issue the same all_reduces: a parameter only some ranks used neither
    hangs the others nor gets paired with the wrong tensor (DDP's find_unused_parameters); one no rank reached keeps
    its gradient (None stays None). The unit outputs make a rank that reached only the sharded model reduce too. Each
    micro-batch's backward is reduced: the sum of averages is the average of the sums.
    """

    group: Any
    bucket_bytes: int
    dp_ranks: AbstractSet[int] = frozenset()  # the group's global ranks (spans_data_parallel)
    params: list[nn.Parameter] = field(default_factory=list)
    homes: list[tuple[nn.Module, str]] = field(default_factory=list)  # (owning module, attribute) of each, see refresh
    buckets: list[list[nn.Parameter]] | None = None  # grad_buckets(params), kept until a parameter is replaced
    _touched: set[int] = field(default_factory=set)  # ids of the parameters whose gradient grew since the last reduction
    _queued: set[int] = field(default_factory=set)  # graph tasks (backwards) whose end will reduce

    def hook(self, param: nn.Parameter) -> None:
        param.register_post_accumulate_grad_hook(self.touched)
        param._autoshard_grad_hook = True  # type: ignore[attr-defined]

    def touched(self, param: torch.Tensor) -> None:
        self._touched.add(id(param))
        self.queue()

    def arm(self, unit: nn.Module, args: Any, output: Any) -> None:
        """An FSDP unit's forward hook: the gradient of any of its outputs queues the reduction of that backward."""
        if torch.is_grad_enabled():
            for t in in_torch.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad: self.queue())

    def queue(self) -> None:
        task = in_torch.current_graph_task_id()
        if task not in self._queued:  # by task, not a flag: a backward that raised never ran its callback
            self._queued.add(task)
            engine = in_torch.execution_engine
            # Queued again from the engine's callback, so it runs behind every callback queued during the backward:
            # FSDP2's final one reduce-scatters units whose inputs needed no grad, and which hook came first differs
            # by rank when their backwards differ; collectives must not.
            engine.queue_callback(lambda: engine.queue_callback(lambda: self.reduce(task)))

    def reduce(self, task: int) -> None:
        adopted = self.refresh()
        touched = self._touched | {id(p) for p in self.params if id(p) in adopted and p.grad is not None}
        self._touched = set()
        self._queued.discard(task)
        if adopted or self.buckets is None:
            self.buckets = grad_buckets(self.params, self.bucket_bytes)
        average_gradients(self.buckets, touched, self.group)

    def refresh(self) -> set[int]:
        """The parameters the module holds now; returns the ids of those it did not hold at registration.

        ``to_empty`` and ``load_state_dict(assign=True)`` put new Parameters in the module without the hooks; ``Module.to``
        swaps a DTensor's contents (``swap_tensors``), hooks and marks included. Each is hooked again at its home, so the
        order stays the same on every rank; a home that now holds a sharded parameter leaves the buckets.
        """
        adopted: set[int] = set()
        for i, (owner, attr) in enumerate(self.homes):
            p = owner._parameters.get(attr)  # getattr would go through Module.__getattr__: 10x slower, per parameter
            if not isinstance(p, nn.Parameter):
                continue
            swapped = p is self.params[i] and not getattr(p, "_autoshard_grad_hook", False)
            if p is not self.params[i] or swapped:
                self.params[i] = p
                adopted.add(id(p))
                if swapped:  # its hook dict stayed but is registered on the tensor it was swapped with: a dead one
                    p._post_accumulate_grad_hooks = None  # type: ignore[attr-defined]
                if not spans_data_parallel(p, self.dp_ranks) and not getattr(p, "_autoshard_grad_hook", False):
                    self.hook(p)
        if adopted:
            kept = [i for i, p in enumerate(self.params) if not spans_data_parallel(p, self.dp_ranks)]
            self.params, self.homes = [self.params[i] for i in kept], [self.homes[i] for i in kept]
        return adopted

    def reduce_alone(self, param: torch.Tensor) -> None:
        import torch.distributed as dist

        if param.grad is not None:
            dist.all_reduce(param.grad, group=self.group)
            param.grad.div_(dist.get_world_size(self.group))


def grad_buckets(params: Iterable[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """``params`` by dtype and device, in buckets of at most ``bucket_bytes``: it depends on the parameters only, so
    every rank builds the same one."""
    buckets: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    filled: dict[tuple[torch.dtype, torch.device], int] = {}
    for p in params:
        key, nbytes = (p.dtype, p.device), local(p).numel() * p.element_size()
        own = buckets.setdefault(key, [[]])
        if own[-1] and filled[key] + nbytes > bucket_bytes:
            own.append([])
            filled[key] = 0
        own[-1].append(p)
        filled[key] = filled.get(key, 0) + nbytes
    return [bucket for own in buckets.values() for bucket in own]


@torch.no_grad()  # local() of a DTensor gradient is then the very tensor it holds, written back in place
def average_gradients(buckets: list[list[nn.Parameter]], touched: AbstractSet[int], group: Any) -> int:
    """Average the gradients in ``buckets`` over ``group``, one all_reduce per bucket (``touched``: ids this rank's
    backward reached); returns how many. Bucket k+1 is flattened while k is reduced.

    A 1.0 flag per parameter rides in the bucket: only gradients some rank reached are written back. Flattening and
    the copies back are one call each (DDP's coalesced helpers): with hundreds of small parameters a Python loop of
    tensor ops costs more than the all_reduce saved.
    """
    import torch.distributed as dist

    size = dist.get_world_size(group)
    fake = dist.get_backend(group) == "fake"  # the simulated step's group: no other ranks, no values to read
    pending: tuple[list[nn.Parameter], list[torch.Tensor], torch.Tensor, Any] | None = None
    for bucket in buckets:
        flags = torch.tensor([1.0 if id(p) in touched else 0.0 for p in bucket], dtype=bucket[0].dtype, device=bucket[0].device)
        parts = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in bucket]
        flat = in_torch.flatten_dense_tensors([*parts, flags])
        work = dist.all_reduce(flat, group=group, async_op=True)
        if pending is not None:
            _write_back(*pending, size, fake, touched)
        pending = (bucket, [*parts, flags], flat, work)
    if pending is not None:
        _write_back(*pending, size, fake, touched)
    return len(buckets)


def _write_back(
    bucket: list[nn.Parameter], parts: list[torch.Tensor], flat: torch.Tensor, work: Any, size: int, fake: bool, touched: AbstractSet[int]
) -> None:
    """Wait for one bucket's all_reduce and write the averages of the parameters some rank reached into their grads."""
    work.wait()
    flat.div_(size)
    *averages, flags = in_torch.unflatten_dense_tensors(flat, parts)
    reached = [id(p) in touched for p in bucket] if fake else (flags > 0).tolist()
    into, values = [], []
    for p, used, average in zip(bucket, reached, averages):
        if not used:
            continue
        if p.grad is None:  # this rank's backward did not reach it, another's did
            p.grad = _like(p, average.clone())
        else:
            into.append(local(p.grad))
            values.append(average)
    if into:
        in_torch.foreach_copy_(into, values)


def _like(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (this rank's tensor) as a gradient of ``p``: a DTensor with ``p``'s layout when ``p`` is one."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False) if isinstance(p, DTensor) else value


_BUCKET_BYTES = 250 * 2**20  # DDP's bucket size for module states


def _broadcast_from_first(tensors: list[torch.Tensor], group: Any) -> None:
    """Overwrite ``tensors`` in place with the group's first rank's copy, coalesced in buckets (what DDP uses)."""
    import torch.distributed as dist

    if tensors and dist.get_world_size(group) > 1:
        in_torch.broadcast_coalesced(group, tensors, _BUCKET_BYTES, 0)


def broadcast_unsharded(module: nn.Module, mesh: DeviceMesh | ParallelMesh) -> None:
    """Every rank starts from rank 0's copy of whatever is not sharded, as DDP does at construction.

    Without a common seed nothing else reconciles what the plan keeps whole, nor buffers. A DTensor is broadcast
    along each mesh dimension it is replicated on. Shard placements need nothing: chunk r is rank r's own init, an
    independent draw from the same distribution, so still a valid init (and an EMA teacher's chunk r is cut from the
    same rank's student, so the pair agrees).
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    dp_group = dp_mesh(mesh).get_group()
    dp_ranks = frozenset(dist.get_process_group_ranks(dp_group))
    by_group: dict[Any, list[torch.Tensor]] = {dp_group: []}
    for t in (*module.parameters(), *module.buffers()):
        if not spans_data_parallel(t, dp_ranks):
            by_group[dp_group].append(local(t).detach())
        if not isinstance(t, DTensor):
            continue
        for dim, placement in enumerate(t.placements):
            if placement.is_replicate():
                by_group.setdefault(t.device_mesh.get_group(dim), []).append(t.to_local().detach())
    for group, tensors in by_group.items():
        _broadcast_from_first(tensors, group)


def sync_buffers(module: nn.Module, mesh: DeviceMesh | ParallelMesh) -> None:
    """Rank 0's buffers on every data-parallel rank (BUFFER_RULE): buffers updated in forward (BatchNorm statistics)
    drift apart per rank, and a checkpoint would keep whichever rank's copy it wrote."""
    from torch.distributed.tensor import DTensor

    plain = [b.detach() for b in module.buffers() if not isinstance(b, DTensor)]
    _broadcast_from_first(plain, dp_mesh(mesh).get_group())


def is_sharded(module: nn.Module) -> bool:
    """True when someone (the user's configure_model, or a previous setup) already applied fully_shard."""
    fsdp_module = in_torch.fsdp2_api()[1]
    return any(isinstance(m, fsdp_module) for m in module.modules())


def init_sharded_units(module: nn.Module) -> int:
    """FSDP2's lazy init of every outermost unit now, with every parameter counted as trainable; returns how many.

    FSDP2 fixes a unit's reduce dtype at its first forward from the parameters that require grad then; a unit frozen
    at that moment (``toggle_optimizer`` in GANs, freeze-then-unfreeze) later fails under bf16-mixed in
    ``foreach_reduce`` ("a gradient with dtype BFloat16 to a tensor with grad_dtype Float").
    """
    fully_shard, fsdp_module, _, _, _ = in_torch.fsdp2_api()
    units = [m for m in module.modules() if isinstance(m, fsdp_module)]
    inner = {id(c) for u in units for c in u.modules() if c is not u and isinstance(c, fsdp_module)}
    roots = [u for u in units if id(u) not in inner]
    frozen = [p for u in roots for p in u.parameters() if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    try:
        for unit in roots:
            fully_shard.state(unit)._lazy_init()
    finally:
        for p in frozen:
            p.requires_grad_(False)
    return len(roots)


def to_device_keeping_offloaded(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` under ``offload='params'``: the sharded parameters stay on (or go back to) the host, since
    FSDP2 refuses them elsewhere ("FSDP parameters should be materialized on CPU", measured on an H200 after
    Lightning's ``model_to_device``). Through ``Module._apply``, so a parameter keeps its identity."""
    from torch.distributed.tensor import DTensor

    module._apply(lambda t: t.to("cpu") if isinstance(t, DTensor) else t.to(device))
