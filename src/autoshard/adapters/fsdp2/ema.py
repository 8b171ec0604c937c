"""An EMA teacher updated positionally from its student must be sharded exactly like it: checked before sharding
(structure) and after (placements and mesh), whoever sharded."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoshard.errors import AutoShardError
from autoshard.needs import EMAPair


def _describe_param(p: torch.Tensor) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    info: dict[str, Any] = {"shape": tuple(p.shape), "dtype": p.dtype, "dtensor": isinstance(p, DTensor)}
    if isinstance(p, DTensor):
        info["placements"] = tuple(p.placements)
        info["mesh"] = (p.device_mesh.device_type, tuple(p.device_mesh.mesh.flatten().tolist()))
    return info


def check_ema_structure(module: nn.Module, pair: EMAPair) -> None:
    """Before sharding: the positional EMA zip needs the same parameter count, shapes and dtypes, in order."""
    _compare(module, pair, keys=("shape", "dtype"), when="structure")


def check_ema_alignment(module: nn.Module, pair: EMAPair) -> None:
    """After sharding: count, shape, dtype, DTensor-ness, placements and mesh must all match, position by position."""
    _compare(module, pair, keys=("shape", "dtype", "dtensor", "placements", "mesh"), when="sharding")


def _compare(module: nn.Module, pair: EMAPair, keys: tuple[str, ...], when: str) -> None:
    teacher = list(module.get_submodule(pair.teacher).named_parameters())
    student = list(module.get_submodule(pair.student).named_parameters())
    fix = (
        "Fix: build the teacher as copy.deepcopy(student) and let autoshard shard both, or apply identical"
        " fully_shard calls to both in your parallelize_fn"
    )
    head = f"EMA teacher '{pair.teacher}' and student '{pair.student}' differ in {when}"
    if len(teacher) != len(student):
        raise AutoShardError(f"{head}: {len(teacher)} vs {len(student)} parameters, so the positional EMA update would pair the wrong tensors. {fix}")
    for i, ((tn, tp), (sn, sp)) in enumerate(zip(teacher, student)):
        t, s = _describe_param(tp), _describe_param(sp)
        for key in keys:
            if t.get(key) != s.get(key):
                raise AutoShardError(f"{head}: parameter #{i} ('{tn}' vs '{sn}') has {key} {t.get(key)} vs {s.get(key)}. {fix}")
