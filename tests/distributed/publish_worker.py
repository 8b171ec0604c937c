"""Processes for the publish protocol's checks (tests/test_bad_inputs_writes.py).

- As a script: one rank of 2 (the harness's torchrun-style environment, gloo; the work directory is its cwd): rank
  0's failure during a save reaches the other rank with its own type and rank 0's traceback (row 47).
- ``save_at``: one of two independent training processes saving the same path at once (row 44), started with the
  ``spawn`` method (a fork of a process that ran torch ops hangs in FSDP2's setup).
- ``--deepspeed WORK``: one process, a real DeepSpeed ZeRO-3 engine on CPU under autoshard-deepspeed: save, resume
  a copy with one flipped byte, resume the intact one (rows 46, 48). Its own process: DeepSpeed keeps process-group
  state that a second engine in a process that destroyed its group trips over.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.distributed.harness import JOB_WORLD_SIZE, quiet_trainer, run_scenarios, worker_main


class Net(pl.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.body(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def scenario_rank0_failure() -> dict[str, Any]:
    """Save under a path whose parent is a file: only rank 0 touches the destination (its lock), so only rank 0
    fails; every rank must raise the same error."""
    blocker = Path.cwd() / "not-a-directory"
    if dist.get_rank() == 0:
        blocker.write_text("a file where the checkpoint directory should be")
    dist.barrier()
    trainer = quiet_trainer(strategy="fsdp2", max_steps=1)
    trainer.fit(Net(), DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
    try:
        trainer.save_checkpoint(blocker / "model.ckpt")
    except Exception as exc:
        return {
            "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "message": str(exc),
            "cause_type": type(exc.__cause__).__name__ if exc.__cause__ is not None else None,
            "cause": str(exc.__cause__) if exc.__cause__ is not None else None,
        }
    return {"type": None}


def save_at(barrier: Any, queue: Any, path: str, width: int) -> None:
    """Train one step (a model of its own: seeded by its port), wait for the other process, save ``path`` in the
    full-file format; report ("ok", the sum of its first weight) or the error. The report is flushed to the parent,
    then the process leaves as every worker does (``leave``: its process group destroyed, then ``os._exit``)."""
    from autoshard.lightning import FSDP2Strategy
    from tests.distributed.harness import QUIET, free_port, leave

    port = free_port()  # each process its own 1-rank process group
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        torch.manual_seed(port)
        trainer = pl.Trainer(strategy=FSDP2Strategy(checkpoint="full"), devices=1, max_steps=1, **QUIET)
        model = Net(width)
        trainer.fit(model, DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
        barrier.wait(60)
        trainer.save_checkpoint(path)
        queue.put(("ok", str(float(model.body[0].weight.detach().full_tensor().sum()))))
    except Exception as exc:
        barrier.abort()
        queue.put((type(exc).__name__, str(exc)))
    queue.close()
    queue.join_thread()  # the report is in the pipe before the process ends
    leave(0)


class RunsCode:
    """Unpickling it runs a shell command (``posix.system``): what a crafted checkpoint does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.system, (f"touch {self.marker}",))


def deepspeed_round(work: Path) -> dict[str, Any]:
    import json
    import shutil
    import warnings

    from tests.distributed.harness import QUIET

    def trainer(steps: int) -> pl.Trainer:
        return pl.Trainer(strategy="autoshard-deepspeed", devices=1, max_steps=steps, **QUIET)

    class Counting(Net):
        steps = 0

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            Counting.steps += 1
            return super().training_step(batch, batch_idx)

    def loader() -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)

    saved = work / "last.ckpt"
    first = trainer(1)
    first.fit(Counting(), loader())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first.save_checkpoint(saved)
    bad = work / "bad" / "last.ckpt"
    shutil.copytree(saved, bad)
    shard = sorted(bad.glob("checkpoint/*optim_states.pt"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40  # same size: only a checksum sees it
    shard.write_bytes(bytes(data))
    result: dict[str, Any] = {
        "save_warnings": [str(w.message) for w in caught if "autoshard" in str(w.message)],
        "listing": sorted(p.name for p in work.iterdir()),
        "manifest": json.loads((saved / "autoshard-manifest.json").read_text()),
        "flipped": str(shard),
    }
    Counting.steps = 0
    try:
        trainer(2).fit(Counting(), loader(), ckpt_path=bad)
        result["bad"] = {"type": None}
    except Exception as exc:
        result["bad"] = {"type": type(exc).__name__, "message": str(exc)}
    result["bad"]["steps"] = Counting.steps
    # A checkpoint whose pickle would run code (no manifest, as Lightning's own DeepSpeed saves): DeepSpeed reads
    # it with torch.load(weights_only=False), so the resume must refuse it without running anything.
    evil = work / "evil" / "last.ckpt"
    shutil.copytree(saved, evil)
    (evil / "autoshard-manifest.json").unlink()
    states = sorted(evil.glob("checkpoint/*model_states.pt"))[0]
    marker = work / "MARKER"
    torch.save({**torch.load(states, weights_only=False), "x": RunsCode(marker)}, states)
    Counting.steps = 0
    try:
        trainer(2).fit(Counting(), loader(), ckpt_path=evil)
        result["evil"] = {"type": None}
    except Exception as exc:
        result["evil"] = {"type": type(exc).__name__, "message": str(exc)}
    result["evil"].update(steps=Counting.steps, ran=marker.exists(), path=str(evil))
    Counting.steps = 0
    resumed = trainer(2)
    resumed.fit(Counting(), loader(), ckpt_path=saved)
    result["good"] = {"steps": Counting.steps, "global_step": resumed.global_step}
    return result


SCENARIOS = {"rank0_failure": scenario_rank0_failure}


if __name__ == "__main__":
    import json
    import sys

    if "--deepspeed" in sys.argv:
        work = Path(sys.argv[sys.argv.index("--deepspeed") + 1])
        worker_main(lambda: (work / "result.json").write_text(json.dumps(deepspeed_round(work / "ckpt"), indent=1)))
    else:
        assert JOB_WORLD_SIZE == 2, JOB_WORLD_SIZE
        run_scenarios(SCENARIOS)
