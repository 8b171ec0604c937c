"""One check of the launch, for every autoshard strategy: the world SLURM or torchrun started must be the one
``Trainer(devices=N, num_nodes=M)`` describes, and ``shard_size='node'`` groups must be one node each.

Run when the Trainer is built (``BackendMixin._configure_launcher``), before any process waits in a collective: under
srun or torchrun Lightning starts no launcher of its own, so its ``validate_settings`` never runs, for fsdp2 and
DeepSpeed alike. ``check_node_groups`` runs at setup, where the ranks' node numbers can be gathered.
"""

from __future__ import annotations

import os

from autoshard.errors import AutoShardError, IntentError


def check_launch(num_processes: int, num_nodes: int, environment: object | None = None) -> None:
    """torchrun's world, then SLURM's, against ``devices`` x ``num_nodes``: what every strategy checks at construction."""
    check_torchrun(num_processes, num_nodes, environment)
    check_slurm(num_processes, num_nodes, environment)


def _tasks_per_node(spec: str) -> list[int]:
    """SLURM's task-count lists, one count per node: ``"8"``, ``"2(x3)"`` (3 nodes of 2), ``"4,2"``, ``"2(x2),1"``."""
    counts: list[int] = []
    for part in spec.split(","):
        count, _, repeat = part.strip().partition("(x")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    return counts


def _slurm_first(*names: str) -> tuple[str, str] | None:
    """The first of ``names`` SLURM set, with its value: a step's own variable before the allocation's."""
    return next(((name, os.environ[name]) for name in names if os.environ.get(name)), None)


