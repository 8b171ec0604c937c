"""One rank of the checkpoint checks: resume exactness, resharding, full-file format, a save killed midway, resuming
from another model's checkpoint or from a corrupted one.

Launched by tests/distributed/test_checkpoints.py through the harness; several Trainers run in a row per process
group. Scenarios share a work directory across invocations (a checkpoint saved at 1 rank is loaded at 2, and back).
Results are written after every scenario, so a scenario that kills its own process still reports what came before.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import autoshard  # noqa: F401  registers strategy="fsdp2"
from autoshard.demo import Blobs, DinoLike, OnlineProbe
from autoshard.errors import AutoShardError
from autoshard.lightning import FSDP2Strategy
from tests.distributed.harness import quiet_trainer, worker_main, write_result

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
BATCH, SAMPLES = 8, 64  # 2 ranks: 4 steps per epoch; 1 rank: 8


class StatefulProbe(OnlineProbe):
    """The demo's probe with momentum: its optimizer has state that Lightning alone would not checkpoint."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self.optimizer = torch.optim.SGD(pl_module.probe.parameters(), lr=self.lr, momentum=0.9)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def flat_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, prefix: str) -> dict[str, Any]:
    """Full (unsharded) optimizer state keyed by parameter name; collective."""
    state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    out: dict[str, Any] = {}
    for name, entry in state["state"].items():
        for key, value in entry.items():
            out[f"{prefix}/{name}/{key}"] = full(value).clone() if isinstance(value, torch.Tensor) else value
    for i, group in enumerate(state["param_groups"]):
        for key, value in group.items():
            if key != "params":
                out[f"{prefix}/group{i}/{key}"] = value
    return out


def full_state(trainer: pl.Trainer, model: pl.LightningModule, probe: OnlineProbe | None) -> dict[str, Any]:
    """Everything a resume must bring back, unsharded: weights (student, EMA teacher, probe), every optimizer, counters."""
    state: dict[str, Any] = {f"param/{n}": full(p.detach()).clone() for n, p in model.named_parameters()}
    # An optimizer that has not stepped is skipped: torch's get_optimizer_state_dict would initialise it with a step.
    if trainer.optimizers[0].state:
        state.update(flat_optimizer(model, trainer.optimizers[0], "optimizer"))
    if probe is not None and probe.optimizer is not None and probe.optimizer.state:
        state.update(flat_optimizer(model, probe.optimizer, "probe_optimizer"))
    state["global_step"] = trainer.global_step
    return state


def compare(a: dict[str, Any], b: dict[str, Any], ignore: tuple[str, ...] = ()) -> dict[str, Any]:
    """Exact comparison (torch.equal); the max abs diff says by how much when it is not."""
    mismatched, max_diff = [], 0.0
    keys = (set(a) | set(b)) - set(ignore)
    if "next_epoch" not in a or "next_epoch" not in b:  # only start / epoch-end captures know where the loop resumes
        keys.discard("next_epoch")
    for key in sorted(keys):
        x, y = a.get(key), b.get(key)
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or not torch.equal(x, y):
                mismatched.append(key)
                if x.shape == y.shape:
                    max_diff = max(max_diff, float((x.double() - y.double()).abs().max()))
        elif _plain(x) != _plain(y):
            mismatched.append(key)
    return {"equal": not mismatched, "mismatched": mismatched[:10], "max_diff": max_diff, "compared": len(keys)}


def _plain(value: Any) -> Any:
    """Optimizer hyper-parameters come back as lists where they were saved as tuples (betas): same values."""
    return list(value) if isinstance(value, tuple) else value


