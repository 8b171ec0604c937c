"""``autoshard calibrate``: rates measured on this machine's device, written to a file the memory budget reads when
``AUTOSHARD_RATES`` names it. On CPU here (host copies and collectives keep their built-in values, and say so); on a
GPU ``make gpu-check`` runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autoshard.budget import RATES_ENV, Rates, decide, default_rates, read_rates
from autoshard.calibrate import CalibrateError, write_rates
from autoshard.cli import main
from autoshard.errors import IntentError
from autoshard.intent import ShardingIntent
from tests.test_budget_decide import Small, batch


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("rates") / "rates.json"
    import io
    from contextlib import redirect_stdout

    text = io.StringIO()
    with redirect_stdout(text):
        assert main(["calibrate", "--out", str(out), "--repeats", "1", "--json"]) == 0
    return out, json.loads(text.getvalue())


def test_calibrate_measures_the_rates_and_says_which_it_kept(calibrated: tuple[Path, dict]) -> None:
    out, printed = calibrated
    written = json.loads(out.read_text())
    assert printed["path"] == str(out) and written["rates"] == printed["rates"] and written["format"] == "autoshard-rates"
    measured = written["measured"]
    assert measured["True"]["flops"] > measured["False"]["flops"]  # recomputing every block adds its forward
    assert measured["selective"]["flops"] > measured["False"]["flops"]  # a Llama-shaped block recomputes some matmuls
    rates = written["rates"]
    assert all(v > 0 for v in rates.values()) and set(rates) == set(Rates().to_dict())
    assert "host_bytes_per_s" in written["kept"] and "no CUDA device" in written["kept"]["host_bytes_per_s"]
    assert rates["host_bytes_per_s"] == Rates().host_bytes_per_s  # kept: the built-in value, not a guess


def test_a_decision_prices_with_the_file_autoshard_rates_names(
    calibrated: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rates of the calibrated file's shape, set apart from the built-in ones here: what calibration measured on a busy
    machine may be within noise and keep them all (its ``kept`` says so), and this is about reading the file."""
    _, result = calibrated
    out = tmp_path / "rates.json"
    rates = {**result["rates"], "flops_per_s": 1e12, "selective_factor": 3.0}
    write_rates({**result, "rates": rates}, out)
    monkeypatch.setenv(RATES_ENV, str(out))
    assert default_rates() == read_rates(out) == Rates(**rates) != Rates()
    decision = decide(Small, batch(), ShardingIntent(memory_budget="1GiB"), 2)
    assert decision.rates == read_rates(out)
    monkeypatch.delenv(RATES_ENV)
    assert default_rates() == Rates()


def test_a_bad_rates_file_is_refused_naming_it_and_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "rates.json"
    bad.write_text('{"rates": {"flops_per_s": -1}}')
    monkeypatch.setenv(RATES_ENV, str(bad))
    with pytest.raises(
        IntentError, match=rf"the rates file '{bad}' \(named by AUTOSHARD_RATES\) has flops_per_s not a positive number\. Fix: autoshard calibrate"
    ):
        default_rates()
    bad.write_text("not json")
    with pytest.raises(
        IntentError, match=r"cannot read the rates file .*JSONDecodeError.*Fix: autoshard calibrate --out .* or unset AUTOSHARD_RATES"
    ):
        decide(Small, batch(), ShardingIntent(memory_budget="1GiB"), 2)


def test_calibrate_replaces_only_its_own_file(calibrated: tuple[Path, dict], tmp_path: Path) -> None:
    out, result = calibrated
    write_rates(result, out)  # its own: replaced
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    with pytest.raises(CalibrateError, match=r"refusing to write .*notes.json.*did not write.*Fix: --out a new path"):
        write_rates(result, notes)
    assert json.loads(notes.read_text()) == {"mine": 1}
    with pytest.raises(CalibrateError, match="it is a directory"):
        write_rates(result, tmp_path)
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


@pytest.mark.gpu
def test_calibrate_on_cuda_measures_host_copies(tmp_path: Path) -> None:
    from autoshard.calibrate import calibrate

    result = calibrate()
    assert result["device"] == torch.cuda.get_device_name() and "host_bytes_per_s" not in result["kept"]
    assert result["rates"]["flops_per_s"] > 1e12 and result["rates"]["host_bytes_per_s"] > 1e9
