"""The bad-input catalog, rows 70-84 and 167-168 (docs/bad-inputs.md): the command line, ``explain`` and the rates
files of ``autoshard calibrate``.

Nothing here is silently something else: no option is abbreviated, ``--json`` answers JSON whatever went wrong, a
user error is a message with a Fix (never a traceback), and a budget verdict is never "fits" on a partial estimate.
Everything runs in this process through ``autoshard.cli.main``; the modules are the tiny ones below.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from autoshard import cli
from autoshard.explain import explain

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).name
DEMO = "autoshard.demo:DinoLike"


class Plain(pl.LightningModule):
    """One optimizer, one forward: the smallest module a whole step can be simulated for."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.body(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


class Manual(Plain):
    """Plain's step under manual optimization, in the order Lightning's docs write it."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        (x,) = batch
        loss = self.body(x).pow(2).mean()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("loss", loss)


class NeedsATrainer(Plain):
    """training_step reads the Trainer; forward and example_input_array exist, so a forward can still be simulated."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.zeros(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self(x).pow(2).mean() / self.trainer.accumulate_grad_batches


def make_batch() -> tuple[torch.Tensor]:
    return (torch.randn(32, 64),)


def wrong_batch() -> tuple[torch.Tensor]:
    return (torch.randn(32, 65),)


def batch_from_disk() -> tuple[torch.Tensor]:
    return (torch.load("data/shard-0.pt"),)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code, out, _ = run(capsys, *argv, "--json")
    return code, json.loads(out)  # one JSON object, and nothing else, on stdout


def test_70_devices_is_the_trainers_word_not_devices_per_node(capsys: pytest.CaptureFixture[str]) -> None:
    code, report = run_json(capsys, "explain", DEMO, "--devices", "2", "--batch", "autoshard.demo:make_batch", "--budget", "80GiB")
    assert code == 0 and [m["world_size"] for m in report["memory"]] == [2]
    assert report["budget"]["world_size"] == 2 and report["budget"]["fits"] is True  # not a verdict for 64 ranks
    code, report = run_json(capsys, "explain", DEMO, "--devices", "8", "--num-nodes", "2", "--no-step")
    assert code == 0 and [(m["world_size"], m["num_nodes"]) for m in report["memory"]] == [(16, 2)]


def _parser_calls(path: Path) -> list[tuple[str, int, bool]]:
    calls = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if name in ("ArgumentParser", "add_parser", "Parser"):
                off = any(k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant) and k.value.value is False for k in node.keywords)
                calls.append((f"{path.relative_to(ROOT)}:{node.lineno}", node.lineno, off))
    return calls


