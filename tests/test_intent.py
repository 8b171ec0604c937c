"""ShardingIntent validates every field with an error that names the valid choices."""

from __future__ import annotations

import pytest
import yaml

from autoshard import IntentError, ShardingIntent
from autoshard.intent import as_intent, normalize_precision
from autoshard.mesh import ParallelDims
from autoshard.precision import resolve_precision


def test_defaults_are_pure_fsdp_bf16_mixed():
    intent = ShardingIntent()
    assert intent.shard is None and intent.exclude == ()
    assert intent.precision is None and resolve_precision(None, intent).precision == "bf16-mixed"
    assert (intent.offload, intent.checkpoint, intent.tensor_parallel_size) == ("none", "distributed", 1)
    assert ParallelDims.resolve(intent, 8) == ParallelDims(1, 8, 1)


@pytest.mark.parametrize(
    ("given", "canonical"),
    [(16, "16-mixed"), ("16", "16-mixed"), ("bf16", "bf16-mixed"), (32, "32-true"), (" BF16-True ", "bf16-true"), ("16-true", "16-true")],
)
def test_precision_accepts_lightning_spellings(given, canonical):
    assert normalize_precision(given) == canonical
    assert ShardingIntent(precision=given).precision == canonical


def test_misspelled_precision_names_the_choices():
    with pytest.raises(IntentError) as info:
        ShardingIntent(precision="bf16-mix")
    assert str(info.value) == (
        "unknown precision 'bf16-mix' (did you mean 'bf16-mixed'?): choose one of bf16-mixed, 32-true, bf16-true,"
        " 16-mixed, 16-true (Lightning's short forms 'bf16', '16' and '32' work too). Fix: precision='bf16-mixed'"
        " (bf16-mixed is recommended for sharded training)"
    )
    with pytest.raises(IntentError, match="unknown precision 64: choose one of bf16-mixed"):
        normalize_precision(64)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"offload": "everything"}, "unknown offload 'everything': choose one of 'none', 'optimizer', 'params'. Fix: offload='none'"),
        (
            {"offload": "optimiser"},
            "unknown offload 'optimiser' (did you mean 'optimizer'?): choose one of 'none', 'optimizer', 'params'. Fix: offload='optimizer'",
        ),
        (
            {"offload": "cpu"},
            "unknown offload 'cpu' (offload says what to move: 'optimizer' or 'params'; offload_device='cpu' says where): choose one of 'none', 'optimizer', 'params'. Fix: offload='params', offload_device='cpu'",
        ),
        ({"offload": "params", "offload_device": "disk"}, "unknown offload_device 'disk': choose one of 'cpu', 'nvme'. Fix: offload_device='cpu'"),
        ({"checkpoint": "sharded"}, "unknown checkpoint 'sharded': choose one of 'distributed', 'full'. Fix: checkpoint='distributed'"),
        (
            {"param_dtype": "bf16"},
            "unknown param_dtype 'bf16' (did you mean 'bfloat16'?): choose one of 'float32', 'bfloat16', 'float16'. Fix: param_dtype='bfloat16'",
        ),
        (
            {"reshard_after_forward": "yes"},
            "reshard_after_forward must be true or false, got 'yes'. Fix: reshard_after_forward=True or reshard_after_forward=False",
        ),
        (
            {"activation_checkpointing": "yes"},
            "activation_checkpointing must be True (every block), False, 'selective' (op-level: recompute cheap ops, keep"
            " matmul and attention outputs) or a whole number k >= 1 (every k-th block), got 'yes'. Fix: activation_checkpointing=True",
        ),
        ({"offload_device": "nvme"}, "offload_device='nvme' with offload='none' offloads nothing. Fix: add offload='optimizer' or offload='params'"),
        (
            {"offload": "optimizer", "offload_device": "nvme"},
            "offload_device='nvme' needs a directory to offload to. Fix: add nvme_path=, a directory on a local NVMe drive",
        ),
        (
            {"data_parallel_size": -2},
            "data_parallel_size must be a positive integer or 'auto', got -2. Fix: data_parallel_size='auto' (or a whole number >= 1)",
        ),
        (
            {"data_parallel_size": 0},
            "data_parallel_size must be a positive integer or 'auto', got 0. Fix: data_parallel_size='auto' (or a whole number >= 1)",
        ),
        (
            {"tensor_parallel_size": -1},
            "tensor_parallel_size must be a positive integer or 'auto', got -1. Fix: tensor_parallel_size='auto' (or a whole number >= 1)",
        ),
        (
            {"tensor_parallel_size": 2.0},
            "tensor_parallel_size must be a positive integer or 'auto', got 2.0. Fix: tensor_parallel_size='auto' (or a whole number >= 1)",
        ),
        (
            {"data_parallel_size": True},
            "data_parallel_size must be a positive integer or 'auto', got True. Fix: data_parallel_size='auto' (or a whole number >= 1)",
        ),
        ({"shard": []}, "shard=[] would shard nothing. Fix: leave shard unset to shard every trainable subtree"),
        (
            {"shard": ["backbone."]},
            "shard holds 'backbone.': each entry must be a dotted module path. Fix: write it as a path such as 'backbone.blocks' (no leading or trailing dot)",
        ),
        ({"nvme_path": 5}, "nvme_path must be a directory path, got 5. Fix: nvme_path='/local_nvme/offload'"),
        ({"exclude": 3}, "exclude must be a list of module paths, got 3. Fix: exclude=['backbone'] (dotted paths of modules)"),
        ({"shard": ["head"], "exclude": "head"}, "head is both in shard and in exclude. Fix: keep it in one of them"),
        (
            {"nvme_path": "/nvme"},
            "nvme_path='/nvme' is set but offload_device='cpu', so nothing would go to it. Fix: set offload_device='nvme' (with offload='optimizer' or 'params'), or drop nvme_path",
        ),
    ],
)
def test_bad_fields_are_refused_with_the_valid_choices(fields, message):
    with pytest.raises(IntentError) as info:
        ShardingIntent(**fields)
    assert str(info.value) == message


