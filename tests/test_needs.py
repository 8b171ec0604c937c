"""inspect_needs on real LightningModules: optimizers, EMA pairs, probes, root parameters, declarations."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from autoshard import AutoShardError, EMAPair, MethodNeeds, inspect_needs
from autoshard.needs import find_ema_pairs, returned_optimizers


def mlp(width: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))


class OneOptimizer(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = mlp()
        self.head = nn.Linear(8, 2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class TwoOptimizersList(OneOptimizer):
    def configure_optimizers(self):
        return [torch.optim.SGD(self.backbone.parameters(), lr=0.1), torch.optim.SGD(self.head.parameters(), lr=0.1)]


class TwoOptimizersWithSchedulers(OneOptimizer):
    def configure_optimizers(self):
        opts = [torch.optim.SGD(self.backbone.parameters(), lr=0.1), torch.optim.Adam(self.head.parameters())]
        return opts, [torch.optim.lr_scheduler.StepLR(opts[0], 1)]


class TwoOptimizersDicts(OneOptimizer):
    def configure_optimizers(self):
        first = torch.optim.SGD(self.backbone.parameters(), lr=0.1)
        return (
            {"optimizer": first, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(first, 1), "interval": "step"}},
            {"optimizer": torch.optim.SGD(self.head.parameters(), lr=0.1)},
        )


class OneOptimizerDict(OneOptimizer):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}


class EMAModule(pl.LightningModule):
    """DINO-style: the teacher is a frozen deep copy of the student."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(mlp(), nn.Linear(8, 4))
        self.predictor = nn.Linear(4, 4)
        self.momentum_encoder = copy.deepcopy(self.student).requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad])


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.student = mlp()
        self.teacher = mlp()  # not frozen: found by name alone


class NamedPairModule(OneOptimizer):
    def __init__(self) -> None:
        super().__init__()
        self.distill = Wrapper()


