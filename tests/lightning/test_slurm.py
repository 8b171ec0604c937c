"""Multi-node launches as the Trainer sees them, from the environment srun or torchrun sets (no cluster here): the
variables in their real formats, a world that differs from Trainer(devices=, num_nodes=) refused before any process
waits, with a fix the user has not applied yet, and ``shard_size="node"`` resolved to the tasks of one node.

The layout on real processes is tests/distributed/test_multinode.py (torchrun, 2 nodes x 2 on this machine).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

from autoshard.engine.launch import check_node_groups, check_slurm, check_torchrun
from autoshard.errors import AutoShardError, IntentError
from autoshard.lightning import FSDP2Strategy

LAUNCHERS = ("SLURM_", "TORCHELASTIC_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "PMI_", "OMPI_")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No launcher variable from the machine or an earlier test; what Lightning writes (MASTER_PORT) is undone."""
    saved = dict(os.environ)
    for key in [k for k in os.environ if k.startswith(LAUNCHERS)]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    yield
    os.environ.clear()
    os.environ.update(saved)


def slurm(monkeypatch: pytest.MonkeyPatch, **variables: str) -> None:
    """A task of an srun step: its ids plus ``variables`` (names without the SLURM_ prefix)."""
    for key, value in {"JOB_NAME": "train", "JOB_ID": "1234", "PROCID": "0", "LOCALID": "0", "NODEID": "0", **variables}.items():
        monkeypatch.setenv(f"SLURM_{key}", value)