def test_71_an_abbreviated_option_is_refused_in_every_parser(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, meant in (
        (["explain", DEMO, "--devices-per", "8"], "--devices-per-node"),
        (["explain", DEMO, "--world", "2"], "--world-sizes"),
        (["matrix", "--det"], "--details"),
        (["consolidate", "ckpt", "out.pt", "--forc"], "--force"),
    ):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and f"unrecognized arguments: {argv[-2] if argv[-1].isdigit() else argv[-1]}" in err, err
        assert f"Fix: {meant} (not " in err and "Traceback" not in err, err
    # Every parser the command builds, and every one written in src/ and benchmarks/ (workers included).
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert parser.allow_abbrev is False and all(p.allow_abbrev is False for p in sub.choices.values())
    calls = [c for f in sorted([*ROOT.glob("src/autoshard/**/*.py"), *ROOT.glob("benchmarks/*.py")]) for c in _parser_calls(f)]
    assert len(calls) >= 15 and [where for where, _, off in calls if not off] == []


def test_72_devices_and_world_sizes_together_are_refused_not_one_silently_winning(capsys: pytest.CaptureFixture[str]) -> None:
    code, report = run_json(capsys, "explain", DEMO, "--devices", "2", "--world-sizes", "1,2,8")
    assert code == 1 and report["error"]["message"].startswith("--devices 2 and --world-sizes 1,2,8 both set the world size")
    assert report["error"]["message"].endswith("Fix: keep one, e.g. --devices 2 alone")
    code, _, err = run(capsys, "explain", DEMO, "--devices", "4", "--devices-per-node", "8")
    assert code == 1 and err.startswith("autoshard: error: --devices 4 and --devices-per-node 8 disagree") and "Fix: drop --devices-per-node" in err


@pytest.mark.parametrize(
    "argv",
    [["matrix"], ["explain", DEMO], ["consolidate", "ckpt", "out.pt"], ["convert", "src", "dst", "--to", "dcp"]],
    ids=lambda argv: argv[0],
)
def test_73_json_with_an_unknown_option_is_one_json_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code, answer = run_json(capsys, *argv, "--verbose")
    assert code == 1 and answer["command"] == argv[0]
    assert answer["error"]["type"] == "UsageError" and answer["error"]["message"].startswith("unrecognized arguments: --verbose. Fix:")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["consolidate"], "the following arguments are required: CKPT_DIR, OUT.pt"),
        (["convert", "src", "dst"], "the following arguments are required: --to"),
        (["explain", DEMO, "--batch"], "argument --batch: expected one argument"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_74_json_with_a_missing_argument_is_one_json_error(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, answer = run_json(capsys, *argv)
    assert code == 1 and answer["error"]["type"] == "UsageError" and answer["error"]["message"].startswith(message), answer
    assert "Fix:" in answer["error"]["message"]


@pytest.mark.parametrize(
    ("argv", "fix"),
    [
        (["explain", DEMO, "--backend", "fsdp3"], "Fix: did you mean 'fsdp2'?"),
        (["explain", DEMO, "--accelerator", "tpuv5"], "Fix: choose one of 'cpu', 'gpu', 'cuda', 'auto'"),
        (["matrix", "--format", "html"], "Fix: choose one of 'text', 'markdown', 'json'"),
        (["explian", DEMO], "Fix: did you mean 'explain'?"),
    ],
)
def test_75_json_with_a_bad_choice_is_one_json_error_naming_the_choice(capsys: pytest.CaptureFixture[str], argv: list[str], fix: str) -> None:
    code, answer = run_json(capsys, *argv)
    assert code == 1 and "invalid choice" in answer["error"]["message"] and answer["error"]["message"].endswith(fix), answer


def test_76_without_json_a_bad_command_line_is_argparse_like_with_a_fix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["explain", DEMO, "--devcies", "2"])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == "" and err.startswith("usage: autoshard explain ")
    assert "autoshard explain: error: unrecognized arguments: --devcies 2. Fix: --devices (not --devcies)" in err
    assert "Traceback" not in err
    # `python -m autoshard.explain`: the same answers.
    from autoshard.explain import main

    assert main([DEMO, "--devcies", "2", "--json"]) == 1
    answer = json.loads(capsys.readouterr().out)
    assert answer["error"]["type"] == "UsageError" and "unrecognized arguments: --devcies 2" in answer["error"]["message"]


def test_77_a_batch_function_that_raises_is_named_with_its_line_and_a_fix(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["explain", f"{__name__}:Plain", "--batch", f"{__name__}:batch_from_disk", "--budget", "1GiB", "--world-sizes", "2"]
    code, out, err = run(capsys, *argv)
    line = batch_from_disk.__code__.co_firstlineno
    assert code == 1 and out == "" and "Traceback" not in err
    assert err.startswith(f"autoshard: error: the batch function batch_from_disk ({HERE}:{line}) raised FileNotFoundError: ")
    assert f'at {HERE}:{line + 1} `return (torch.load("data/shard-0.pt"),)`' in err
    assert "Fix: make it build tensors of one micro-batch's shapes" in err
    code, answer = run_json(capsys, *argv)
    assert code == 1 and answer["error"]["message"].startswith("the batch function batch_from_disk")


def test_78_manual_optimization_is_simulated_as_lightning_runs_it() -> None:
    manual = explain(f"{__name__}:Manual", world_sizes=(2,), batch=make_batch, budget="1GiB")
    automatic = explain(f"{__name__}:Plain", world_sizes=(2,), batch=make_batch)
    assert manual.needs.manual_optimization and manual.exit_code == 0 and manual.incomplete is None
    (m,), (a,) = manual.memory, automatic.memory
    assert m.activations > 0 and not m.forward_only and m.step_peak > m.model_states
    assert (m.step_peak, m.activations) == (a.step_peak, a.activations)  # the same step, the same peak
    assert manual.budget is not None and manual.budget.fits is True and "fits" in manual.text()
    assert not any("not attached" in n for n in manual.notes), manual.notes


def test_79_a_wrong_shaped_batch_is_one_message_with_the_shapes_never_fits(capfd: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["explain", f"{__name__}:Plain", "--batch", f"{__name__}:wrong_batch", "--budget", "1GiB", "--world-sizes", "2"])
    out, err = capfd.readouterr()
    assert code == 1 and ": fits" not in out
    assert "with activations not counted: cannot tell whether it fits" in out
    incomplete = out.split("== incomplete estimate ==\n")[1].splitlines()[0]
    assert incomplete.startswith(f"activations not counted (world size 2): training_step could not run on the batch from wrong_batch ({HERE}:")
    assert "(float32[32, 65],): RuntimeError: a and b must have same reduction dim, but got [32, 65] X [64, 256]" in incomplete
    assert f"at {HERE}:{Plain.training_step.__code__.co_firstlineno + 2} `return self.body(x).pow(2).mean()`" in incomplete
    assert "Fix: make wrong_batch return one micro-batch exactly as your DataLoader yields it" in incomplete
    assert "pass --batch" not in out  # they did
    assert "fake_tensor" not in err and len(err.splitlines()) <= 2, err  # the progress line, no fake-tensor log


def test_80_a_budget_without_a_batch_cannot_say_fits(capsys: pytest.CaptureFixture[str]) -> None:
    code, report = run_json(capsys, "explain", f"{__name__}:Plain", "--budget", "1GiB", "--world-sizes", "2")
    assert code == 1 and report["budget"]["fits"] is None and report["budget"]["missing"] == "activations"
    assert report["error"]["type"] == "IncompleteEstimate"
    assert report["error"]["message"].startswith("activations not counted (world size 2): no --batch was given, and Plain has no example_input_array")
    assert report["error"]["message"].endswith(
        "Fix: pass --batch FILE.py:make_batch (a function of no arguments returning one micro-batch, as your DataLoader yields it)"
    )
    # Lower bound already over the budget: that much is certain, and said.
    code, out, _ = run(capsys, "explain", f"{__name__}:Plain", "--budget", "1KiB", "--world-sizes", "2")
    assert code == 1 and "with activations not counted: does NOT fit, even without them" in out


def test_81_no_step_with_a_budget_says_drop_no_step_not_pass_batch(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "explain", f"{__name__}:Plain", "--batch", f"{__name__}:make_batch", "--no-step", "--budget", "1GiB", "--world-sizes", "2"
    )
    assert code == 1 and "cannot tell whether it fits" in out
    assert "activations not counted (world size 2): --no-step asks for model states only. Fix: drop --no-step\n" in out
    assert "activations are not counted: --no-step (model states only)" in out and "pass --batch" not in out


def test_82_a_step_that_falls_back_to_a_forward_is_not_a_whole_step(capsys: pytest.CaptureFixture[str]) -> None:
    code, report = run_json(
        capsys, "explain", f"{__name__}:NeedsATrainer", "--batch", f"{__name__}:make_batch", "--budget", "1GiB", "--world-sizes", "2"
    )
    assert code == 1 and report["memory"][0]["forward_only"] and report["memory"][0]["activations"] > 0
    assert report["budget"]["fits"] is None and report["budget"]["missing"] == "the backward and the optimizer step"
    message = report["error"]["message"]
    assert message.startswith("the backward and the optimizer step not counted (world size 2): training_step could not run on the batch")
    assert "NeedsATrainer is not attached to a `Trainer`" in message and "self.trainer.accumulate_grad_batches" in message
    assert "Fix:" in message and "pass --batch" not in message


def test_83_an_intent_file_that_does_not_parse_is_a_message(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "intent.json").write_text('{"offload": params}')
    (tmp_path / "intent.yaml").write_text("offload: [params\n")
    code, _, err = run(capsys, "explain", DEMO, "--intent-file", str(tmp_path / "intent.json"))
    assert code == 1 and "is not valid JSON: Expecting value: line 1 column 13" in err and "Traceback" not in err
    code, _, err = run(capsys, "explain", DEMO, "--intent-file", str(tmp_path / "intent.yaml"))
    assert code == 1 and "is not valid YAML (line 2, column 1: expected ',' or ']'" in err and "Fix: one `field: value` per line" in err


def test_84_write_matrix_into_a_missing_directory_is_a_message(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "no" / "such" / "matrix.md"
    code, answer = run_json(capsys, "explain", "--write-matrix", str(target))
    assert code == 1 and answer["error"]["message"].startswith(f"cannot write the capability matrix page to {target}: No such file or directory")
    assert not target.parent.exists()


def _rates_file(path: Path, **rates: float) -> None:
    """A rates file as ``autoshard calibrate`` writes it (its measurement is tested in tests/test_calibrate.py)."""
    from autoshard.budget import RATES_FORMAT, Rates
    from autoshard.calibrate import write_rates

    write_rates({"format": RATES_FORMAT, "rates": {**Rates().to_dict(), **rates}}, path)


def test_167_a_bad_rates_files_fix_is_one_calibrate_carries_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It used to say "Fix: autoshard calibrate --out THAT_PATH" for any unreadable file, and calibrate then refused a
    file it did not write: the Fix names that path only where calibrate writes it."""
    from autoshard.budget import RATES_ENV, Rates, default_rates, read_rates
    from autoshard.calibrate import CalibrateError, write_rates
    from autoshard.errors import IntentError

    missing, ours, theirs = tmp_path / "missing.json", tmp_path / "ours.json", tmp_path / "notes.json"
    _rates_file(ours, flops_per_s=0)
    theirs.write_text("my notes")
    for path in (missing, ours):
        with pytest.raises(IntentError, match=rf"Fix: autoshard calibrate --out '{path}'$"):
            read_rates(path)
        _rates_file(path)  # what that Fix runs: written
        assert read_rates(path) == Rates()
    monkeypatch.setenv(RATES_ENV, str(theirs))
    with pytest.raises(IntentError) as refused:
        default_rates()
    assert str(refused.value).endswith(
        "Fix: autoshard calibrate --out NEW.json (it replaces only a rates file it wrote) and AUTOSHARD_RATES=NEW.json, or unset AUTOSHARD_RATES"
    )
    with pytest.raises(CalibrateError):  # the path it no longer names: refused
        write_rates({}, theirs)
    assert theirs.read_text() == "my notes"


def test_168_calibrate_out_onto_a_file_it_did_not_write_names_a_free_path(tmp_path: Path) -> None:
    """``--out rates.json`` over someone's rates.json said "Fix: --out a new path, e.g. 'rates.json'": the same path."""
    from autoshard.calibrate import CalibrateError

    taken = tmp_path / "rates.json"
    taken.write_text("mine")
    (tmp_path / "rates-1.json").write_text("mine too")
    with pytest.raises(CalibrateError, match=r"did not write .*Fix: --out a new path, e\.g\. '.*/rates-2\.json'$"):
        _rates_file(taken)
    assert taken.read_text() == "mine"
    _rates_file(tmp_path / "rates-2.json")  # the Fix's path: written


def test_168_calibrate_refuses_its_out_before_measuring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import autoshard.calibrate

    def measured(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("measured before the path was checked")

    monkeypatch.setattr(autoshard.calibrate, "calibrate", measured)
    (tmp_path / "notes.json").write_text("mine")
    assert cli.main(["calibrate", "--out", str(tmp_path / "notes.json")]) != 0
    assert "refusing to write" in capsys.readouterr().err and (tmp_path / "notes.json").read_text() == "mine"