class FrozenEncoderModule(OneOptimizer):
    """A pretrained encoder kept frozen: it mirrors nothing trainable, so it is no EMA teacher."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)).requires_grad_(False)


class ProbeModule(OneOptimizer):
    def __init__(self) -> None:
        super().__init__()
        self.probe = nn.Linear(8, 3)


class OnlineProbe(pl.Callback):
    """Trains pl_module.probe with its own optimizer, like solo-learn / lightly online linear probes."""

    def __init__(self, probe: nn.Module) -> None:
        self.probe = probe
        self.optimizer = torch.optim.SGD(probe.parameters(), lr=0.1)


class DeclaredProbe(pl.Callback):
    autoshard_optimizers = 1  # builds its optimizer later, in setup()


class RootParameters(OneOptimizer):
    def __init__(self) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 8))
        self.logit_scale = nn.Parameter(torch.ones(()))


class Manual(OneOptimizer):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class Raising(OneOptimizer):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.trainer.estimated_stepping_batches)


def snapshot(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, bool], bool]:
    state = {k: v.clone() for k, v in module.state_dict().items()}
    return state, {n: p.requires_grad for n, p in module.named_parameters()}, module.training


def assert_unchanged(module: nn.Module, before) -> None:
    state, grads, training = snapshot(module)
    assert state.keys() == before[0].keys()
    assert all(torch.equal(state[k], before[0][k]) for k in state)
    assert grads == before[1] and training == before[2]
    assert all(p.grad is None for p in module.parameters())


def test_one_optimizer():
    needs = inspect_needs(OneOptimizer())
    assert needs.num_optimizers == 1 and needs.optimizer_sources == (("configure_optimizers", 1),)
    assert needs.ema_pairs == () and needs.root_parameters == () and needs.callback_modules == ()
    assert not needs.manual_optimization and not needs.multi_forward


@pytest.mark.parametrize("module_cls", [TwoOptimizersList, TwoOptimizersWithSchedulers, TwoOptimizersDicts])
def test_two_optimizers_in_every_return_shape(module_cls):
    needs = inspect_needs(module_cls())
    assert needs.num_optimizers == 2
    assert needs.describe_optimizers() == "2 from configure_optimizers"


def test_single_dict_and_none_count_right():
    assert inspect_needs(OneOptimizerDict()).num_optimizers == 1
    assert len(returned_optimizers(None)) == 0
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    assert len(returned_optimizers(([opt, opt], []))) == 2 and len(returned_optimizers((opt,))) == 1
    assert len(returned_optimizers([{"optimizer": opt}, {"optimizer": opt}, {"optimizer": opt}])) == 3


def test_ema_teacher_is_a_frozen_mirror_of_the_student():
    module = EMAModule()
    assert inspect_needs(module).ema_pairs == (EMAPair("momentum_encoder", "student"),)


def test_ema_student_may_hold_frozen_layers():
    module = EMAModule()
    module.student[1].bias.requires_grad_(False)  # still a trainable subtree
    assert find_ema_pairs(module) == [EMAPair("momentum_encoder", "student")]


def test_siblings_named_teacher_and_student_inside_a_wrapper():
    assert inspect_needs(NamedPairModule()).ema_pairs == (EMAPair("distill.teacher", "distill.student"),)


def test_frozen_pretrained_encoder_is_not_an_ema_pair():
    needs = inspect_needs(FrozenEncoderModule())
    assert needs.ema_pairs == ()


def test_probe_callback_counted_from_callbacks_list():
    module = ProbeModule()
    needs = inspect_needs(module, callbacks=[OnlineProbe(module.probe)])
    assert needs.num_optimizers == 2
    assert needs.optimizer_sources == (("configure_optimizers", 1), ("callback OnlineProbe", 1))
    assert needs.callback_modules == ("probe",)


def test_probe_callback_counted_from_a_real_trainer():
    module = ProbeModule()
    trainer = pl.Trainer(callbacks=[OnlineProbe(module.probe), DeclaredProbe()], accelerator="cpu", logger=False, enable_checkpointing=False)
    needs = inspect_needs(module, trainer)
    assert needs.num_optimizers == 3
    assert needs.describe_optimizers() == "1 from configure_optimizers, 1 from callback OnlineProbe, 1 from callback DeclaredProbe"
    assert needs.callback_modules == ("probe",)


def test_attached_trainer_is_used_when_none_is_given():
    module = ProbeModule()
    trainer = pl.Trainer(callbacks=[OnlineProbe(module.probe)], accelerator="cpu", logger=False, enable_checkpointing=False)
    module.trainer = trainer
    assert inspect_needs(module).num_optimizers == 2


def test_bad_callback_declaration():
    class Bad(pl.Callback):
        autoshard_optimizers = "one"

    with pytest.raises(AutoShardError) as info:
        inspect_needs(OneOptimizer(), callbacks=[Bad()])
    assert str(info.value) == "Bad.autoshard_optimizers must be a whole number (0 or more), got 'one'"


def test_root_parameters():
    assert inspect_needs(RootParameters()).root_parameters == ("cls_token", "logit_scale")


def test_manual_optimization():
    assert inspect_needs(Manual()).manual_optimization


def test_declared_dict_wins_over_detection():
    module = EMAModule()
    module.autoshard_needs = {"optimizers": 2, "ema_pairs": [], "multi_forward": True}
    needs = inspect_needs(module, callbacks=[OnlineProbe(module.predictor)])
    assert needs.optimizer_sources == (("declared", 2), ("callback OnlineProbe", 1))
    assert needs.ema_pairs == () and needs.multi_forward
    assert needs.callback_modules == ("predictor",)


def test_declared_dict_skips_configure_optimizers():
    module = Raising()
    module.autoshard_needs = {"optimizers": 1, "ema_pairs": [{"teacher": "head", "student": "backbone"}], "callback_modules": "head"}
    needs = inspect_needs(module)
    assert needs.num_optimizers == 1 and needs.ema_pairs == (EMAPair("head", "backbone"),)
    assert needs.callback_modules == ("head",)


def test_declared_method_needs_is_returned_as_is():
    declared = MethodNeeds(optimizer_sources=[("declared", 1)], ema_pairs=[("teacher", "student")], multi_forward=True)
    module = Raising()
    module.autoshard_needs = declared
    assert inspect_needs(module, callbacks=[OnlineProbe(module.head)]) is declared
    assert declared.ema_pairs == (EMAPair("teacher", "student"),) and hash(declared)


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        ("two", "OneOptimizer.autoshard_needs must be a MethodNeeds or a dict such as {'optimizers': 2, 'multi_forward': True}, got str"),
        (
            {"optimisers": 2, "zzz": 1},
            "unknown key(s) in OneOptimizer.autoshard_needs: 'optimisers' (did you mean 'optimizers'?) 'zzz'. Valid keys"
            " are optimizers, ema_pairs, manual_optimization, multi_forward, callback_modules",
        ),
        ({"optimizers": -1}, "autoshard_needs['optimizers'] must be a whole number (0 or more), got -1"),
        ({"multi_forward": "yes"}, "autoshard_needs['multi_forward'] must be True or False, got 'yes'"),
        (
            {"ema_pairs": ["teacher"]},
            "an EMA pair is ('teacher.path', 'student.path') or {'teacher': ..., 'student': ...}, got 'teacher'",
        ),
    ],
)
def test_bad_declarations_are_refused(declared, message):
    module = OneOptimizer()
    module.autoshard_needs = declared
    with pytest.raises(AutoShardError) as info:
        inspect_needs(module)
    assert str(info.value) == message


def test_configure_optimizers_raising_gives_the_guidance():
    with pytest.raises(AutoShardError) as info:
        inspect_needs(Raising())
    assert str(info.value) == (
        "autoshard could not count optimizers: Raising.configure_optimizers() raised RuntimeError: Raising is not"
        " attached to a `Trainer`. Declare them instead: set `autoshard_needs = {'optimizers': N}` on the module"
    )


def test_zero3_partitioned_parameters_are_read_by_their_real_shapes():
    # Under zero.Init each parameter is an empty placeholder carrying ds_shape / ds_numel.
    ema, frozen = EMAModule(), FrozenEncoderModule()
    for p in [*ema.parameters(), *frozen.parameters()]:
        p.ds_shape, p.ds_numel = p.shape, p.numel()
        p.data = torch.empty(0)
    assert find_ema_pairs(ema) == [EMAPair("momentum_encoder", "student")]
    assert find_ema_pairs(frozen) == []  # placeholders all look alike; the real shapes do not


@pytest.mark.parametrize("module_cls", [OneOptimizer, EMAModule, NamedPairModule, FrozenEncoderModule, RootParameters, ProbeModule])
def test_inspection_leaves_the_module_unchanged(module_cls):
    module = module_cls()
    before = snapshot(module)
    callbacks = [OnlineProbe(module.probe)] if hasattr(module, "probe") else []
    inspect_needs(module, callbacks=callbacks)
    assert_unchanged(module, before)


class FineTuned(nn.Module):
    """Fine-tuning, not EMA: early blocks frozen, and a frozen norm beside a trainable one in every block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(4))
        self.blocks[:2].requires_grad_(False)
        self.norms = nn.ModuleDict({"a": nn.LayerNorm(8), "b": nn.LayerNorm(8)})
        self.norms["a"].requires_grad_(False)


