"""The DeepSpeed members autoshard calls, unpickles or mirrors (``autoshard.privates.in_deepspeed.DEEPSPEED``), one check
each, and autoshard's spelling of DeepSpeed's files checked against DeepSpeed's own functions on the installed
release: a DeepSpeed upgrade that renames a file, changes the partition rule or adds a key to model_states fails here,
by name, not halfway through a conversion. That the list is complete, and used where it says, tests/test_privates.py
checks by reading src/.
"""

from __future__ import annotations

import ast
import fnmatch
import inspect
import textwrap
import types
import warnings
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from autoshard.checkpoint import deepspeed_layout as dsf
from autoshard.privates import Private, missing
from autoshard.privates.in_deepspeed import DEEPSPEED, SUPPORTED_DEEPSPEED

pytest.importorskip("deepspeed", reason="needs the deepspeed extra installed")
pytestmark = pytest.mark.deepspeed
SRC = Path(__file__).resolve().parents[1] / "src"


def test_the_installed_deepspeed_is_in_the_checked_range() -> None:
    installed = dsf.installed_version()
    assert installed is not None
    assert SpecifierSet(SUPPORTED_DEEPSPEED).contains(Version(installed)), (
        f"deepspeed {installed} is outside {SUPPORTED_DEEPSPEED}, the releases autoshard.privates.in_deepspeed was checked on:"
        f" run this file's checks, then widen the range"
    )


def test_a_deepspeed_outside_the_range_is_warned_about_once() -> None:
    dsf.check_version.cache_clear()
    with pytest.warns(UserWarning, match=r"found deepspeed 0\.20\.1\. If a DeepSpeed checkpoint fails .* pip install \"deepspeed>=0\.19,<0\.20\""):
        dsf.check_version("0.20.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dsf.check_version("0.20.1")  # once per version
        dsf.check_version("0.19.8")
        dsf.check_version()  # the installed one, in range


@pytest.mark.parametrize("member", DEEPSPEED, ids=[m.dotted for m in DEEPSPEED])
def test_every_listed_deepspeed_member_exists(member: Private) -> None:
    assert not missing([member]), f"deepspeed moved {member.dotted}: {member.used_in} relies on it ({member.why})"


def test_file_names_are_the_ones_the_engine_writes_and_loads() -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    def engine(zero3: bool) -> types.SimpleNamespace:
        stub = types.SimpleNamespace(checkpoint_mp_rank=0, zero_optimization_partition_weights=lambda: zero3)
        stub._get_zero_ckpt_prefix = lambda dp_rank, bf16_mode: DeepSpeedEngine._get_zero_ckpt_prefix(stub, dp_rank, bf16_mode)
        return stub

    for rank in (0, 3, 11):
        model = Path(DeepSpeedEngine._get_ckpt_name(engine(True), "/ckpt", dsf.LIGHTNING_TAG, pp_placeholder=rank))
        assert model == Path("/ckpt", dsf.LIGHTNING_TAG, dsf.model_states_name(rank))
        assert dsf.ZERO3_MODEL_FILE.match(model.name).group(1) == str(rank) and dsf.writer_rank(model.name) == rank
        for bf16 in (False, True):
            optim = Path(DeepSpeedEngine._get_rank_zero_ckpt_name(engine(True), "/ckpt", dsf.LIGHTNING_TAG, 0, rank, bf16))
            assert optim.name == dsf.optim_states_name(rank, bf16)
            assert optim.name.startswith(dsf.BF16_PREFIX) == bf16
            assert dsf.ZERO3_OPTIM_FILE.match(optim.name).group(1) == str(rank) and dsf.writer_rank(optim.name) == rank
    zero12 = Path(DeepSpeedEngine._get_ckpt_name(engine(False), "/ckpt", "global_step2")).name
    assert fnmatch.fnmatch(zero12, dsf.ZERO12_MODEL_FILES) and fnmatch.fnmatch(zero12, dsf.MODEL_FILES)
    assert not dsf.ZERO3_MODEL_FILE.match(zero12) and dsf.writer_rank(zero12) == 0


def test_the_recovery_script_is_where_deepspeed_keeps_it() -> None:
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert dsf.recovery_script(deepspeed.__file__).is_file()
    assert dsf.RECOVERY_SCRIPT in inspect.getsource(DeepSpeedEngine._copy_recovery_script)


def test_every_key_the_engine_writes_into_model_states_is_known() -> None:
    """What read_deepspeed leaves out of Lightning's trainer state: a key DeepSpeed adds would otherwise be taken
    for client state and written back into every converted checkpoint."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    tree = ast.parse(textwrap.dedent(inspect.getsource(DeepSpeedEngine._common_checkpoint_state)))
    written = {
        k.arg for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "dict" for k in node.keywords if k.arg
    }
    assert "module" in written and "param_shapes" in written  # the source was read
    assert written <= dsf.ENGINE_KEYS, f"add to ENGINE_KEYS: {sorted(written - dsf.ENGINE_KEYS)}"


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_the_partition_rule_is_zero_to_fp32s(world: int) -> None:
    from deepspeed.utils.zero_to_fp32 import zero3_partitioned_param_info

    for numel in (1, 2, 7, 8, 33, 1000):
        part, padding = zero3_partitioned_param_info(numel, world)
        assert dsf.partition_numel(numel, world) == part
        t = torch.arange(numel, dtype=torch.float32)
        slices = [dsf.rank_slice(t, rank, world) for rank in range(world)]
        assert all(s.numel() == part for s in slices)
        assert torch.equal(torch.cat(slices), torch.cat([t, torch.zeros(padding)]))


def test_sub_groups_are_the_ones_zero3_builds() -> None:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    numels = {f"p{i}": n for i, n in enumerate([10, 3, 700, 1, 64, 65, 9, 2000, 5])}
    names = list(numels)
    for world in (1, 2, 3):
        params = [types.SimpleNamespace(name=n, partition_numel=lambda n=n: dsf.partition_numel(numels[n], world)) for n in names]
        for size in (1, 50, 300, 10**9):
            stub = types.SimpleNamespace(sub_group_size=size)
            theirs = [[p.name for p in group] for group in DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(stub, params)]
            assert dsf.sub_groups(names, numels, world, size) == theirs, (world, size)
