"""Tensor parallel from the model's own plan on 4 real gloo processes (data parallel 2 x tensor parallel 2).

``find_tp_plan(model).apply(model, mesh["tp"])`` then ``fully_shard`` over ``mesh["dp"]``: tiny transformers models
(Llama, Llama with tied embeddings, Qwen2 with biased projections, Qwen3 with its head norms) and a model of one's
own with a plain ``_tp_plan`` train like one process on the global batch, with the placements of their plan; the
parameters the plan leaves whole get equal gradients on both ranks of a tensor-parallel pair. Through Lightning,
``FSDP2Strategy(tensor_parallel_size=2)`` trains the same way, each tensor-parallel pair reading one batch; its DCP
checkpoints resume across tensor-parallel sizes (2 -> 1 -> 2 on 4 ranks, and 2 -> 1 or 2 on 2 ranks) bit for bit,
and ``autoshard convert --to safetensors`` turns one into the full state dict. One 4-process run holds every 4-rank
scenario (imports dominate the cost), one 2-process run the resumes on fewer ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.harness import run_workers

pytest.importorskip("transformers")

WORKER = Path(__file__).with_name("tp_worker.py")
FAMILIES = ("llama", "llama_tied", "qwen2", "qwen3")
# The tensor-parallel placement each weight must have, by its leaf module (the plan of every family above).
TP_PLACEMENT = {
    "q_proj": "S(0)",
    "k_proj": "S(0)",
    "v_proj": "S(0)",
    "o_proj": "S(1)",
    "gate_proj": "S(0)",
    "up_proj": "S(0)",
    "down_proj": "S(1)",
    "embed_tokens": "S(0)",
    "lm_head": "S(0)",
}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp")


@pytest.fixture(scope="module")
def ranks(work: Path) -> list[dict[str, Any]]:
    """One 4-process run holds every 4-rank scenario (imports dominate the cost)."""
    scenarios = ",".join([*FAMILIES, "qwen3_tp_only", "plain", "meta", "lightning_fit", "resume_across_tp"])
    return run_workers(WORKER, ["--scenarios", scenarios], work, nprocs=4, timeout=600)


@pytest.fixture(scope="module")
def two_ranks(work: Path, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """2 processes, in a directory inside the 4-rank run's: they resume its tp 2 checkpoint."""
    return run_workers(WORKER, ["--scenarios", "resume_on_2_ranks"], work / "two_ranks", nprocs=2, timeout=300)


