"""The bad-input catalog, rows 169-177 (docs/bad-inputs.md, "Round four: the newest features").

The newest features given wrong, odd and hostile values: ``autoshard calibrate``'s ``--device``, ``--repeats`` and
``--out`` are refused before anything is measured (in JSON under ``--json``), never with a raw traceback or rates
timed on a meta device; ``autoshard.ThroughputMonitor``'s arguments are refused when it is built, not mid-run or
with a negative MFU; ``memory_headroom`` reads sizes as ``memory_budget`` does; a memory budget keeps the headroom of
the device named, however it is spelt, in ``decide`` and in ``explain --budget`` alike; and the budget's ``at:`` says
where a peak outside any module is. In one process, no fit: each test costs a second or two.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

import autoshard
from autoshard import cli
from autoshard.budget import CUDA_HEADROOM, Headroom, decide
from autoshard.errors import AutoShardError, IntentError
from autoshard.intent import ShardingIntent
from tests.test_budget_decide import Small, batch


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = cli.main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)  # one JSON object on stdout, whatever happened


@pytest.fixture
def never_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal of calibrate's arguments comes before the half minute of measuring."""
    import autoshard.calibrate

    def measured(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("measured before the arguments were checked")

    monkeypatch.setattr(autoshard.calibrate, "calibrate", measured)


# -- autoshard calibrate ---------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("never_measured")
def test_169_calibrate_refuses_a_device_it_cannot_time(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """'xyz' and 'gpu' were torch's raw RuntimeError, a CUDA device this machine lacks an AssertionError ("Torch not
    compiled with CUDA enabled") or a bare index error, and 'meta' wrote rates timed on tensors without data, labelled
    "cpu". Each is a CalibrateError naming the value, with the devices this machine has."""
    out = tmp_path / "rates.json"
    absent = f"cuda:{torch.cuda.device_count()}"
    expected = {
        "xyz": "is not a device torch knows",
        "gpu": "is not a device torch knows",
        absent: "CUDA device",
        "meta": "meta tensors hold no data",
        "mps": "calibrate times cpu and cuda only",
    }
    for device, words in expected.items():
        code, report = run_json(capsys, "calibrate", "--device", device, "--out", str(out))
        error = report["error"]
        assert code == 1 and error["type"] == "CalibrateError", (device, error)
        assert f"--device {device!r}" in error["message"] and words in error["message"] and "--device cpu" in error["message"].split("Fix: ")[1]
        assert not out.exists()
    from autoshard.calibrate import measured_device

    assert measured_device("cpu:0") == torch.device("cpu", 0)  # the Fix's device is accepted


@pytest.mark.usefixtures("never_measured")
def test_170_calibrate_refuses_repeats_below_one(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``--repeats 0`` (or -1) ended in ``statistics.StatisticsError: no median for empty data`` after the warm-up."""
    for repeats in ("0", "-1"):
        code, report = run_json(capsys, "calibrate", "--repeats", repeats, "--out", str(tmp_path / "r.json"))
        assert code == 1 and report["error"]["type"] == "CalibrateError"
        assert report["error"]["message"].startswith(f"--repeats {repeats}:") and report["error"]["message"].endswith(
            "Fix: --repeats 5 (the default)"
        )


@pytest.mark.usefixtures("never_measured")
def test_171_calibrate_refuses_an_out_under_a_file_before_measuring(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``--out notes.txt/rates.json``: it measured first, then said ``cannot write ... (File exists)``, blaming a
    path that does not exist."""
    (tmp_path / "notes.txt").write_text("mine")
    code, report = run_json(capsys, "calibrate", "--out", str(tmp_path / "notes.txt" / "rates.json"))
    message = report["error"]["message"]
    assert code == 1 and f"'{tmp_path / 'notes.txt'}' is a file, not a directory" in message and "Fix: --out a path in a directory" in message
    assert (tmp_path / "notes.txt").read_text() == "mine"


# -- autoshard.ThroughputMonitor -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        ({"peak_flops": 0}, "Fix: peak_flops=989.4e12"),  # MFU silently dropped
        ({"peak_flops": -1e12}, "Fix: peak_flops=989.4e12"),  # a negative MFU logged
        ({"peak_flops": "989e12"}, "Fix: peak_flops=9.89e+14,"),  # a TypeError once window_size batches ran
        ({"flops_per_batch": -5}, "Fix: flops_per_batch=6 * parameters"),  # negative FLOP/s logged
        ({"flops_per_batch": "1e9"}, "Fix: flops_per_batch=1e+09,"),  # a TypeError mid-run
    ],
)
def test_172_throughput_monitor_refuses_a_peak_or_flops_that_is_not_a_positive_number(kwargs: dict[str, Any], fix: str) -> None:
    with pytest.raises(AutoShardError, match="is the .*a positive number") as refused:
        autoshard.ThroughputMonitor(**kwargs)
    (name, value), message = next(iter(kwargs.items())), str(refused.value)
    assert message.startswith(f"autoshard.ThroughputMonitor({name}={value!r})") and fix in message
    fixed = float(value) if isinstance(value, str) else 989.4e12 if name == "peak_flops" else 1e9
    autoshard.ThroughputMonitor(**{name: fixed})  # the Fix's value is taken
    autoshard.ThroughputMonitor(**{name: numpy.float64(fixed)})  # numpy's numbers too (a YAML or a computed peak)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"length_fn": "samples"}, "Fix: length_fn=lambda batch: ..., or 'tokens' (the default), None"),  # 'str' object is not callable, mid-run
        ({"batch_size_fn": 4}, "Fix: batch_size_fn=lambda batch: ..."),
        ({"window": 50}, "Fix: window_size=50 instead of window="),  # Lightning's Throughput TypeError at the fit's setup
        ({"window_size": 1}, "so at least 2. Fix: window_size=100"),  # a bare AssertionError at the fit's setup
    ],
)
def test_173_throughput_monitor_refuses_its_other_arguments_when_built(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(AutoShardError) as refused:
        autoshard.ThroughputMonitor(**kwargs)
    assert words in str(refused.value) and "autoshard.ThroughputMonitor" in str(refused.value)


# -- the memory budget's headroom ------------------------------------------------------------------------------------
def test_174_decide_keeps_the_cuda_headroom_for_a_cuda_device_however_it_is_named() -> None:
    """``device_type='cuda:0'`` or ``torch.device('cuda', 1)`` decided with no headroom at all (only the exact string
    'cuda' kept it), so the chosen peak could fill the device; 'gpu' did the same, silently."""
    intent = ShardingIntent(memory_budget="3GiB")
    for device in ("cuda", "cuda:0", torch.device("cuda", 1)):
        assert decide(Small, batch(), intent, 2, device_type=device).headroom == CUDA_HEADROOM, device  # type: ignore[arg-type]
    assert decide(Small, batch(), intent, 2, device_type="cpu:0").headroom == Headroom()
    with pytest.raises(IntentError, match=r"decide\(device_type='gpu'\): not a device type torch knows.*Fix: device_type='cuda'"):
        decide(Small, batch(), intent, 2, device_type="gpu")


def test_177_memory_headroom_reads_sizes_as_memory_budget_does_and_any_zero_is_zero() -> None:
    """``memory_headroom='0GiB'`` was refused with "must be at least one byte. Fix: e.g. memory_headroom 2GiB" where
    ``0`` means "tensors may fill the budget", and YAML's ``2.0e+9`` (a float) was refused where memory_budget takes it."""
    for zero in ("0GiB", "0 B", 0.0, "0"):
        assert ShardingIntent(memory_budget="80GiB", memory_headroom=zero).memory_headroom == 0, zero
    assert ShardingIntent(memory_budget="80GiB", memory_headroom=2.0e9).memory_headroom == 2_000_000_000
    with pytest.raises(IntentError, match=r"memory_headroom -5 must not be negative\. Fix: e\.g\. memory_headroom 2GiB"):
        ShardingIntent(memory_budget="80GiB", memory_headroom=-5)
    with pytest.raises(IntentError, match=r"'10%' is not a size\. Fix: write it as 2GiB, 500MB or a number of bytes$"):
        ShardingIntent(memory_budget="80GiB", memory_headroom="10%")


def small(**kwargs: Any) -> Small:
    return Small()


def test_175_explain_budget_keeps_the_headroom_of_the_accelerator_it_explains(capsys: pytest.CaptureFixture[str]) -> None:
    """``explain --budget --accelerator gpu`` on a machine without a GPU decided with no headroom (this machine's),
    and its fit-or-not verdict kept none on any machine: "fits" above a decision that, keeping the headroom, had to
    change the run. Now both keep the headroom of the run explained, as its decision at fit will."""
    at_fit = decide(Small, batch(), ShardingIntent(memory_budget=(2 << 30) + (1 << 20)), 2, device_type="cuda")
    argv = ["explain", f"{__name__}:small", "--batch", "tests.test_budget_decide:batch", "--world-sizes", "2"]
    code, report = run_json(capsys, *argv, "--budget", str((2 << 30) + (1 << 20)), "--accelerator", "gpu")
    assert code == 0 and report["budget"]["fits"] is False and report["budget"]["headroom"] == CUDA_HEADROOM.to_dict()
    (auto,) = report["auto"]
    assert auto["headroom"] == CUDA_HEADROOM.to_dict() and auto["chosen"] == at_fit.chosen and auto["peak"] == at_fit.peak
    code, report = run_json(capsys, *argv, "--budget", str((2 << 30) + (1 << 20)), "--accelerator", "cpu")
    assert code == 0 and report["budget"]["fits"] is True and report["auto"][0]["headroom"] == Headroom().to_dict()


def test_175_a_budget_below_the_headroom_is_no_negative_limit_and_its_fix_works(capsys: pytest.CaptureFixture[str]) -> None:
    """Below the headroom the verdict said "the peak may reach -1.82 GiB" and "-0% of what it may reach"; it says why
    nothing fits instead, and the Fix it names is taken."""
    argv = ["explain", f"{__name__}:small", "--batch", "tests.test_budget_decide:batch", "--world-sizes", "2", "--budget", "150KiB"]
    cli.main([*argv, "--accelerator", "gpu"])
    text = capsys.readouterr().out
    assert "budget 150.00 KiB per rank: less than its headroom 2.00 GiB + 10% of the peak: does NOT fit" in text
    assert "may reach -" not in text and "-0%" not in text
    fix = text.split("Fix: ")[1].split(", or --intent ")[1].split(" to let")[0]  # "memory_budget=153600 --intent memory_headroom=0"
    intent = [arg for pair in fix.split(" --intent ") for arg in ("--intent", pair)]
    _, report = run_json(capsys, *argv, "--accelerator", "gpu", *intent)
    assert report["budget"]["headroom"] == Headroom().to_dict() and report["budget"]["fits"] is False  # a verdict on the peak
    assert report["budget"]["changes"] and "headroom" not in report["auto"][0]["error"]["message"]  # refused for the peak alone


# -- the budget table's at: ------------------------------------------------------------------------------------------
class LossPeak(Small):
    """A step whose peak is in the backward of training_step's own ops: a wide loss outside any module."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self(x).expand(-1, -1, 4096).exp().mean()  # 8 MiB kept for exp's backward, outside any module


def test_176_at_says_where_a_peak_outside_any_module_is() -> None:
    """A peak in the backward of the loss said "at: backward", as if it named a place."""
    decision = decide(LossPeak, batch(), ShardingIntent(memory_budget="1GiB"), 1, device_type="cpu")
    assert decision.at == "backward of training_step's own ops (outside any module: the loss, residual adds)", decision.at
    assert f"(at: {decision.at})" in decision.table()


def test_a_decision_stored_without_at_still_loads_and_resumes() -> None:
    """A checkpoint's decision from before ``at`` existed loads, and its table leaves ``at`` out."""
    from autoshard.budget import BudgetDecision

    stored = decide(Small, batch(), ShardingIntent(memory_budget="1GiB"), 2, device_type="cpu").to_dict()
    stored.pop("at")
    for tried in stored["cheaper"]:
        tried.pop("at", None)
    assert "at:" not in BudgetDecision.from_dict(stored).table()


# -- price's precision ------------------------------------------------------------------------------------------------
def test_179_price_takes_the_precision_a_trainer_takes() -> None:
    """``price(..., precision="bf16-mixed")`` raised ``AttributeError: 'str' object has no attribute 'precision'``,
    where ``decide`` takes the same string. Now both resolve it: the string prices as its resolved plan does."""
    from autoshard.budget import price
    from autoshard.precision import resolve_precision

    config = [{"activation_checkpointing": False}]
    ((mixed, _),) = price(Small, batch(), ShardingIntent(), 1, config, precision="bf16-mixed")
    ((resolved, _),) = price(Small, batch(), ShardingIntent(), 1, config, precision=resolve_precision("bf16-mixed", ShardingIntent()))
    ((true, _),) = price(Small, batch(), ShardingIntent(), 1, config, precision="bf16-true")
    assert mixed == resolved and true < mixed  # bf16-true: parameters, gradients and moments in bf16
