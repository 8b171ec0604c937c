"""The capability matrix as data, and its rendering for the CLI and the docs."""

from __future__ import annotations

import pytest

from autoshard import Cell, Feature, Support, matrix, render_matrix
from autoshard.backends import BACKENDS, get_backend
from autoshard.backends.fsdp1 import REASON as FSDP1_REASON
from autoshard.backends.matrix import cell


def test_backends_in_preference_order_with_a_cell_for_every_feature():
    rows = matrix()
    assert list(rows) == ["fsdp2", "deepspeed_zero3", "fsdp1"]
    for row in rows.values():
        assert set(row) == set(Feature)
        assert all(isinstance(c, Cell) for c in row.values())


def test_every_answer_short_of_yes_says_why_and_what_to_do():
    for row in matrix().values():
        for c in row.values():
            if c.support is not Support.YES:
                assert c.reason and c.remedy


def test_fsdp1_is_rejected_everywhere_with_the_redirect_to_fsdp2():
    for c in matrix()["fsdp1"].values():
        assert c.support is Support.REJECTED and "strategy='fsdp2'" in c.remedy
    assert BACKENDS["fsdp1"].rejected and not BACKENDS["fsdp2"].rejected


def test_only_fsdp1_is_rejected():
    for name in ("fsdp2", "deepspeed_zero3"):
        assert Support.REJECTED not in {c.support for c in matrix()[name].values()}


def test_the_headline_cells():
    assert cell("fsdp2", Feature.EMA_TEACHER_STUDENT).support is Support.YES
    assert cell("deepspeed", Feature.EMA_TEACHER_STUDENT).support is Support.NO
    assert cell("zero3", Feature.MULTIPLE_OPTIMIZERS).support is Support.NO
    assert cell("fsdp2", Feature.NVME_OFFLOAD).support is Support.NO
    assert cell("deepspeed_zero3", Feature.NVME_OFFLOAD).support is Support.YES


def test_hybrid_sharding_row():
    """fsdp2 runs HSDP; DeepSpeed's MiCS / hpZ are not mapped yet, and the cell says so and redirects to fsdp2."""
    assert Feature.HYBRID_SHARDING.value == "hybrid sharding (HSDP)"
    assert cell("fsdp2", Feature.HYBRID_SHARDING).support is Support.YES
    ds = cell("deepspeed_zero3", Feature.HYBRID_SHARDING)
    assert ds.support is Support.NO and "mics_shard_size" in ds.reason and "zero_hpz_partition_size" in ds.reason
    assert "optimizer states stay sharded over every rank" in ds.reason and "strategy='fsdp2'" in ds.remedy
    assert cell("fsdp1", Feature.HYBRID_SHARDING).support is Support.REJECTED


def test_a_cell_short_of_yes_needs_reason_and_remedy():
    with pytest.raises(ValueError, match="a 'no' cell needs a reason and a remedy"):
        Cell(Support.NO, "because")
    assert Cell(Support.YES).reason == ""


def test_text_table():
    text = render_matrix()
    lines = text.splitlines()
    assert lines[0].split() == ["feature", "fsdp2", "deepspeed_zero3", "fsdp1"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert len(lines) == 2 + len(Feature)
    assert lines[2].split("  ")[0] == "multiple optimizers"
    assert lines[2].split()[-3:] == ["yes", "no", "rejected"]
    assert "NVMe offload" in text and "Notes" not in text


def test_markdown_table_for_the_docs():
    lines = render_matrix("markdown").splitlines()
    assert lines[0] == "| feature | fsdp2 | deepspeed_zero3 | fsdp1 |"
    assert lines[1] == "|---|---|---|---|"
    assert "| EMA teacher/student | yes | no | rejected |" in lines
    assert len(lines) == 2 + len(Feature)


@pytest.mark.parametrize("fmt", ["text", "markdown"])
def test_details_give_every_reason_and_remedy(fmt):
    text = render_matrix(fmt, details=True)
    flat = " ".join(text.split())  # the text form wraps long notes
    for row in matrix().values():
        for c in row.values():
            if c.support is not Support.YES:
                assert " ".join(c.reason.split()) in flat and " ".join(c.remedy.split()) in flat
    assert "Notes (every cell that is not 'yes'):" in text
    assert flat.count(" ".join(FSDP1_REASON.split())) == 1  # fsdp1: one note, not one per feature


def test_text_details_layout():
    text = render_matrix("text", details=True)
    assert "\nfsdp1 / every feature: rejected\n    FSDP1's flat-parameter training state machine" in text
    assert "\ndeepspeed_zero3 / EMA teacher/student: no\n    ZeRO-3 replaces every parameter" in text
    assert all(len(line) <= 100 for line in text.split("Notes")[1].splitlines())


def test_markdown_details_layout():
    text = render_matrix("markdown", details=True)
    assert (
        "- **fsdp2**, NVMe offload: *no*: FSDP2 can offload to CPU memory only. Fix: use offload_device='cpu', or"
        " strategy='autoshard-deepspeed' if the method has one optimizer and no EMA teacher."
    ) in text.splitlines()


def test_unknown_format():
    with pytest.raises(ValueError) as info:
        render_matrix("html")
    assert str(info.value) == "unknown format 'html': choose one of 'text', 'markdown', 'json'"


def test_get_backend_accepts_names_aliases_and_strategy_strings():
    assert get_backend("fsdp2").name == "fsdp2"
    for alias in ("deepspeed", "DeepSpeed-ZeRO3", "zero3", "autoshard-deepspeed", "deepspeed_stage_3"):
        assert get_backend(alias).name == "deepspeed_zero3"
    assert get_backend("fsdp").name == "fsdp1" and get_backend("FSDP1").name == "fsdp1"