def weights_report(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    params = [k for k in after if k.startswith("param/")]
    changed = [k for k in params if not torch.equal(before[k], after[k])]
    return {"changed": len(changed), "total": len(params), "finite": all(bool(torch.isfinite(after[k]).all()) for k in params)}


class Capture(pl.Callback):
    """Full state right after restore (on_train_start) and at each epoch end; collective, so every rank runs it."""

    def __init__(self, probe: OnlineProbe | None, at_steps: tuple[int, ...] = ()) -> None:
        self.probe, self.at_steps = probe, at_steps
        self.start: dict[str, Any] = {}
        self.epochs: list[dict[str, Any]] = []
        self.steps: dict[int, dict[str, Any]] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.start = {**full_state(trainer, pl_module, self.probe), "next_epoch": trainer.current_epoch}

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.epochs.append({**full_state(trainer, pl_module, self.probe), "next_epoch": trainer.current_epoch + 1})

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.global_step in self.at_steps:
            self.steps[trainer.global_step] = full_state(trainer, pl_module, self.probe)


def make_trainer(strategy: Any = "fsdp2", callbacks: list[Any] | None = None, **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = dict(
        strategy=strategy,
        precision="32-true",
        max_epochs=2,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks or []),
        num_sanity_val_steps=0,
    )
    return quiet_trainer(callbacks=callbacks or [], **{**options, **kwargs})


def loader() -> DataLoader:
    return DataLoader(Blobs(n=SAMPLES), batch_size=BATCH, shuffle=False)


def run(ckpt_path: str | None = None, strategy: Any = "fsdp2", extra: list[Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    """One seeded fit of the DINO-like EMA method with a stateful probe; returns the states it captured."""
    pl.seed_everything(0, verbose=False)
    model, probe = DinoLike(), StatefulProbe()
    capture = Capture(probe, kwargs.pop("at_steps", ()))
    t = make_trainer(strategy, [probe, capture, *(extra or [])], **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(model, loader(), ckpt_path=ckpt_path)
    final = full_state(t, model, probe)
    return {
        "start": capture.start,
        "epochs": capture.epochs,
        "steps": capture.steps,
        "final": final,
        "weights": weights_report(capture.start, final),  # from after setup (and restore) to the end
        "warnings": [str(w.message) for w in caught if "autoshard" in str(w.message)],
        "global_step": t.global_step,
    }


def save_reference(state: dict[str, Any], path: Path) -> None:
    if RANK == 0:
        torch.save(state, path)
    dist.barrier()


def every_epoch(dirpath: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=dirpath, every_n_epochs=1, save_top_k=-1, filename="{epoch}-{step}")


# -- scenarios ---------------------------------------------------------------------------------------------------
def scenario_save_1rank(work: Path) -> dict[str, Any]:
    """At 1 rank: one epoch, checkpoint at its end, and the exact state saved next to it for the 2-rank load."""
    out = run(extra=[every_epoch(work / "w1")], max_epochs=1)
    save_reference(out["epochs"][0], work / "w1_ref.pt")
    return {"weights": out["weights"], "ckpts": sorted(p.name for p in (work / "w1").iterdir())}


def scenario_resume(work: Path) -> dict[str, Any]:
    """Two epochs uninterrupted (saving at each epoch end) vs resumed from the epoch-0 checkpoint: bit for bit."""
    t0 = time.perf_counter()
    reference = run(extra=[every_epoch(work / "w2")])
    t1 = time.perf_counter()
    ckpt = work / "w2" / "epoch=0-step=4.ckpt"
    save_reference(reference["epochs"][0], work / "w2_ref.pt")
    resumed = run(ckpt_path=str(ckpt))
    t2 = time.perf_counter()
    return {
        "loaded_equals_saved": compare(reference["epochs"][0], resumed["start"]),
        "final_equals_uninterrupted": compare(reference["final"], resumed["final"]),
        "probe_momentum_keys": sorted(k for k in resumed["start"] if k.startswith("probe_optimizer/") and "momentum" in k),
        "steps": [reference["global_step"], resumed["global_step"]],
        "weights": [reference["weights"], resumed["weights"]],
        "warnings": resumed["warnings"],
        "seconds": [t1 - t0, t2 - t1],
        "layout": sorted(p.name for p in ckpt.iterdir()),
    }


def scenario_load_1rank(work: Path) -> dict[str, Any]:
    """The checkpoint saved at 1 rank, resumed at 2: the loaded state equals the saved one, then it trains."""
    reference = torch.load(work / "w1_ref.pt", weights_only=True)
    resumed = run(ckpt_path=str(work / "w1" / "epoch=0-step=8.ckpt"))
    return {"loaded_equals_saved": compare(reference, resumed["start"]), "weights": resumed["weights"], "warnings": resumed["warnings"]}


def scenario_full_format(work: Path) -> dict[str, Any]:
    """checkpoint='full': one file written by rank 0 (tmp + os.replace); resuming from it is exact too."""
    strategy = lambda: FSDP2Strategy(intent={"checkpoint": "full"})  # noqa: E731
    first = run(strategy=strategy(), extra=[every_epoch(work / "wf")], max_epochs=1)
    ckpt = work / "wf" / "epoch=0-step=4.ckpt"
    resumed = run(ckpt_path=str(ckpt), strategy=strategy())
    reference = torch.load(work / "w2_ref.pt", weights_only=True)
    return {
        "is_file": ckpt.is_file(),
        "siblings": sorted(p.name for p in (work / "wf").iterdir()),
        "loaded_equals_saved": compare(first["epochs"][0], resumed["start"]),
        "same_as_distributed_format": compare(reference, resumed["start"]),
        "weights": [first["weights"], resumed["weights"]],
    }


def arm_kill(save_number: int, items: int) -> None:
    """SIGKILL this process during the ``save_number``-th DCP save, after ``items`` tensors reached its shard file."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    counter = {"saves": 0, "items": 0}
    write_data, write_item = dcp_fs._FileSystemWriter.write_data, dcp_fs._write_item

    def counting_write_data(self: Any, plan: Any, planner: Any) -> Any:
        counter["saves"] += 1
        counter["items"] = 0
        return write_data(self, plan, planner)

    def killing_write_item(*args: Any, **kwargs: Any) -> Any:
        result = write_item(*args, **kwargs)
        counter["items"] += 1
        if counter["saves"] == save_number and counter["items"] >= items:
            stream = args[1]
            stream.flush()
            os.fsync(stream.fileno())  # the partial shard is on disk, as a real crash leaves it
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    dcp_fs._FileSystemWriter.write_data = counting_write_data  # type: ignore[method-assign]
    dcp_fs._write_item = killing_write_item


def crash_saver(work: Path) -> ModelCheckpoint:
    """The same ModelCheckpoint before and after the crash, as a re-run of the same script has."""
    return ModelCheckpoint(dirpath=work / "wc", every_n_train_steps=2, save_top_k=-1, save_last=True, filename="{epoch}-{step}")


def scenario_crash(work: Path, results: dict[str, Any], out: str) -> dict[str, Any]:
    """Saves at steps 2 and 4 (top-k file, then last.ckpt each time); killed while writing last.ckpt at step 4."""
    pl.seed_everything(0, verbose=False)
    model, probe = DinoLike(), StatefulProbe()
    capture = Capture(probe, at_steps=(2, 4))
    saver = crash_saver(work)

    class BeforeSecondRound(pl.Callback):
        """After the step-2 saves: store the reference and arm the kill for the 4th save (last.ckpt at step 4)."""

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == 4 and 2 in capture.steps:
                save_reference(capture.steps[2], work / "wc_ref_step2.pt")
                save_reference(capture.steps[4], work / "wc_ref_step4.pt")
                results["crash"] = {
                    "armed_at_step": trainer.global_step,
                    "saved": sorted(p.name for p in (work / "wc").iterdir()),
                    "weights": weights_report(capture.start, capture.steps[4]),
                }
                write_result(out, RANK, results)
                arm_kill(save_number=2, items=1)  # counted from now: the step-4 top-k file, then last.ckpt

    # BeforeSecondRound runs before ModelCheckpoint (Lightning moves checkpoint callbacks last).
    t = make_trainer("fsdp2", [probe, capture, BeforeSecondRound(), saver], max_epochs=1, max_steps=4)
    t.fit(model, loader())
    return {"error": "the process should have been killed during the last save"}


def scenario_after_crash(work: Path) -> dict[str, Any]:
    """At 1 rank, a fresh process: fit(ckpt_path='last') after the crash resumes from the intact step-2 last.ckpt."""
    directory = work / "wc"
    before = sorted(p.name for p in directory.iterdir())
    reference = torch.load(work / "wc_ref_step2.pt", weights_only=True)
    resumed = run(ckpt_path="last", extra=[crash_saver(work)], max_epochs=1, max_steps=6)
    return {
        "before": before,
        "after": sorted(p.name for p in directory.iterdir()),
        "loaded_equals_step2": compare(reference, resumed["start"]),
        "global_step": resumed["global_step"],
        "weights": resumed["weights"],
        "warnings": resumed["warnings"],
    }


def scenario_load_2rank(work: Path) -> dict[str, Any]:
    """The 2-rank epoch-0 checkpoint, resumed at 1 rank: the loaded state equals the saved one, then it trains."""
    reference = torch.load(work / "w2_ref.pt", weights_only=True)
    resumed = run(ckpt_path=str(work / "w2" / "epoch=0-step=4.ckpt"), max_epochs=2, max_steps=7)
    return {
        # The epoch position is per-rank batches: 4 batches end an epoch at 2 ranks but are half of one at 1 rank.
        "loaded_equals_saved": compare(reference, resumed["start"], ignore=("next_epoch",)),
        "next_epoch": [reference["next_epoch"], resumed["start"]["next_epoch"]],
        "weights": resumed["weights"],
        "warnings": resumed["warnings"],
    }


def attempt(fn: Any) -> dict[str, Any]:
    """Run ``fn`` and report what it raised, BaseException included: torch's CheckpointException is one."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001  what escapes `except Exception` is the point of the check
        return {
            "type": type(exc).__name__,
            "message": str(exc)[:4000],
            "is_exception": isinstance(exc, Exception),
            "autoshard": isinstance(exc, AutoShardError),
        }
    return {"type": None}


def fresh_copy(source: Path, dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)  # the harness may rerun an invocation
    shutil.copytree(source, dest)


def flip_one_byte(ckpt: Path, shard: str) -> dict[str, Any]:
    """Change one byte in the middle of the largest tensor ``shard`` holds: same size, as bit rot or a bad copy
    leaves it. .metadata (offsets and lengths) is read to hit tensor bytes, not a header."""
    metadata = FileSystemReader(str(ckpt)).read_metadata()
    offset, length = max(((int(s.offset), int(s.length)) for s in metadata.storage_data.values() if s.relative_path == shard), key=lambda x: x[1])
    at = offset + length // 2
    with open(ckpt / shard, "r+b") as f:
        f.seek(at)
        before = f.read(1)[0]
        f.seek(at)
        f.write(bytes([before ^ 0x40]))
    return {"shard": shard, "offset": at, "size": (ckpt / shard).stat().st_size}


def scenario_corrupt(work: Path) -> dict[str, Any]:
    """A copy of the 2-rank checkpoint with one byte changed in rank 1's shard: every rank refuses to resume from it,
    naming the file. The same checkpoint without its manifest (as Lightning or an older autoshard wrote it) resumes,
    with one warning."""
    source = work / "w2" / "epoch=0-step=4.ckpt"
    bad, unverified = work / "corrupt" / source.name, work / "no_manifest" / source.name
    flipped: dict[str, Any] = {}
    if RANK == 0:
        fresh_copy(source, bad)
        flipped = flip_one_byte(bad, "__1_0.distcp")
        fresh_copy(source, unverified)
        (unverified / "autoshard-manifest.json").unlink(missing_ok=True)
    dist.barrier()
    refused = attempt(lambda: run(ckpt_path=str(bad)))
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer("fsdp2", [StatefulProbe()], max_epochs=1)  # epoch 0 is done: it loads, then stops
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(DinoLike(), loader(), ckpt_path=str(unverified))
    return {"flipped": flipped, "refused": refused, "unverified_warnings": [str(w.message) for w in caught if "autoshard" in str(w.message)]}


class AnotherModel(DinoLike):
    """Not the model that wrote w2: one more module, and no probe (w2 holds the probe's weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(32, 4)


def scenario_mismatch(work: Path) -> dict[str, Any]:
    """Another model resumed from the 2-rank checkpoint: each rank raises autoshard's error, an Exception."""
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer("fsdp2", [])
    return attempt(lambda: trainer.fit(AnotherModel(), loader(), ckpt_path=str(work / "w2" / "epoch=0-step=4.ckpt")))


SCENARIOS = {
    "save_1rank": scenario_save_1rank,
    "resume": scenario_resume,
    "load_1rank": scenario_load_1rank,
    "full_format": scenario_full_format,
    "mismatch": scenario_mismatch,
    "corrupt": scenario_corrupt,
    "crash": scenario_crash,
    "after_crash": scenario_after_crash,
    "load_2rank": scenario_load_2rank,
}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--scenarios", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    work = Path(args.work)
    results: dict[str, Any] = {}
    for name in args.scenarios.split(","):
        start = time.perf_counter()
        fn = SCENARIOS[name]
        results[name] = fn(work, results, args.out) if name == "crash" else fn(work)
        results[name]["scenario_seconds"] = time.perf_counter() - start
        write_result(args.out, RANK, results)


if __name__ == "__main__":
    worker_main(main)