def _worst(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == 4
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.distributed
@pytest.mark.timeout(660)
@pytest.mark.parametrize("family", FAMILIES)
def test_dp_x_tp_trains_like_one_process(ranks: list[dict[str, Any]], family: str) -> None:
    for r in ranks:
        s = r[family]
        assert _worst(s["losses"], s["ref_losses"]) < 1e-5, (s["losses"], s["ref_losses"])
        assert s["losses"][-1] != s["losses"][0]
        # The first step's gradients, gathered whole, are one process's (fp32 rounding only).
        assert max(s["grad_diffs"].values()) < 1e-6, s["grad_diffs"]
        # Later weights drift by AdamW's amplification of rounding in near-zero gradients only (see EPS in the worker).
        assert max(s["diffs"].values()) < 1e-2, s["diffs"]
    coordinates = [r[family]["coordinate"] for r in ranks]
    assert coordinates == [[0, 0], [0, 1], [1, 0], [1, 1]]  # tensor-parallel pairs are ranks {0, 1} and {2, 3}


@pytest.mark.distributed
@pytest.mark.timeout(660)
@pytest.mark.parametrize("family", FAMILIES)
def test_placements_are_those_of_the_plan(ranks: list[dict[str, Any]], family: str) -> None:
    s = ranks[0][family]
    for name, p in s["params"].items():
        leaf = name.removesuffix(".weight").removesuffix(".bias").rpartition(".")[2]
        assert p["mesh"] == ["dp", "tp"], name
        dp, tp = p["placements"]
        expected = TP_PLACEMENT.get(leaf, "R")
        if name.endswith(".bias") and expected == "S(1)":
            expected = "R"  # a rowwise layer's bias is added once, after the sum: whole
        if expected == "R":
            assert tp == "R" and p["local"] * 2 == p["full"], (name, p)  # whole on tp, sharded over dp only
        else:
            assert tp == expected and p["local"] * 4 == p["full"], (name, p)  # a quarter per rank
        assert dp in ("S(0)", "_S(0, 2)"), (name, p)  # fully_shard splits tp's slice again over dp
    rows = dict(s["rows"])
    assert rows["lm_head"] == "colwise_gather_output" and rows["model.embed_tokens"] == "embedding_rowwise"
    assert s["tied"] is (family == "llama_tied")  # a tied head and embedding stay one Parameter
    if family == "qwen2":
        assert s["params"]["model.layers.0.self_attn.q_proj.bias"]["placements"][1] == "S(0)"
    if family == "qwen3":
        assert rows["model.layers.0.self_attn.q_norm"] == "replicated_with_grad_allreduce"


@pytest.mark.distributed
@pytest.mark.timeout(660)
@pytest.mark.parametrize("family", FAMILIES)
def test_whole_parameters_get_equal_gradients_across_a_tp_pair(ranks: list[dict[str, Any]], family: str) -> None:
    """Norm weights (and Qwen3's head norms, whose per-rank gradients are partial sums, summed by FSDP2) are
    Replicate on tp: both ranks of a pair must hold the same gradient, or they would drift apart."""
    grads = [r[family]["whole_grads"] for r in ranks]
    norms = {n for n in grads[0] if "norm" in n}
    assert len(norms) == (9 if family == "qwen3" else 5), sorted(norms)
    assert grads[0] == grads[1] and grads[2] == grads[3]
    assert grads[0] != grads[2]  # different dp shards: the pair check above is not comparing empty data


@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_the_plan_alone_without_fully_shard_sums_partial_gradients(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        s = r["qwen3_tp_only"]
        assert _worst(s["losses"], s["ref_losses"]) < 1e-5, (s["losses"], s["ref_losses"])
        assert s["norm_grad"] == "(Replicate(),)"  # the q_norm gradient, summed over tp by the plan's own hook


@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_a_plain_tp_plan_trains_like_one_process(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        s = r["plain"]
        assert _worst(s["losses"], s["ref_losses"]) < 1e-5
        assert max(s["diffs"].values()) < 1e-5
        assert s["params"]["up.weight"]["placements"][1] == "S(0)" and s["params"]["down.weight"]["placements"][1] == "S(1)"
        assert s["params"]["norm.weight"]["placements"][1] == "R"


@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_the_layout_applies_on_the_meta_device(ranks: list[dict[str, Any]]) -> None:
    s = ranks[0]["meta"]
    assert s["meta"] and s["tied"]
    assert s["params"]["model.layers.0.self_attn.o_proj.weight"] == ["S(1)"] and s["params"]["model.norm.weight"] == ["R"]


# -- through Lightning: FSDP2Strategy(tensor_parallel_size=2) ------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_the_strategy_trains_dp_x_tp_like_one_process(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        s = r["lightning_fit"]
        assert s["mesh"] == [["data_parallel", "tensor_parallel"], [2, 2]]
        assert _worst(s["losses"], s["ref_losses"]) < 1e-5, (s["losses"], s["ref_losses"])
        assert max(s["diffs"].values()) < 1e-3, s["diffs"]
        assert s["placements"]["model.layers.0.self_attn.q_proj.weight"][1] == "S(0)"
        assert s["placements"]["model.layers.0.mlp.down_proj.weight"][1] == "S(1)"


@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_every_rank_of_a_tp_pair_reads_the_same_batch_and_the_sampler_counts_dp_ranks_only(ranks: list[dict[str, Any]]) -> None:
    fits = [r["lightning_fit"] for r in ranks]
    batches = fits[0]["batches"]
    assert len(batches[0]) == 4  # 16 sequences / (2 dp ranks x 2 per batch): not 4 ranks' worth of steps
    assert batches[0] == batches[1] and batches[2] == batches[3]  # tp pairs: ranks {0, 1}, {2, 3}
    assert batches[0] != batches[2]  # the two dp ranks read different halves
    rows = sorted(tuple(row) for rank in (0, 2) for step in batches[rank] for row in step)
    assert len(set(rows)) == 16  # together the dp ranks read every sequence once
    assert [f["sampler"] for f in fits] == [[2, 0], [2, 0], [2, 1], [2, 1]]  # num_replicas = dp, rank = dp coordinate


@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_dcp_resume_across_tp_sizes_is_exact(ranks: list[dict[str, Any]]) -> None:
    """tp 2 (dp 2) -> tp 1 (dp 4) -> tp 2 on the same 4 ranks: weights, AdamW state and step counter come back
    bit for bit, and training goes on."""
    for r in ranks:
        s = r["resume_across_tp"]
        for hop, steps in (("tp2_to_tp1", [4, 6]), ("tp1_to_tp2", [6, 10])):
            report = s[hop]
            assert report["loaded_equals_saved"]["equal"], report["loaded_equals_saved"]
            assert report["loaded_equals_saved"]["compared"] > 60 and report["optimizer_entries"] == 42  # 21 x (exp_avg, exp_avg_sq)
            assert report["trained"] == 21 and report["steps"] == steps


@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_dcp_resume_on_fewer_ranks_as_tp_1_or_tp_2_is_exact(two_ranks: list[dict[str, Any]]) -> None:
    for r in two_ranks:
        for tp, steps in (("tp1", [4, 8]), ("tp2", [4, 12])):  # dp 2: 4 steps per epoch; dp 1: 8
            report = r["resume_on_2_ranks"][tp]
            assert report["loaded_equals_saved"]["equal"], report["loaded_equals_saved"]
            assert report["trained"] == 21 and report["steps"] == steps


@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_convert_to_safetensors_from_a_tp_checkpoint_is_the_full_state_dict(work: Path, ranks: list[dict[str, Any]]) -> None:
    pytest.importorskip("safetensors")
    import torch
    from safetensors.torch import load_file

    from autoshard.convert import ConvertOptions, convert

    checkpoints = work / "checkpoints"
    done = convert(checkpoints / "tp2" / ranks[0]["resume_across_tp"]["saved"], work / "hf", "safetensors", ConvertOptions(module="model"))
    assert (done.source_format, done.source_world_size, done.parameters) == ("distributed", 4, 21)
    written: dict[str, torch.Tensor] = {}
    for f in sorted((work / "hf").glob("*.safetensors")):
        written.update(load_file(f))
    saved = torch.load(checkpoints / "tp2_epoch0.pt", weights_only=True)
    full = {k.removeprefix("param/model."): v for k, v in saved.items() if k.startswith("param/")}
    assert sorted(written) == sorted(full)
    assert all(torch.equal(written[k], full[k]) for k in full)


@pytest.mark.distributed
@pytest.mark.timeout(660)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_collectives_explain_counts_are_those_torch_runs(ranks: list[dict[str, Any]], family: str) -> None:
    """``TPPlan.collectives`` (explain's traffic rows) against torch's profiler on one training step: every all-reduce
    and all-gather the layout issues (Qwen3's head-norm gradient sums included), and no other; the sibling
    projections' shared input brings a Llama layer to torchtitan's count (benchmarks/tp_step.py)."""
    s = ranks[0][family]
    expected = {"all-reduce": 0, "all-gather": 0}
    for collective, _ in s["expected_comms"]:
        expected[collective] += 1
    assert s["comms"]["_c10d_functional::all_reduce"] == expected["all-reduce"]
    assert s["comms"]["_c10d_functional::all_gather_into_tensor"] == expected["all-gather"] == 1
    # 2 layers x (o_proj, down_proj forward; q/k/v and gate/up backward, one each: SharedInput) + embedding + head
    assert expected["all-reduce"] == (14 if family == "qwen3" else 10)