def test_intent_errors_are_value_errors():
    with pytest.raises(ValueError):
        ShardingIntent(checkpoint="nope")


def test_normalises_names_and_dtypes():
    from pathlib import Path

    import torch

    assert ShardingIntent(offload="params", offload_device="nvme", nvme_path=Path("/nvme")).nvme_path == "/nvme"
    intent = ShardingIntent(shard="backbone", exclude=["backbone.head"], param_dtype=torch.bfloat16, reduce_dtype="float32")
    assert intent.shard == ("backbone",) and intent.exclude == ("backbone.head",)
    assert (intent.param_dtype, intent.reduce_dtype) == ("bfloat16", "float32")
    assert ShardingIntent(data_parallel_size="auto", tensor_parallel_size="auto").tensor_parallel_size == 1
    hash(intent)  # frozen and hashable: safe to keep on a strategy


def test_frozen():
    with pytest.raises(AttributeError):
        ShardingIntent().offload = "params"  # type: ignore[misc]


@pytest.mark.parametrize(("world", "dp", "tp", "sizes"), [(8, None, 1, (8, 1)), (8, None, 2, (4, 2)), (8, 2, 4, (2, 4)), (1, None, 1, (1, 1))])
def test_mesh_sizes(world, dp, tp, sizes):
    dims = ParallelDims.resolve(ShardingIntent(data_parallel_size=dp, tensor_parallel_size=tp), world)
    assert (dims.dp, dims.tp) == sizes


def test_mesh_that_cannot_match_the_world_names_the_fix():
    with pytest.raises(IntentError) as info:
        ParallelDims.resolve(ShardingIntent(data_parallel_size=3, tensor_parallel_size=2), 8)
    assert str(info.value) == (
        "data_parallel_size * tensor_parallel_size = 3 * 2 = 6 does not match the world size 8 (nodes x devices)."
        " Fix: set data_parallel_size=4, or leave it unset to use every rank"
    )
    with pytest.raises(IntentError) as info:
        ParallelDims.resolve(ShardingIntent(tensor_parallel_size=4), 6)
    assert str(info.value) == (
        "tensor_parallel_size=4 does not divide the world size 6 (nodes x devices). Fix: tensor_parallel_size= one of 1, 2, 3, 6"
    )
    with pytest.raises(IntentError, match="world size must be a positive integer, got 0"):
        ParallelDims.resolve(ShardingIntent(), 0)


