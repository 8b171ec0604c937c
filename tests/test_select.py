"""The selector against every matrix cell, the "auto" choice, availability, and the texts of its refusals."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest

from autoshard import (
    BackendUnavailableError,
    EMAPair,
    Feature,
    IncompatibleBackendError,
    IntentError,
    MethodNeeds,
    ShardingIntent,
    Support,
    features_needed,
    matrix,
    select_backend,
)
from autoshard.backends import Availability, require

INSTALLED = Availability(True, "installed (test)")
ALL_INSTALLED = {"fsdp2": INSTALLED, "deepspeed_zero3": INSTALLED, "fsdp1": INSTALLED}
DS_MISSING = {**ALL_INSTALLED, "deepspeed_zero3": Availability(False, "deepspeed is not installed", 'pip install "autoshard[deepspeed]"')}
BASELINE = {Feature.BF16, Feature.DISTRIBUTED_CHECKPOINT}  # every run needs a precision and a checkpoint format
NVME = {"offload": "optimizer", "offload_device": "nvme", "nvme_path": "/local_nvme"}

# For each feature: (needs, intent fields, accelerator) that require it and nothing beyond the baseline.
ONE_FEATURE: dict[Feature, tuple[MethodNeeds, dict, str | None]] = {
    Feature.MULTIPLE_OPTIMIZERS: (MethodNeeds(optimizer_sources=(("configure_optimizers", 2),)), {}, None),
    Feature.EMA_TEACHER_STUDENT: (MethodNeeds(ema_pairs=(EMAPair("teacher", "student"),)), {}, None),
    Feature.MULTI_FORWARD: (MethodNeeds(multi_forward=True), {}, None),
    Feature.MANUAL_OPTIMIZATION: (MethodNeeds(manual_optimization=True), {}, None),
    Feature.ROOT_PARAMETERS: (MethodNeeds(root_parameters=("cls_token",)), {}, None),
    Feature.PER_BLOCK_SHARDING: (MethodNeeds(), {"shard": ["backbone"]}, None),
    Feature.KEEP_GATHERED: (MethodNeeds(), {"reshard_after_forward": False}, None),
    Feature.BF16: (MethodNeeds(), {"precision": "bf16-mixed"}, None),
    Feature.BF16_TRUE: (MethodNeeds(), {"precision": "bf16-true"}, None),
    Feature.FP16_MIXED: (MethodNeeds(), {"precision": "16-mixed"}, None),
    Feature.FP16_TRUE: (MethodNeeds(), {"precision": "16-true"}, None),
    Feature.FP32: (MethodNeeds(), {"precision": "32-true"}, None),
    Feature.CPU_OFFLOAD_PARAMS: (MethodNeeds(), {"offload": "params"}, None),
    Feature.CPU_OFFLOAD_OPTIMIZER: (MethodNeeds(), {"offload": "optimizer"}, None),
    Feature.NVME_OFFLOAD: (MethodNeeds(), NVME, None),
    Feature.ACTIVATION_CHECKPOINTING: (MethodNeeds(), {"activation_checkpointing": True}, None),
    Feature.SELECTIVE_CHECKPOINTING: (MethodNeeds(), {"activation_checkpointing": "selective"}, None),
    Feature.DISTRIBUTED_CHECKPOINT: (MethodNeeds(), {"checkpoint": "distributed"}, None),
    Feature.FULL_CHECKPOINT: (MethodNeeds(), {"checkpoint": "full"}, None),
    Feature.TENSOR_PARALLEL: (MethodNeeds(), {"tensor_parallel_size": 2}, None),
    Feature.CPU_ACCELERATOR: (MethodNeeds(), {}, "cpu"),
    Feature.INIT_FROM: (MethodNeeds(), {"init_from": "weights.safetensors"}, None),
    Feature.HYBRID_SHARDING: (MethodNeeds(), {"shard_size": 2}, None),
    Feature.COMPILE: (MethodNeeds(), {"compile": True}, None),
}
CELLS = [(backend, feature) for backend, row in matrix().items() for feature in row]


def test_every_feature_has_a_builder():
    assert set(ONE_FEATURE) == set(Feature)


@pytest.mark.parametrize("feature", list(Feature), ids=lambda f: f.name)
def test_builder_needs_exactly_that_feature(feature):
    needs, fields, accelerator = ONE_FEATURE[feature]
    needed = set(features_needed(needs, ShardingIntent(**fields), accelerator))
    assert feature in needed and needed - {feature} <= BASELINE
    if feature in (Feature.BF16_TRUE, Feature.FP16_MIXED, Feature.FP16_TRUE, Feature.FP32):
        assert Feature.BF16 not in needed
    if feature is Feature.FULL_CHECKPOINT:
        assert Feature.DISTRIBUTED_CHECKPOINT not in needed


@pytest.mark.parametrize(("backend", "feature"), CELLS, ids=[f"{b}-{f.name}" for b, f in CELLS])
def test_every_matrix_cell(backend, feature):
    c = matrix()[backend][feature]
    needs, fields, accelerator = ONE_FEATURE[feature]
    run = dict(intent=ShardingIntent(**fields), prefer=backend, accelerator=accelerator, available=ALL_INSTALLED)
    if c.support.usable:
        decision = select_backend(needs, **run)
        assert decision.backend == backend
        caveats = {x.feature: x for x in decision.caveats}
        if c.support is Support.PARTIAL:
            assert caveats[feature].reason == c.reason and caveats[feature].remedy == c.remedy
            assert f"caveat: {feature.value}" in decision.describe()
        else:
            assert feature not in caveats
    else:
        with pytest.raises(IncompatibleBackendError) as info:
            select_backend(needs, **run)
        assert not isinstance(info.value, BackendUnavailableError)
        message = str(info.value)
        assert c.reason in message and f"Fix: {c.remedy}" in message
        if c.support is Support.NO:
            assert feature.value in message


# -- "auto" --------------------------------------------------------------------------------------------------

EMA_AND_PROBE = MethodNeeds(
    optimizer_sources=(("configure_optimizers", 1), ("callback OnlineProbe", 1)),
    ema_pairs=(EMAPair("teacher", "student"),),
    callback_modules=("probe",),
)


def test_auto_picks_fsdp2_for_an_ema_and_probe_method():
    decision = select_backend(EMA_AND_PROBE, available=ALL_INSTALLED)
    assert (decision.backend, decision.strategy, decision.caveats) == ("fsdp2", "fsdp2", ())
    assert decision.reasons[0] == "auto: fsdp2 is the first choice and runs everything needed"
    assert decision.reasons[1] == (
        "needs: multiple optimizers [2 optimizers: 1 from configure_optimizers, 1 from callback OnlineProbe], EMA"
        " teacher/student [teacher 'teacher' follows student 'student'], bf16 precision [precision='bf16-mixed'],"
        " distributed (sharded) checkpoint [checkpoint='distributed']"
    )
    assert decision.reasons[2] == "installed: installed (test)"
    assert [c.feature for c in decision.ruled_out["deepspeed_zero3"]] == [Feature.MULTIPLE_OPTIMIZERS, Feature.EMA_TEACHER_STUDENT]
    assert [c.detail for c in decision.ruled_out["fsdp1"]] == ["rejected"]


def test_auto_picks_fsdp2_for_a_plain_method():
    decision = select_backend(MethodNeeds(), available=ALL_INSTALLED)
    assert decision.backend == "fsdp2" and set(decision.ruled_out) == {"fsdp1"}


def test_auto_keeps_fsdp2_when_only_the_method_is_partial():
    # Root parameters are partial on fsdp2 and yes on ZeRO-3: a caveat, not a reason to switch engines.
    decision = select_backend(MethodNeeds(root_parameters=("cls_token",)), available=ALL_INSTALLED)
    assert decision.backend == "fsdp2" and [c.feature for c in decision.caveats] == [Feature.ROOT_PARAMETERS]


def test_auto_keeps_fsdp2_on_cpu():
    assert select_backend(MethodNeeds(), accelerator="cpu", available=ALL_INSTALLED).backend == "fsdp2"


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        (NVME, "auto: deepspeed_zero3, because fsdp2 cannot run NVMe offload"),
        ({"offload": "optimizer"}, "auto: deepspeed_zero3, because fsdp2 only partly supports CPU offload of optimizer state only"),
    ],
)
def test_auto_picks_deepspeed_only_for_what_only_it_has(fields, why):
    decision = select_backend(MethodNeeds(), ShardingIntent(**fields), available=ALL_INSTALLED)
    assert (decision.backend, decision.strategy) == ("deepspeed_zero3", "autoshard-deepspeed")
    assert decision.reasons[0] == why
    assert decision.caveats == ()


def test_auto_stays_on_fsdp2_when_the_method_forbids_deepspeed():
    decision = select_backend(EMA_AND_PROBE, ShardingIntent(offload="optimizer"), available=ALL_INSTALLED)
    assert decision.backend == "fsdp2" and [c.feature for c in decision.caveats] == [Feature.CPU_OFFLOAD_OPTIMIZER]


def test_auto_refuses_when_nothing_fits():
    with pytest.raises(IncompatibleBackendError) as info:
        select_backend(EMA_AND_PROBE, ShardingIntent(**NVME), available=ALL_INSTALLED)
    assert not isinstance(info.value, BackendUnavailableError)
    assert str(info.value) == (
        "autoshard found no backend that can run this method with this intent:\n"
        "  - fsdp2: NVMe offload [offload='optimizer', offload_device='nvme']: FSDP2 can offload to CPU memory only\n"
        "  - deepspeed_zero3: multiple optimizers [2 optimizers: 1 from configure_optimizers, 1 from callback"
        " OnlineProbe]: a DeepSpeed engine wraps exactly one optimizer (Lightning: 'DeepSpeed currently only supports"
        " single optimizer'), and optimizers owned by callbacks such as online probes count too\n"
        "  - deepspeed_zero3: EMA teacher/student [teacher 'teacher' follows student 'student']: ZeRO-3 replaces every"
        " parameter outside a forward with an empty partitioned placeholder, so the teacher's EMA update would read"
        " and write placeholders; nothing upstream detects this\n"
        "Closest: fsdp2 (strategy='fsdp2').\n"
        "Fix: use offload_device='cpu'"  # not DeepSpeed: it cannot run this method either
    )


def test_requested_backend_refused_when_nothing_else_fits_either():
    with pytest.raises(IncompatibleBackendError) as info:
        select_backend(EMA_AND_PROBE, ShardingIntent(**NVME), prefer="deepspeed", available=ALL_INSTALLED)
    assert str(info.value).startswith("autoshard cannot run this on deepspeed_zero3, nor on any other backend:\n  - fsdp2: NVMe")


# -- an explicit request -------------------------------------------------------------------------------------


def test_deepspeed_refused_for_ema_names_feature_backend_and_fix():
    with pytest.raises(IncompatibleBackendError) as info:
        select_backend(MethodNeeds(ema_pairs=(EMAPair("teacher", "student"),)), prefer="deepspeed", available=ALL_INSTALLED)
    assert str(info.value) == (
        "autoshard cannot run this on deepspeed_zero3 (strategy='autoshard-deepspeed'):\n"
        "  - EMA teacher/student [teacher 'teacher' follows student 'student']: ZeRO-3 replaces every parameter outside"
        " a forward with an empty partitioned placeholder, so the teacher's EMA update would read and write"
        " placeholders; nothing upstream detects this\n"
        "Backend that works: fsdp2 (strategy='fsdp2').\n"
        "Fix: use strategy='fsdp2' (or strategy='auto-shard')"
    )


def test_fsdp1_request_is_refused_with_the_redirect():
    with pytest.raises(IncompatibleBackendError) as info:
        select_backend(MethodNeeds(), prefer="fsdp", available=ALL_INSTALLED)
    assert str(info.value) == (
        "autoshard cannot run this on fsdp1 (strategy='fsdp'):\n"
        "  - rejected: FSDP1's flat-parameter training state machine breaks methods that run several forwards per step"
        " (DINO, I-JEPA, BYOL multi-crop), and FSDP2 covers everything it does, so autoshard does not drive it\n"
        "Backend that works: fsdp2 (strategy='fsdp2').\n"
        "Fix: use strategy='fsdp2' (same memory savings, per-parameter sharding)"
    )


def test_requested_backend_is_named_in_the_reasons():
    decision = select_backend(MethodNeeds(), prefer="autoshard-deepspeed", available=ALL_INSTALLED)
    assert decision.backend == "deepspeed_zero3" and decision.reasons[0] == "requested: deepspeed_zero3"
    assert select_backend(MethodNeeds(), prefer="auto-shard", available=ALL_INSTALLED).backend == "fsdp2"


def test_describe_and_to_dict():
    decision = select_backend(MethodNeeds(root_parameters=("cls_token",)), prefer="fsdp2", available=ALL_INSTALLED)
    lines = decision.describe().splitlines()
    assert lines[0] == "autoshard chose fsdp2 (strategy='fsdp2')"
    assert lines[1] == "  requested: fsdp2"
    assert lines[4].startswith("  caveat: parameters on the module root [on the root: cls_token]: parameters that live")
    assert lines[4].endswith(". Fix: move them into a child module, or pass parallelize_fn to shard them yourself")
    assert len(lines) == 5  # no "ruled out fsdp1": FSDP1 is never a candidate, so saying so on every run is noise
    assert str(decision) == decision.describe()
    data = decision.to_dict()
    assert data["backend"] == "fsdp2" and data["caveats"][0]["feature"] == "parameters on the module root"
    assert data["ruled_out"]["fsdp1"][0]["feature"] is None


def test_each_caveat_is_a_warning_text_and_can_leave_the_info_lines() -> None:
    """A strategy logs the decision without its caveats and warns each one (tests/lightning: as a real warning)."""
    decision = select_backend(MethodNeeds(), ShardingIntent(offload="optimizer"), prefer="fsdp2", available=ALL_INSTALLED)
    cell = matrix()["fsdp2"][Feature.CPU_OFFLOAD_OPTIMIZER]
    assert decision.warnings() == [
        (f"autoshard: partial support on fsdp2 for CPU offload of optimizer state only [offload='optimizer']: {cell.reason}. Fix: {cell.remedy}")
    ]
    assert "caveat:" not in decision.describe(caveats=False) and "caveat:" in decision.describe()
    assert select_backend(MethodNeeds(), prefer="fsdp2", available=ALL_INSTALLED).warnings() == []


def test_several_forwards_run_on_deepspeed_with_the_measured_caveat() -> None:
    """The matrix and the behaviour agree: the cell is partial (measured in tests/distributed/
    test_deepspeed_multi_forward.py), so a declared multi-forward method is not refused on ZeRO-3, and warned."""
    decision = select_backend(MethodNeeds(multi_forward=True), prefer="deepspeed_zero3", available=ALL_INSTALLED)
    assert decision.backend == "deepspeed_zero3"
    (warning,) = decision.warnings()
    assert "several forwards per step [declared multi_forward=True]: trains correctly" in warning
    assert "invalidates its parameter prefetch trace" in warning and "Fix: use strategy='fsdp2'" in warning
    # auto never leaves fsdp2 for it: a method need that fsdp2 runs fully
    assert select_backend(MethodNeeds(multi_forward=True), available=ALL_INSTALLED).backend == "fsdp2"


def test_reshard_after_forward_false_is_a_caveat_under_deepspeed_and_nothing_under_fsdp2() -> None:
    """ZeRO-3 has no reshard_after_forward and autoshard sets nothing for it: asking for it is warned, with the Fix."""
    kept = ShardingIntent(reshard_after_forward=False)
    decision = select_backend(MethodNeeds(), kept, prefer="autoshard-deepspeed", available=ALL_INSTALLED)
    cell = matrix()["deepspeed_zero3"][Feature.KEEP_GATHERED]
    assert decision.warnings() == [
        "autoshard: partial support on deepspeed_zero3 for parameters kept gathered until backward"
        f" (reshard_after_forward=False) [reshard_after_forward=False]: {cell.reason}. Fix: {cell.remedy}"
    ]
    assert "stage3_max_reuse_distance elements of the trace (1,000,000,000, DeepSpeed's default)" in cell.reason
    assert cell.remedy.startswith("set zero_overrides={'stage3_max_reuse_distance': N} on the strategy")
    assert cell.remedy.endswith("or use strategy='fsdp2' (or strategy='auto-shard') for reshard_after_forward=False")
    assert select_backend(MethodNeeds(), kept, prefer="fsdp2", available=ALL_INSTALLED).caveats == ()
    # the default (True) needs nothing: a DeepSpeed run that did not ask says nothing
    assert select_backend(MethodNeeds(), prefer="autoshard-deepspeed", available=ALL_INSTALLED).warnings() == []
    assert select_backend(MethodNeeds(), kept, available=ALL_INSTALLED).backend == "fsdp2"


def test_auto_with_reshard_after_forward_false_weighs_it_like_any_intent_feature() -> None:
    """NVMe offload still needs DeepSpeed (fsdp2 cannot), with the caveat; beside offload='optimizer', each backend
    does one of the two only partly, so the tie keeps preference order: fsdp2."""
    nvme = select_backend(MethodNeeds(), ShardingIntent(**NVME, reshard_after_forward=False), available=ALL_INSTALLED)
    assert nvme.backend == "deepspeed_zero3" and [c.feature for c in nvme.caveats] == [Feature.KEEP_GATHERED]
    both = select_backend(MethodNeeds(), ShardingIntent(offload="optimizer", reshard_after_forward=False), available=ALL_INSTALLED)
    assert both.backend == "fsdp2" and [c.feature for c in both.caveats] == [Feature.CPU_OFFLOAD_OPTIMIZER]


# -- bad input -----------------------------------------------------------------------------------------------


def test_unknown_backend_names_the_choices():
    with pytest.raises(IntentError) as info:
        select_backend(MethodNeeds(), prefer="fsdp3")
    assert str(info.value) == ("unknown backend 'fsdp3' (did you mean 'fsdp2'?): choose one of 'auto', 'fsdp2', 'deepspeed_zero3'. Fix: 'fsdp2'")
    with pytest.raises(IntentError, match="unknown backend 'megatron': choose one of 'auto', 'fsdp2', 'deepspeed_zero3'"):
        select_backend(MethodNeeds(), available={"megatron": INSTALLED})
    with pytest.raises(IntentError, match="unknown backend None"):
        select_backend(MethodNeeds(), prefer=None)  # type: ignore[arg-type]


def test_intent_may_be_a_dict():
    assert select_backend(MethodNeeds(), {"offload": "params"}, available=ALL_INSTALLED).backend == "fsdp2"
    with pytest.raises(IntentError, match="unknown precision 'fp8'"):
        select_backend(MethodNeeds(), {"precision": "fp8"})


# -- availability --------------------------------------------------------------------------------------------


def test_requested_deepspeed_not_installed():
    with pytest.raises(BackendUnavailableError) as info:
        select_backend(MethodNeeds(), prefer="deepspeed", available=DS_MISSING)
    assert str(info.value) == (
        "autoshard cannot run this on deepspeed_zero3 (strategy='autoshard-deepspeed'):\n"
        "  - deepspeed is not installed: the deepspeed_zero3 backend needs it\n"
        "Backend that works: fsdp2 (strategy='fsdp2').\n"
        'Fix: pip install "autoshard[deepspeed]"'
    )


def test_auto_without_deepspeed_still_picks_fsdp2():
    decision = select_backend(MethodNeeds(), available=DS_MISSING)
    assert decision.backend == "fsdp2"
    assert decision.ruled_out["deepspeed_zero3"][0].line() == "deepspeed is not installed: the deepspeed_zero3 backend needs it"


def test_auto_needing_deepspeed_that_is_missing_says_install_it():
    with pytest.raises(BackendUnavailableError) as info:
        select_backend(MethodNeeds(), ShardingIntent(**NVME), available=DS_MISSING)
    assert str(info.value).endswith(
        "  - deepspeed_zero3: deepspeed is not installed: the deepspeed_zero3 backend needs it\n"
        "Closest: deepspeed_zero3 (strategy='autoshard-deepspeed').\n"
        'Fix: pip install "autoshard[deepspeed]"'
    )


def test_feature_conflicts_outrank_a_missing_install():
    # Installing deepspeed would not help an EMA method: the fix is the feature's, not pip's.
    with pytest.raises(IncompatibleBackendError) as info:
        select_backend(MethodNeeds(ema_pairs=(EMAPair("t", "s"),)), prefer="deepspeed", available=DS_MISSING)
    assert not isinstance(info.value, BackendUnavailableError)
    message = str(info.value)
    assert "  - deepspeed is not installed: the deepspeed_zero3 backend needs it\n" in message
    assert message.endswith("Fix: use strategy='fsdp2' (or strategy='auto-shard')")


def test_requested_deepspeed_too_old():
    old = {**ALL_INSTALLED, "deepspeed": Availability(False, "deepspeed 0.10.0 is older than the required 0.14", 'pip install -U "deepspeed>=0.14"')}
    with pytest.raises(BackendUnavailableError) as info:
        select_backend(MethodNeeds(), prefer="deepspeed", available=old)
    assert "  - deepspeed 0.10.0 is older than the required 0.14: the deepspeed_zero3 backend needs it\n" in str(info.value)
    assert str(info.value).endswith('Fix: pip install -U "deepspeed>=0.14"')


def fake_versions(monkeypatch, **versions: str | None) -> None:
    """Make importlib.metadata report these versions (None: not installed); other packages are real."""
    real = metadata.version

    def version(name: str) -> str:
        if name in versions:
            if versions[name] is None:
                raise metadata.PackageNotFoundError(name)
            return versions[name]  # type: ignore[return-value]
        return real(name)

    monkeypatch.setattr(metadata, "version", version)


def test_real_check_deepspeed_not_installed(monkeypatch):
    fake_versions(monkeypatch, deepspeed=None)
    with pytest.raises(BackendUnavailableError) as info:
        select_backend(MethodNeeds(), prefer="deepspeed")
    assert "  - deepspeed is not installed: the deepspeed_zero3 backend needs it\n" in str(info.value)
    assert str(info.value).endswith('Fix: pip install "autoshard[deepspeed]"')
    assert select_backend(MethodNeeds()).backend == "fsdp2"


def test_real_check_deepspeed_too_old(monkeypatch):
    fake_versions(monkeypatch, deepspeed="0.13.5")
    with pytest.raises(BackendUnavailableError) as info:
        select_backend(MethodNeeds(), prefer="deepspeed_zero3")
    assert "  - deepspeed 0.13.5 is older than the required 0.14: the deepspeed_zero3 backend needs it\n" in str(info.value)
    assert str(info.value).endswith('Fix: pip install -U "deepspeed>=0.14"')


def test_real_check_torch_too_old_refuses_fsdp2(monkeypatch):
    fake_versions(monkeypatch, torch="2.3.1")
    with pytest.raises(BackendUnavailableError) as info:
        select_backend(MethodNeeds(), prefer="fsdp2")
    # ZeRO-3 needs torch too, so nothing is left: the fix is the upgrade.
    assert "  - fsdp2: torch 2.3.1 is older than the required 2.4: the fsdp2 backend needs it\n" in str(info.value)
    assert str(info.value).endswith('Fix: pip install -U "torch>=2.4"')


def test_require_compares_release_numbers():
    for found, ok in [("2.4.0", True), ("2.4", True), ("2.6.0a0+git1234", True), ("2.4.0+cu121", True), ("2.3.9", False)]:
        original = metadata.version
        try:
            metadata.version = lambda name, found=found: found  # type: ignore[assignment]
            assert require("torch", "2.4", "pip install torch").ok is ok, found
        finally:
            metadata.version = original
    assert require("surely-not-installed-autoshard-test", "1.0", "pip install x") == Availability(
        False, "surely-not-installed-autoshard-test is not installed", "pip install x"
    )


def test_require_tolerates_an_unparsable_version(monkeypatch):
    monkeypatch.setattr(metadata, "version", lambda name: "custom-build")
    assert require("torch", "2.4", "pip install torch") == Availability(True, "torch custom-build (version not checked)")


def test_nothing_imports_deepspeed_unless_asked():
    code = (
        "import sys, autoshard\n"
        "from autoshard import MethodNeeds, select_backend, render_matrix\n"
        "render_matrix(details=True)\n"
        "assert select_backend(MethodNeeds(), prefer='deepspeed').backend == 'deepspeed_zero3'\n"
        "assert select_backend(MethodNeeds()).backend == 'fsdp2'\n"
        "from autoshard import cli\n"
        "print('deepspeed' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_fsdp1_request_when_fsdp2_cannot_run_it_either():
    with pytest.raises(IncompatibleBackendError) as info:
        select_backend(EMA_AND_PROBE, ShardingIntent(**NVME), prefer="fsdp", available=ALL_INSTALLED)
    lines = str(info.value).splitlines()
    assert lines[0] == "autoshard cannot run this on fsdp1, nor on any other backend:"
    assert lines[1].startswith("  - fsdp1: rejected: FSDP1's flat-parameter training state machine")
    assert lines[2].startswith("  - fsdp2: NVMe offload") and lines[-2] == "Closest: fsdp2 (strategy='fsdp2')."


def test_when_nothing_fits_the_fix_does_not_send_you_to_a_backend_that_refuses_too() -> None:
    """fsdp2's NVMe fix offers DeepSpeed, but DeepSpeed cannot do shard_size: only the fix that works remains."""
    intent = ShardingIntent(shard_size=2, offload="optimizer", offload_device="nvme", nvme_path="/nvme")
    with pytest.raises(IncompatibleBackendError) as err:
        select_backend(MethodNeeds(), intent)
    assert str(err.value).splitlines()[-1] == "Fix: use offload_device='cpu'"
    with pytest.raises(IncompatibleBackendError) as err:  # without the shard size, DeepSpeed is the way
        select_backend(MethodNeeds(), intent.replace(shard_size=None), prefer="fsdp2")
    assert "strategy='autoshard-deepspeed'" in str(err.value)
