"""On 2 real gloo processes under ``Fabric(strategy="auto-shard")``, against one process on the global batch (issue 39):
a ``PeftModel`` (LoRA on a tiny Hugging Face Llama) given straight to ``fabric.setup`` trains (item 1:
``PeftModel.forward`` calls ``base_model.model`` and never ``base_model``; the plan, from a forward traced on meta,
makes the module that runs the unit); a litgpt-shaped ``GPT`` with no example input keeps ``lm_head`` gathered after
forward once its first training forward has shown the order (item 2). One process pair runs all (imports dominate).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.harness import run_workers

pytest.importorskip("peft")
pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("peft_worker.py")
EXACT = 1e-5  # fp32 on 2 ranks against one process: reduction order only


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_workers(WORKER, ["--scenarios", "peft_model,peft_causal_lm,gpt_order"], tmp_path_factory.mktemp("peft"), nprocs=2, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", ["peft_model", "peft_causal_lm"])
def test_a_peft_model_set_up_in_fabric_trains_like_one_process(ranks: list[dict[str, Any]], scenario: str) -> None:
    """LoRA weights after three AdamW steps on 2 ranks equal one process on the global batch; the units are modules
    the forward calls, and the plan says its order came from a traced forward."""
    for rank in ranks:
        got = rank[scenario]
        assert got["same_names"]
        assert got["moved"] > 1e-3  # it trained
        assert got["vs_reference"] < EXACT, got
        assert got["forward_order"].startswith("traced: one forward of PeftModel"), got["forward_order"]
        # PeftModel skips its LoraModel ('base_model'): the model it calls is the unit; PeftModelForCausalLM calls it
        outer = "base_model.model" if scenario == "peft_model" else "base_model"
        assert got["units"] == ["base_model.model.model.layers.0", "base_model.model.model.layers.1", outer]
    if scenario == "peft_model":
        assert any("'base_model' while it never calls it" in n for n in ranks[0][scenario]["notes"]), ranks[0][scenario]["notes"]


@pytest.mark.timeout(300)
def test_the_first_training_forward_decides_what_stays_gathered_when_setup_had_no_input(ranks: list[dict[str, Any]]) -> None:
    """Registration order keeps ``transformer.ln_f`` at setup; from the second step ``lm_head``, which ends the forward,
    stays gathered after forward on both ranks, and the weights still equal one process on the global batch."""
    for rank in ranks:
        got = rank["gpt_order"]
        assert got["vs_reference"] < EXACT, got
        assert got["kept_at_setup"]["transformer.ln_f"] and not got["kept_at_setup"]["lm_head"]
        assert got["kept_after"] == {
            "transformer.h.0": False,
            "transformer.h.1": False,
            "transformer.wte": False,
            "transformer.ln_f": False,
            "lm_head": True,
        }
        first, *later = got["gathered_after_forward"]
        assert first == {"lm_head": False, "transformer.ln_f": True}
        assert all(step == {"lm_head": True, "transformer.ln_f": False} for step in later), got["gathered_after_forward"]
        assert got["forward_order"].startswith("registration order: GPT carries no example input")
        assert got["forward_order"].endswith("; the first training forward's order decides from the next forward on")
