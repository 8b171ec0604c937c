"""One check of the launch, for every autoshard strategy: the world SLURM or torchrun started must be the one
``Trainer(devices=N, num_nodes=M)`` (or ``Fabric(...)``) describes, and ``shard_size='node'`` groups must be one node each.

Run when the Trainer or Fabric is built, before any process waits in a collective: under srun or torchrun Lightning
starts no launcher of its own, so its ``validate_settings`` never runs.
"""

from __future__ import annotations

import os
import re

from autoshard.errors import AutoShardError, IntentError


def check_launch(num_processes: int, num_nodes: int, environment: object | None = None) -> None:
    """A stale LOCAL_RANK or NODE_RANK, then torchrun's world, then SLURM's, against ``devices`` x ``num_nodes``: what
    every strategy checks at construction. Written in the Trainer's terms: Fabric's strategies restate them (``FrontEnd``)."""
    check_stale_local_rank(num_processes, num_nodes, environment)
    check_stale_node_rank(num_processes, num_nodes, environment)
    check_torchrun(num_processes, num_nodes, environment)
    check_slurm(num_processes, num_nodes, environment)


# What a launcher that starts the processes itself sets beside LOCAL_RANK: Lightning's own subprocess launcher sets
# MASTER_ADDR, MASTER_PORT, NODE_RANK, LOCAL_RANK and WORLD_SIZE in each child; without a port each process would
# choose its own free one (LightningEnvironment.main_port), so no two of them could ever meet.
RENDEZVOUS_PORTS = ("MASTER_PORT", "STANDALONE_PORT")


def _lightnings_own(environment: object | None) -> bool:
    """Whether the ranks come from Lightning's own environment variables (``LightningEnvironment``: LOCAL_RANK,
    NODE_RANK), not from torchrun's or SLURM's. ``environment``: the cluster environment Lightning chose (None: detected)."""
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment

    if environment is not None:
        return type(environment) is LightningEnvironment
    return not (TorchElasticEnvironment.detect() or SLURMEnvironment.detect())


def check_stale_local_rank(num_processes: int, num_nodes: int, environment: object | None = None) -> None:
    """A ``LOCAL_RANK`` left in the shell makes Lightning take the process for one a launcher started: it then waits
    for the rest of the world in ``init_process_group`` forever. Refused when no rendezvous port says another process
    could join. ``environment``: the cluster environment Lightning chose (None: detected)."""
    world = num_processes * num_nodes
    local = os.environ.get("LOCAL_RANK")
    if world <= 1 or local is None or any(os.environ.get(name) for name in RENDEZVOUS_PORTS):
        return
    if not _lightnings_own(environment):
        return
    node = os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0"))
    rank = int(node) * num_processes + int(local) if node.isdigit() and local.isdigit() else None
    member = f"'MEMBER: {rank + 1}/{world}'" if rank is not None else "init_process_group"
    nodes = f", num_nodes={num_nodes}" if num_nodes > 1 else ""
    raise IntentError(
        f"LOCAL_RANK={local} is set in the environment, so Lightning takes this process for one that a launcher of yours"
        f" started (one of the {world} processes Trainer(devices={num_processes}{nodes}) describes) and starts no other"
        f" process itself; but MASTER_PORT is not set, so no other process could ever join it, and it would wait at"
        f" {member} for a process that never comes. A LOCAL_RANK left in the shell (an `export`, or the environment of"
        f" an earlier torchrun job) does this. Fix: `unset LOCAL_RANK` and run the script again (Lightning then starts the {world} processes"
        f" itself); if you start each process yourself, also set MASTER_ADDR, MASTER_PORT, WORLD_SIZE={world} and"
        f" NODE_RANK in each"
    )