def torchrun(monkeypatch: pytest.MonkeyPatch, world: int, per_node: int, rank: int = 0) -> None:
    """What torchrun sets for each worker."""
    for key, value in {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": per_node, "RANK": rank,
                       "LOCAL_RANK": rank % per_node, "GROUP_RANK": rank // per_node, "GROUP_WORLD_SIZE": world // per_node}.items():  # fmt: skip
        monkeypatch.setenv(key, str(value))


def trainer(devices: int, num_nodes: int, **intent: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=FSDP2Strategy(**intent), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip


def refused(devices: int, num_nodes: int, *fragments: str) -> str:
    with pytest.raises(IntentError) as info:
        trainer(devices, num_nodes)
    text = str(info.value)
    for fragment in fragments:
        assert fragment in text, text
    return text


def fix_of(text: str) -> str:
    assert text.count("Fix: ") == 1, text
    return text.split("Fix: ")[1]


# -- SLURM ---------------------------------------------------------------------------------------------------------
def test_two_nodes_of_two_tasks_and_node_shard_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """sbatch --nodes=2 --ntasks-per-node=2; srun python train.py; this task is node 1's second."""
    slurm(monkeypatch, NNODES="2", JOB_NUM_NODES="2", NTASKS="4", NTASKS_PER_NODE="2", TASKS_PER_NODE="2(x2)",
          STEP_NUM_NODES="2", STEP_NUM_TASKS="4", STEP_TASKS_PER_NODE="2(x2)", PROCID="3", LOCALID="1", NODEID="1")  # fmt: skip
    t = trainer(2, 2, shard_size="node")
    assert isinstance(t.strategy.cluster_environment, SLURMEnvironment)
    assert (t.world_size, t.num_nodes, t.node_rank, t.local_rank, t.global_rank) == (4, 2, 1, 1, 3)
    assert t.strategy.hsdp_sizes == (2, 2)  # "node" = the 2 tasks of one node, replicated over the 2 nodes


def test_repeat_format_and_three_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """SLURM writes repeated per-node counts as "2(x3)" (Lightning's own check would int() it and fail): 2 per node."""
    slurm(monkeypatch, NNODES="3", NTASKS="6", NTASKS_PER_NODE="2(x3)", TASKS_PER_NODE="2(x3)")
    assert trainer(2, 3, shard_size="node").strategy.hsdp_sizes == (3, 2)
    text = refused(4, 3, "SLURM started 2 task(s) per node but Trainer(devices=4)")
    assert fix_of(text).startswith("set Trainer(devices=2), or launch with `srun --ntasks-per-node=4 --gres=gpu:4")


def test_step_variables_win_over_the_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4-node allocation of 8 tasks each; `srun --nodes=2 --ntasks-per-node=4` starts a step of 2 x 4: the world."""
    slurm(monkeypatch, NNODES="2", JOB_NUM_NODES="4", NTASKS="8", NTASKS_PER_NODE="4", TASKS_PER_NODE="8(x4)",
          STEP_NUM_NODES="2", STEP_TASKS_PER_NODE="4(x2)")  # fmt: skip
    assert trainer(4, 2, shard_size="node").strategy.hsdp_sizes == (2, 4)
    refused(8, 4, "SLURM started 4 task(s) per node but Trainer(devices=8)")


def test_fewer_tasks_on_one_node_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """--nodes=2 --ntasks-per-node=4 --ntasks=6: SLURM puts 4 tasks on one node and 2 on the other."""
    slurm(monkeypatch, NNODES="2", NTASKS="6", NTASKS_PER_NODE="4", TASKS_PER_NODE="4,2", STEP_TASKS_PER_NODE="4,2")
    text = refused(4, 2, "SLURM started a different number of tasks on each node (SLURM_STEP_TASKS_PER_NODE='4,2')")
    assert fix_of(text).startswith("launch with `srun --nodes=2 --ntasks-per-node=4 python train.py` and no --ntasks")
    # Mixed forms: 2 nodes of 2 then one of 1.
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2),1")
    refused(2, 3, "SLURM_STEP_TASKS_PER_NODE='2(x2),1'")


def test_node_count_mismatch_names_the_fix_not_yet_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    slurm(monkeypatch, NNODES="2", JOB_NUM_NODES="2", NTASKS="4", NTASKS_PER_NODE="2", TASKS_PER_NODE="2(x2)")
    text = refused(2, 1, "SLURM allocated 2 node(s) but Trainer(num_nodes=1)")
    fix = fix_of(text)
    assert fix.startswith("set Trainer(num_nodes=2), or launch with `srun --nodes=1 --ntasks-per-node=2`"), fix
    assert "num_nodes=1)" not in fix  # what the user already has


def test_devices_and_nodes_both_wrong_get_one_fix_for_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """One round trip: the fix sets both, rather than devices now and num_nodes at the next launch."""
    slurm(monkeypatch, NNODES="2", NTASKS="16", NTASKS_PER_NODE="8", TASKS_PER_NODE="8(x2)")
    text = refused(4, 1, "SLURM started 8 task(s) per node but Trainer(devices=4)")
    assert fix_of(text).startswith("set Trainer(devices=8, num_nodes=2), or launch with `srun --nodes=1 --ntasks-per-node=4")


def test_only_slurm_ntasks_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """No per-node variable (srun --ntasks=4 --nodes=2): Lightning refuses it first, when it detects SLURM, with its
    own hint; autoshard's check, called alone, divides the tasks by SLURM's node count, not the Trainer's."""
    slurm(monkeypatch, NNODES="2", JOB_NUM_NODES="2", NTASKS="4")
    with pytest.raises(RuntimeError, match="--ntasks-per-node"):
        trainer(2, 2)
    check_slurm(2, 2)
    with pytest.raises(IntentError, match=r"SLURM started 2 task\(s\) per node but Trainer\(devices=4\)") as info:
        check_slurm(4, 1)
    assert fix_of(str(info.value)).startswith("set Trainer(devices=2, num_nodes=2)")


def test_interactive_allocations_are_not_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """salloc + a shell (job name "bash" / "interactive"): Lightning ignores SLURM there, and so does autoshard."""
    slurm(monkeypatch, JOB_NAME="interactive", NNODES="2", NTASKS="16", NTASKS_PER_NODE="8")
    t = trainer(1, 1)
    assert not isinstance(t.strategy.cluster_environment, SLURMEnvironment)


def test_existing_single_node_message_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    slurm(monkeypatch, NNODES="1", NTASKS="4", NTASKS_PER_NODE="4")
    text = refused(2, 1, "SLURM started 4 task(s) per node but Trainer(devices=2)")
    assert fix_of(text).startswith("set Trainer(devices=4), or launch with `srun --ntasks-per-node=2 --gres=gpu:2 python train.py`")


# -- torchrun --------------------------------------------------------------------------------------------------------
def test_torchrun_inside_an_srun_allocation_is_torchruns_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """One srun task per node runs torchrun --nproc-per-node=8: Lightning takes torchrun's environment (it has
    priority over SLURM), so SLURM's 1 task per node is not the number of devices."""
    slurm(monkeypatch, NNODES="2", NTASKS="2", NTASKS_PER_NODE="1", TASKS_PER_NODE="1(x2)")
    torchrun(monkeypatch, world=16, per_node=8, rank=9)
    t = trainer(8, 2, shard_size="node")
    assert isinstance(t.strategy.cluster_environment, TorchElasticEnvironment)
    assert (t.world_size, t.node_rank, t.local_rank) == (16, 1, 1)
    assert t.strategy.hsdp_sizes == (2, 8)


def test_torchrun_without_num_nodes_is_refused_before_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun --nnodes=2 --nproc-per-node=2 with Trainer(devices=2): Lightning alone fails only after the process
    group exists ("sizes ... should equal the world size (4)"), and shard_size='node' would have meant all 4 ranks."""
    torchrun(monkeypatch, world=4, per_node=2, rank=2)
    text = refused(2, 1, "torchrun started 4 processes, 2 on this node", "Trainer(devices=2, num_nodes=1) describes 2 ranks")
    assert fix_of(text).startswith("set Trainer(devices=2, num_nodes=2), or launch with `torchrun --nnodes=1 --nproc-per-node=2")
    text = refused(4, 1, "Trainer(devices=4, num_nodes=1) describes 4 ranks, 4 per node")  # the world matches, the nodes do not
    assert fix_of(text).startswith("set Trainer(devices=2, num_nodes=2)")
    assert trainer(2, 2, shard_size="node").strategy.hsdp_sizes == (2, 2)


def test_torchrun_with_uneven_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 0 started with --nproc-per-node=2, node 1 with 1: no Trainer(devices=) fits every node."""
    torchrun(monkeypatch, world=3, per_node=2)
    with pytest.raises(IntentError) as info:
        check_torchrun(2, 2)
    assert fix_of(str(info.value)) == "start every node with the same `torchrun --nproc-per-node=2`"


def test_no_launcher_no_check() -> None:
    check_slurm(2, 3)
    check_torchrun(2, 3)


# -- node groups at setup -------------------------------------------------------------------------------------------
def test_node_shard_groups_must_be_one_node_each() -> None:
    """torchrun and SLURM's block distribution: ranks 0-1 on node 0, 2-3 on node 1 (the real launch is
    tests/distributed/test_multinode.py). `srun --distribution=cyclic` deals them round-robin: refused."""
    check_node_groups([0, 0, 1, 1], 2)
    check_node_groups([0, 0, 0, 1, 1, 1], 3)
    with pytest.raises(AutoShardError) as info:
        check_node_groups([0, 1, 0, 1], 2)
    text = str(info.value)
    assert "ranks 0-1 (shard group 0) are on nodes [0, 1]" in text
    assert fix_of(text) == "launch with `srun --distribution=block` (SLURM's default) or torchrun, which number the ranks node by node"


# -- one check for every engine -------------------------------------------------------------------------------------
def deepspeed_strategies() -> list[Any]:
    """Lightning's DeepSpeed name (GuardedDeepSpeedStrategy through the registry) and autoshard-deepspeed."""
    pytest.importorskip("deepspeed")
    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy, GuardedDeepSpeedStrategy

    return [("deepspeed_stage_3", GuardedDeepSpeedStrategy), (AutoShardDeepSpeedStrategy(), AutoShardDeepSpeedStrategy)]


def refusal(devices: int, num_nodes: int, strategy: Any) -> str:
    with pytest.raises(IntentError) as info:
        pl.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, logger=False)
    return str(info.value)


@pytest.mark.parametrize(
    ("launch", "devices", "num_nodes", "fragment"),
    [
        ("slurm_tasks", 4, 1, "SLURM started 2 task(s) per node but Trainer(devices=4)"),
        ("slurm_nodes", 2, 1, "SLURM allocated 2 node(s) but Trainer(num_nodes=1)"),
        ("torchrun", 2, 1, "torchrun started 4 processes, 2 on this node"),
    ],
)
def test_deepspeed_strategies_refuse_the_same_launch_mismatch_with_the_same_text(
    monkeypatch: pytest.MonkeyPatch, launch: str, devices: int, num_nodes: int, fragment: str
) -> None:
    """The launch check is the strategies' common step (BackendMixin), not fsdp2's: under srun or torchrun Lightning
    starts no launcher for DeepSpeed either, so without it a wrong devices= would only fail once processes wait."""
    if launch == "torchrun":
        torchrun(monkeypatch, world=4, per_node=2, rank=1)
    else:
        slurm(monkeypatch, NNODES="2", JOB_NUM_NODES="2", NTASKS="4", NTASKS_PER_NODE="2", TASKS_PER_NODE="2(x2)")
    expected = refusal(devices, num_nodes, FSDP2Strategy())
    assert fragment in expected and fix_of(expected)
    for strategy, cls in deepspeed_strategies():
        assert refusal(devices, num_nodes, strategy) == expected, cls.__name__
    # The same launch, described right, builds each of them: the check refuses only the mismatch.
    right = (2, 2)
    for strategy, cls in deepspeed_strategies():
        built = pl.Trainer(accelerator="cpu", devices=right[0], num_nodes=right[1], strategy=strategy, logger=False)
        assert type(built.strategy) is cls and built.world_size == 4