def test_from_dict_round_trips_through_yaml():
    text = """
    shard: [backbone]
    exclude: [backbone.head]
    precision: bf16
    offload: optimizer
    offload_device: nvme
    nvme_path: /local_nvme
    activation_checkpointing: true
    checkpoint: full
    data_parallel_size: 4
    tensor_parallel_size: 2
    """
    intent = ShardingIntent.from_dict(yaml.safe_load(text))
    assert intent.precision == "bf16-mixed" and intent.shard == ("backbone",) and ParallelDims.resolve(intent, 8) == ParallelDims(1, 4, 2)
    dumped = yaml.safe_load(yaml.safe_dump(intent.to_dict()))
    assert ShardingIntent.from_dict(dumped) == intent
    assert as_intent(None) == ShardingIntent() == as_intent({})
    assert as_intent(intent) is intent and as_intent({"offload": "params"}).offload == "params"


def test_from_dict_refuses_unknown_keys_by_name():
    with pytest.raises(IntentError) as info:
        ShardingIntent.from_dict({"precison": "bf16", "nodes": 2})
    assert str(info.value) == (
        "unknown ShardingIntent field(s): 'nodes' 'precison' (did you mean 'precision'?). Valid fields are shard,"
        " exclude, blocks, precision, param_dtype, reduce_dtype, reshard_after_forward, offload, offload_device, nvme_path,"
        " activation_checkpointing, checkpoint, data_parallel_size, tensor_parallel_size, shard_size, strict, init_from,"
        " memory_budget, memory_headroom, pinned, compile."
        " Fix: drop 'nodes'; rename 'precison' to 'precision'"
    )
    with pytest.raises(IntentError, match="a ShardingIntent is read from a mapping of its fields, got list"):
        ShardingIntent.from_dict(["shard"])  # type: ignore[arg-type]
    with pytest.raises(IntentError, match="expected a ShardingIntent or a dict of its fields, got str"):
        as_intent("fsdp2")  # type: ignore[arg-type]


def test_replace_validates():
    assert ShardingIntent().replace(offload="params").offload == "params"
    with pytest.raises(IntentError, match="unknown offload"):
        ShardingIntent().replace(offload="gpu")


@pytest.mark.parametrize(
    ("shard_size", "world", "nodes", "sizes"),
    [(None, 8, 1, None), (2, 8, 1, (4, 2)), (8, 8, 1, None), ("node", 8, 2, (2, 4)), ("node", 8, 1, None), (1, 4, 1, (4, 1))],
)
def test_hsdp_sizes_are_replicas_by_shard_size(shard_size, world, nodes, sizes):
    """A shard group as large as the data-parallel size is pure FSDP: None, a 1-D mesh."""
    intent = ShardingIntent(shard_size=shard_size)
    dims = ParallelDims.resolve(intent, world, nodes)
    assert dims.hsdp == sizes and (dims.dp, dims.tp) == (world, 1)
    assert ShardingIntent.from_dict(intent.to_dict()) == intent


def test_shard_size_refusals_name_the_fix():
    with pytest.raises(IntentError) as info:
        ParallelDims.resolve(ShardingIntent(shard_size=3), 8)
    assert str(info.value) == (
        "shard_size=3 does not divide the data-parallel size 8, so the ranks cannot form whole replicas of the shard"
        " group. Fix: shard_size= one of 1, 2, 4, 8"
    )
    with pytest.raises(IntentError) as info:
        ParallelDims.resolve(ShardingIntent(shard_size=16), 8)
    assert str(info.value) == (
        "shard_size=16 exceeds the data-parallel size 8 (world size 8): a shard group cannot hold more ranks than"
        " there are. Fix: shard_size= one of 1, 2, 4, 8, or leave it unset"
    )
    with pytest.raises(IntentError) as info:
        ShardingIntent(shard_size="rack")
    assert str(info.value).startswith("shard_size must be a positive integer or 'node', got 'rack'. Fix: shard_size=8")
    for bad in (0, True, 2.0):
        with pytest.raises(IntentError, match="shard_size must be a positive integer or 'node'"):
            ShardingIntent(shard_size=bad)