def check_stale_node_rank(num_processes: int, num_nodes: int, environment: object | None = None) -> None:
    """Lightning numbers this node's processes from ``NODE_RANK`` (else ``GROUP_RANK``) x devices. One left in the
    shell at or above ``num_nodes`` (an ``export NODE_RANK=1`` of an earlier multi-node job), or a node above 0 with no
    MASTER_PORT to meet node 0 at, makes every process wait in ``init_process_group`` for ranks that never come, even
    with ``devices=1`` (an autoshard strategy always builds its process group). Refused before; a real multi-node launch
    (each node's NODE_RANK below num_nodes, MASTER_ADDR and MASTER_PORT set) and torchrun's or SLURM's are unaffected."""
    name = next((n for n in ("NODE_RANK", "GROUP_RANK") if n in os.environ), None)
    if name is None or not os.environ[name].strip().isdigit() or not _lightnings_own(environment):
        return  # not a number: Lightning's own int() refuses it first
    value, world = os.environ[name], num_processes * num_nodes
    nodes = f", num_nodes={num_nodes}" if num_nodes > 1 else ""
    described = f"Trainer(devices={num_processes}{nodes}) describes " + (
        f"one node, node 0, with {'rank 0 only' if world == 1 else f'ranks 0-{world - 1}'}"
        if num_nodes == 1
        else f"nodes 0-{num_nodes - 1} with ranks 0-{world - 1}"
    )
    leftover = f"A {name} left in the shell (an `export`, or the environment of an earlier multi-node job) does this."
    node = int(value)
    first = node * num_processes
    ranks = f"rank {first}" if num_processes == 1 else f"ranks {first}-{first + num_processes - 1}"
    if node >= num_nodes:
        raise IntentError(
            f"{name}={value} is set in the environment, so Lightning numbers this node's processes from rank {first};"
            f" but {described}: rank {first} would wait at 'MEMBER: {first + 1}/{world}' forever for ranks that never"
            f" come. {leftover} Fix: `unset {name}` and run the script again; on a multi-node launch, give every node"
            f" Trainer(num_nodes=N) with N the number of nodes, and NODE_RANK from 0 to N-1"
        )
    if node > 0 and not os.environ.get("MASTER_PORT"):
        raise IntentError(
            f"{name}={value} is set in the environment, so this process is on node {node} ({ranks} of {world}), but MASTER_PORT is not set: node 0 chooses a free port of its own,"
            f" so this node could never join it and would wait at 'MEMBER: {first + 1}/{world}' forever. {leftover}"
            f" Fix: for a run on this machine alone, `unset {name}` and Trainer(num_nodes=1); on a multi-node launch,"
            f" set MASTER_ADDR (node 0's address) and the same MASTER_PORT on every node beside NODE_RANK"
        )


# SLURM's whole-number variables that Lightning or this check read (srun sets them; a bad value was set by hand).
SLURM_NUMBERS = ("SLURM_NTASKS", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_STEP_NUM_NODES", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")
# Of those, what Lightning's SLURMEnvironment itself reads with int() (checked for every strategy: lightning.guards).
SLURM_READ_BY_LIGHTNING = ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")
SLURM_TASK_LISTS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
_TASK_LIST = re.compile(r"^\d+(\(x\d+\))?(,\d+(\(x\d+\))?)*$")


def check_slurm_numbers(names: tuple[str, ...] = SLURM_NUMBERS) -> None:
    """Every SLURM variable of ``names`` read as a number holds one (``SLURM_NTASKS=abc`` gave Lightning's bare
    "invalid literal for int()"); with all of them, the task lists are in SLURM's format too (``"2(x3),1"``)."""
    for name in names:
        value = os.environ.get(name)
        if value is not None and not value.strip().isdigit():
            raise IntentError(
                f"{name}={value!r} is not a whole number, and under SLURM Lightning and autoshard read it as one (the"
                f" number of tasks, nodes or this task's rank). srun sets it for every task itself, so this value was"
                f" set by hand or by a script. Fix: `unset {name}` (or set it to the number it stands for), and launch with"
                f" `srun --ntasks-per-node=N python train.py`, which sets it"
            )
    for name in SLURM_TASK_LISTS if names == SLURM_NUMBERS else ():
        value = os.environ.get(name)
        if value is not None and not _TASK_LIST.match(value.replace(" ", "")):
            raise IntentError(
                f"{name}={value!r} is not a SLURM task list (one count per node: '8', '2(x3)', '4,2'), and autoshard"
                f" reads the tasks per node from it. srun sets it itself, so this value was set by hand or by a script."
                f" Fix: `unset {name}`, and launch with `srun --ntasks-per-node=N python train.py`, which sets it"
            )


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
    """Under srun the world comes from SLURM, not ``devices=`` / ``num_nodes=``, and Lightning's own
    ``SLURMEnvironment.validate_settings`` never runs (it also reads ``SLURM_NTASKS_PER_NODE`` as a plain number).
    Tasks per node come from the step, else the job (``"2(x3)"``, ``"4,2"``); torchrun inside an srun allocation is
    ``check_torchrun``'s."""
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    if environment is not None and not isinstance(environment, SLURMEnvironment):
        return
    if environment is None and (TorchElasticEnvironment.detect() or not SLURMEnvironment.detect()):
        return
    if SLURMEnvironment.job_name() in ("bash", "interactive"):
        return
    check_slurm_numbers()
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
        tasks = int(os.environ["SLURM_NTASKS"]) // (nodes or max(num_nodes, 1))
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
    """Under torchrun the world comes from ``--nnodes`` x ``--nproc-per-node``, which Lightning never compares with
    ``devices=`` / ``num_nodes=``: a forgotten ``num_nodes=2`` would fail only once the process group exists, and
    ``shard_size='node'`` would span the whole world."""
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
    """``shard_size='node'`` promises one node per shard group of consecutive ranks; ``srun --distribution=cyclic``
    deals ranks round-robin, and a group would then span nodes (every collective on the network). ``node_ranks``:
    each rank's node, the same list on every rank, so the same error."""
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