def check_slurm(num_processes: int, num_nodes: int, environment: object | None = None) -> None:
    """Under srun the world comes from SLURM, not ``devices=`` / ``num_nodes=``: a mismatch must stop before any
    process waits, and it must stop here, as ModelParallelStrategy starts no launcher under SLURM, so Lightning's own
    ``SLURMEnvironment.validate_settings`` never runs (and it reads ``SLURM_NTASKS_PER_NODE`` as a plain number).

    ``environment``: the cluster environment Lightning chose (None: detected as Lightning does, torchrun first, so
    torchrun started inside an srun allocation is checked by ``check_torchrun``, not here). Tasks per node are read
    from the step (``SLURM_STEP_TASKS_PER_NODE``, what srun started), else ``SLURM_NTASKS_PER_NODE``, else the
    allocation's ``SLURM_TASKS_PER_NODE`` (``"2(x3)"``, ``"4,2"``), else ``SLURM_NTASKS`` / nodes; nodes from the
    step (``SLURM_STEP_NUM_NODES``), else ``SLURM_NNODES`` / ``SLURM_JOB_NUM_NODES``. ``shard_size='node'`` resolves
    to ``devices``, so it is the tasks of one node once this check passes.
    """
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    if environment is not None and not isinstance(environment, SLURMEnvironment):
        return
    if environment is None and (TorchElasticEnvironment.detect() or not SLURMEnvironment.detect()):
        return
    if SLURMEnvironment.job_name() in ("bash", "interactive"):
        return
    found = _slurm_first("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    nodes = int(found[1]) if found else None
    spec = _slurm_first("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if spec is not None:
        counts = _tasks_per_node(spec[1])
        if len(set(counts)) > 1:
            raise IntentError(
                f"SLURM started a different number of tasks on each node ({spec[0]}={spec[1]!r}), but every node must"
                f" run the same number of tasks, one per device: Lightning takes the local ranks and the sharding takes"
                f" its node groups from Trainer(devices=N) on every node. Fix: launch with `srun --nodes={nodes or len(counts)}"
                f" --ntasks-per-node={num_processes} python train.py` and no --ntasks / -n: a total that is not nodes x tasks"
                f" per node leaves a node short"
            )
        tasks = counts[0]
        nodes = nodes or (len(counts) if "(x" in spec[1] or "," in spec[1] else None)
    else:
        total = int(os.environ["SLURM_NTASKS"])
        tasks = total // (nodes or max(num_nodes, 1))
    nodes = nodes if nodes is not None else num_nodes
    if tasks != num_processes:
        both = f", num_nodes={nodes}" if nodes != num_nodes else ""
        srun_nodes = f"--nodes={num_nodes} " if nodes != num_nodes else ""
        raise IntentError(
            f"SLURM started {tasks} task(s) per node but Trainer(devices={num_processes}): under srun Lightning takes"
            f" the world size from SLURM, so the two must be equal (one task per device). Fix: set"
            f" Trainer(devices={tasks}{both}), or launch with `srun {srun_nodes}--ntasks-per-node={num_processes}"
            f" --gres=gpu:{num_processes} python train.py`"
        )
    if nodes != num_nodes:
        raise IntentError(
            f"SLURM allocated {nodes} node(s) but Trainer(num_nodes={num_nodes}): under srun the world is SLURM's"
            f" {nodes} x {tasks} tasks, so the ranks and every node group (shard_size='node') would be wrong. Fix: set"
            f" Trainer(num_nodes={nodes}), or launch with `srun --nodes={num_nodes} --ntasks-per-node={tasks}`"
        )


def check_torchrun(num_processes: int, num_nodes: int, environment: object | None = None) -> None:
    """Under torchrun the world comes from its ``--nnodes`` x ``--nproc-per-node``, not ``devices=`` / ``num_nodes=``.

    Lightning never compares the two for ModelParallelStrategy (no launcher of its own when processes are started
    outside), so a forgotten ``num_nodes=2`` only fails once the process group exists, with Lightning's "sizes ...
    should equal the world size", and ``shard_size='node'`` would have resolved to the whole world (no hybrid
    sharding). ``environment``: the cluster environment Lightning chose (None: detected).
    """
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    if environment is not None and not isinstance(environment, TorchElasticEnvironment):
        return
    if environment is None and not TorchElasticEnvironment.detect():
        return
    world, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))
    nodes = world // per_node if per_node and world % per_node == 0 else None
    if per_node != num_processes or world != num_processes * num_nodes:
        fix = (
            f"set Trainer(devices={per_node}, num_nodes={nodes}), or launch with `torchrun --nnodes={num_nodes} --nproc-per-node={num_processes} ...`"
            if nodes
            else f"start every node with the same `torchrun --nproc-per-node={num_processes}`"
        )
        raise IntentError(
            f"torchrun started {world} processes, {per_node} on this node (WORLD_SIZE={world}, LOCAL_WORLD_SIZE="
            f"{per_node}), but Trainer(devices={num_processes}, num_nodes={num_nodes}) describes"
            f" {num_processes * num_nodes} ranks, {num_processes} per node: the ranks, the data-parallel mesh and"
            f" every node group (shard_size='node') would be wrong. Fix: {fix}"
        )


def check_node_groups(node_ranks: list[int], shard: int) -> None:
    """``shard_size='node'`` promises one node per shard group; the mesh (``autoshard.mesh``) numbers ranks
    (replica, shard, tensor parallel) with tensor parallel innermost, so a node's group is ``shard`` consecutive ranks
    (the shard group times the tensor-parallel size).

    torchrun and SLURM's default block distribution number the ranks node by node; ``srun --distribution=cyclic``
    deals them round-robin, and a group would then span nodes: every all-gather and reduce-scatter on the network.
    ``node_ranks``: each global rank's node rank, in rank order (the same list on every rank, so the same error).
    """
    groups = [node_ranks[i : i + shard] for i in range(0, len(node_ranks), shard)]
    spans = [(i, sorted(set(g))) for i, g in enumerate(groups) if len(set(g)) > 1]
    if spans:
        first, nodes = spans[0]
        raise AutoShardError(
            f"shard_size='node' needs each node's {shard} ranks to be consecutive, but ranks"
            f" {first * shard}-{first * shard + shard - 1} (shard group {first}) are on nodes {nodes} (node rank of each"
            f" rank: {node_ranks}): the launcher did not number the ranks node by node (SLURM's"
            f" --distribution=cyclic does that), so each shard group would span nodes. Fix: launch with `srun"
            f" --distribution=block` (SLURM's default) or torchrun, which number the ranks node by node"
        )


__all__ = ["check_launch", "check_node_groups", "check_slurm", "check_torchrun"]
