"""Two nodes of two processes each, launched as on a real cluster: one ``torchrun --nnodes=2 --nproc-per-node=2
--node-rank=N`` per node, both on this machine (gloo, CPU). ``FSDP2Strategy(shard_size="node")`` with
``Trainer(num_nodes=2, devices=2)`` must shard inside each node, replicate across the nodes, train, and end where
pure FSDP on the same 4 ranks ends. The docs' torchrun pair (docs/guide.md, "Launching on several nodes") is this.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from autoshard._harness import wait_for
from tests.distributed.harness import ROOT, free_port

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("multinode_worker.py")
NODES, PER_NODE = 2, 2
TIMEOUT = 150  # the whole launch; about 30 s here
# What an outer launcher (or an earlier in-process fit) may have left: torchrun must set these itself.
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun(node_rank: int, port: int, out: Path) -> list[str]:
    """The command each node runs (docs/guide.md shows it with train.py)."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={NODES}", f"--nproc-per-node={PER_NODE}", f"--node-rank={node_rank}",
        "--master-addr=127.0.0.1", f"--master-port={port}",
        str(WORKER), "--out", str(out),
    ]  # fmt: skip


def launch(out: Path, timeout: float = TIMEOUT) -> list[dict[str, Any]]:
    """Both nodes' torchrun, each in its own session so that a hang is ended with all its workers."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    port = free_port()
    nodes = []
    for node in range(NODES):
        log = open(out / f"node{node}.log", "w")
        proc = subprocess.Popen(torchrun(node, port, out), env=env, stdout=log, stderr=subprocess.STDOUT, cwd=out, start_new_session=True)
        nodes.append((proc, log))
    # A hang is ended with the whole session this test started: torchrun and its workers.
    wait_for([(f"node {n}'s torchrun", proc, log) for n, (proc, log) in enumerate(nodes)], timeout, lambda proc: os.killpg(proc.pid, signal.SIGKILL))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(NODES * PER_NODE)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One launch holds every scenario (imports dominate the cost); a port taken in between is retried once."""
    out = tmp_path_factory.mktemp("multinode")
    try:
        return launch(out)
    except AssertionError as exc:
        if "EADDRINUSE" not in str(exc) and "address already in use" not in str(exc).lower():
            raise
        return launch(out)


@pytest.mark.timeout(330)
def test_lightning_sees_two_nodes_from_torchrun(ranks: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(ranks):
        node = rank // PER_NODE  # torchrun numbers the ranks node by node
        assert r["launch"] == {"RANK": str(rank), "LOCAL_RANK": str(rank % PER_NODE), "GROUP_RANK": str(node),
                               "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}  # fmt: skip
        for scenario in ("hsdp", "auto", "fsdp"):
            seen = r[scenario]["seen"]
            assert seen == {"environment": "TorchElasticEnvironment", "num_nodes": 2, "node_rank": node, "local_rank": rank % PER_NODE,
                            "global_rank": rank, "world_size": 4, "strategy": seen["strategy"]}  # fmt: skip
        assert [r[s]["seen"]["strategy"] for s in ("hsdp", "auto", "fsdp")] == ["FSDP2Strategy", "AutoShardStrategy", "FSDP2Strategy"]


@pytest.mark.timeout(330)
@pytest.mark.parametrize("scenario", ["hsdp", "auto"])
def test_sharded_within_each_node_and_replicated_across_nodes(ranks: list[dict[str, Any]], scenario: str) -> None:
    for rank, r in enumerate(ranks):
        h, node = r[scenario], rank // PER_NODE
        assert h["hsdp"] == [NODES, PER_NODE], h["hsdp"]  # "node" resolved to the 2 devices of a node: 2 replicas
        assert h["mesh_shape"] == [2, 2] and h["mesh_dims"] == ["dp_replicate", "dp_shard"]
        assert h["coordinate"] == [node, rank % PER_NODE]
        # Each shard group is exactly one node's ranks; the replicas of a shard are the same local rank on each node.
        assert h["shard_group"] == [node * PER_NODE + i for i in range(PER_NODE)]
        assert h["replica_group"] == [n * PER_NODE + rank % PER_NODE for n in range(NODES)]
        assert h["hsdp_placements"], h["placements"]
        assert h["rows"] and all(local * 2 == rows for local, rows in h["rows"].values()), h["rows"]
    for rank in range(PER_NODE):  # rank r on node 0 and rank r + 2 on node 1 hold the same shard
        assert ranks[rank][scenario]["local"] == ranks[rank + PER_NODE][scenario]["local"]
    assert ranks[0][scenario]["local"] != ranks[1][scenario]["local"]


@pytest.mark.timeout(330)
def test_it_trains_across_nodes(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        for scenario in ("hsdp", "auto", "fsdp"):
            h = r[scenario]
            assert len(h["losses"]) == 8 and h["losses"][-1] < h["losses"][0], h["losses"]
            assert all(h["changed"][n] for n in h["full"] if not n.startswith("teacher")) and h["changed"]["teacher.0.weight"]
    for r in ranks[1:]:
        assert r["hsdp"]["full"] == ranks[0]["hsdp"]["full"]  # every rank gathers the same whole model


@pytest.mark.timeout(330)
def test_hsdp_over_nodes_matches_pure_fsdp_on_the_same_ranks(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["fsdp"]["hsdp"] is None and r["fsdp"]["mesh_shape"] == [4] and r["fsdp"]["shard_group"] == [0, 1, 2, 3]
        for scenario in ("hsdp", "auto"):
            assert r[scenario]["losses"] == pytest.approx(r["fsdp"]["losses"], abs=1e-5)
            for name, values in r["fsdp"]["full"].items():
                torch.testing.assert_close(torch.tensor(r[scenario]["full"][name]), torch.tensor(values), rtol=0, atol=1e-5)