def test_frozen_layers_of_a_fine_tuned_model_are_not_ema_pairs():
    assert find_ema_pairs(FineTuned()) == []


def test_byol_style_online_target_pair_is_found_by_structure():
    class BYOL(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.online = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
            self.target = copy.deepcopy(self.online).requires_grad_(False)

    assert find_ema_pairs(BYOL()) == [EMAPair("target", "online")]


# -- during fit no user hook is called to inspect: optimizers come from Lightning's own call ----------------------
class CountsItsCalls(OneOptimizer):
    """Like stable-pretraining's probe wrappers: configure_optimizers may run once, no more."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def configure_optimizers(self):
        self.calls += 1
        assert self.calls == 1
        return super().configure_optimizers()


def test_call_hooks_false_never_calls_configure_optimizers():
    module = CountsItsCalls()
    needs = inspect_needs(module, callbacks=[DeclaredProbe()], call_hooks=False)
    assert module.calls == 0
    assert needs.optimizer_sources == (("callback DeclaredProbe", 1),)


def test_optimizers_from_lightnings_call_are_counted_without_a_call():
    module = CountsItsCalls()
    returned = module.configure_optimizers()  # Lightning's one call
    needs = inspect_needs(module, callbacks=[], optimizers=[returned], call_hooks=False)
    assert module.calls == 1 and needs.optimizer_sources == (("configure_optimizers", 1),)


def test_an_optimizer_both_returned_and_held_by_a_callback_counts_once_as_the_callbacks():
    module = ProbeModule()
    probe = OnlineProbe(module.probe)
    mine = torch.optim.SGD(module.backbone.parameters(), lr=0.1)
    needs = inspect_needs(module, callbacks=[probe], optimizers=[mine, probe.optimizer])
    assert needs.optimizer_sources == (("configure_optimizers", 1), ("callback OnlineProbe", 1))
    assert needs.callback_modules == ("probe",)


def test_lightnings_stand_in_for_none_and_its_wrappers_are_read_right():
    from lightning.pytorch.core.optimizer import LightningOptimizer, _MockOptimizer

    module = OneOptimizer()
    assert inspect_needs(module, callbacks=[], optimizers=[_MockOptimizer()]).num_optimizers == 0
    wrapped = LightningOptimizer(torch.optim.SGD(module.parameters(), lr=0.1))
    assert inspect_needs(module, callbacks=[], optimizers=[wrapped]).num_optimizers == 1


def test_a_configure_optimizers_wrapped_on_the_instance_says_so():
    module = OneOptimizer()
    original = module.configure_optimizers
    module.configure_optimizers = lambda: [original(), torch.optim.SGD(module.head.parameters(), lr=0.1)]
    needs = inspect_needs(module, callbacks=[], optimizers=module.configure_optimizers())
    assert needs.describe_optimizers() == "2 from configure_optimizers (wrapped on the instance, as probe callbacks do)"


def test_recount_keeps_what_shaped_the_sharding_and_respects_declarations():
    from autoshard.needs import recount_optimizers

    module = EMAModule()
    before = inspect_needs(module, callbacks=[DeclaredProbe()], call_hooks=False)
    assert before.optimizer_sources == (("callback DeclaredProbe", 1),)
    opts = [torch.optim.SGD(module.student.parameters(), lr=0.1), torch.optim.SGD(module.predictor.parameters(), lr=0.1)]
    after = recount_optimizers(before, module, opts, callbacks=[DeclaredProbe()])
    assert after.optimizer_sources == (("configure_optimizers", 2), ("callback DeclaredProbe", 1))
    assert after.ema_pairs == before.ema_pairs == (EMAPair("momentum_encoder", "student"),)
    module.autoshard_needs = {"optimizers": 1}
    declared = recount_optimizers(before, module, opts, callbacks=[])
    assert declared.optimizer_sources == (("declared", 1),)


class WrappedProbes(pl.Callback):
    """Probe optimizers held as a LightningOptimizer, in a dict, and the same one twice."""

    def __init__(self, module: OneOptimizer) -> None:
        from lightning.pytorch.core.optimizer import LightningOptimizer

        first = torch.optim.SGD(module.head.parameters(), lr=0.1)
        self.wrapped = LightningOptimizer(first)
        self.by_name = {"second": torch.optim.Adam(module.backbone.parameters())}
        self.again = [first, first]


def test_needs_memory_and_checkpoints_find_the_same_optimizers():
    """One rule set (autoshard.needs) for every consumer: counted, estimated and checkpointed alike."""
    from types import SimpleNamespace

    from autoshard.lightning.checkpoint import CheckpointMixin
    from autoshard.memory import collect_optimizers

    module = OneOptimizer()
    probe = WrappedProbes(module)
    expected = [probe.wrapped._optimizer, probe.by_name["second"]]
    needs = inspect_needs(module, callbacks=[probe])
    assert needs.optimizer_sources == (("configure_optimizers", 1), ("callback WrappedProbes", 2))
    assert [o for source, o in collect_optimizers(module, [probe]) if source.startswith("callback")] == expected
    module._trainer = SimpleNamespace(callbacks=[probe], optimizers=[])  # what _callback_optimizers reads
    strategy = SimpleNamespace(lightning_module=module)
    try:
        assert [o for _, _, o in CheckpointMixin._callback_optimizers(strategy)] == expected
    finally:
        module._trainer = None
