"""One rank of the checkpoint-conversion checks; launched by tests/distributed/test_convert.py through the harness.

Three invocations share one work directory, in the order the files need:
  1. 2 ranks: ``deepspeed_run`` trains 2 epochs on DeepSpeed ZeRO-3 (CPU), saves epoch 0 and converts it to DCP;
     ``init_from`` loads a tiny GPT-2 saved by transformers into fsdp2 shards, in every supported file layout.
  2. 1 rank: ``to_fsdp2`` resumes the converted DeepSpeed checkpoint on fsdp2; ``fsdp2_run`` trains the same run on
     fsdp2, saves epoch 0 and converts it to DeepSpeed for 2 ranks.
  3. 2 ranks: ``to_deepspeed`` resumes that on DeepSpeed.
Every state is captured in full on every rank (collectives), so ranks are compared too. Results are JSON numbers.
"""

from __future__ import annotations

import os
import resource
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a worker process; never when a test module imports from it (collection)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import autoshard  # noqa: F401  registers strategy="fsdp2"
from tests.distributed.harness import JOB_WORLD_SIZE, quiet_trainer, run_scenarios

RANK = int(os.environ["RANK"])
WORLD = JOB_WORLD_SIZE
WORK = Path(os.environ["CONVERT_WORK"])
PG_TIMEOUT = timedelta(seconds=90)
IN, GLOBAL_BATCH, STEPS_PER_EPOCH, EPOCHS, CLIP = 16, 8, 4, 2, 1.0


class Regressor(pl.LightningModule):
    """Odd parameter sizes (ZeRO pads the last rank's slice), a buffer, AdamW with a per-step LR schedule."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(IN, 33), nn.Tanh(), nn.Linear(33, 7))
        self.head = nn.Linear(7, 1)
        self.body.register_buffer("centre", torch.randn(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x) - self.body.centre))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=2e-2, weight_decay=0.01)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5), "interval": "step"}}


def loader() -> DataLoader:
    """The same global batches at any world size: rank r reads samples r::WORLD, GLOBAL_BATCH / WORLD at a time."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH * STEPS_PER_EPOCH, IN, generator=g)
    y = torch.sin(x[:, :1] * 3) + x[:, 1:2]
    return DataLoader(TensorDataset(x[RANK::WORLD], y[RANK::WORLD]), batch_size=GLOBAL_BATCH // WORLD)


def deepspeed_strategy() -> Any:
    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

    # threshold 0: every parameter really partitioned (the default keeps parameters below 100k elements whole)
    return AutoShardDeepSpeedStrategy({"precision": "32-true"}, zero_overrides={"stage3_param_persistence_threshold": 0}, timeout=PG_TIMEOUT)


def full_state(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    """Weights (fp32 master under DeepSpeed), each parameter's AdamW state, buffers, counters; collective."""
    out: dict[str, Any] = {"global_step": trainer.global_step, "epoch": trainer.current_epoch}
    optimizer = trainer.optimizers[0]
    out["lr"] = optimizer.param_groups[0]["lr"]
    out["scheduler_last_epoch"] = trainer.lr_scheduler_configs[0].scheduler.last_epoch
    for name, b in module.named_buffers():
        out[f"buffer/{name}"] = b.detach().clone()
    if hasattr(trainer.strategy, "deepspeed_engine"):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        engine = trainer.strategy.deepspeed_engine
        base = engine.optimizer.optimizer
        step = next((s["step"] for s in base.state.values() if "step" in s), None)
        for name, p in module.named_parameters():
            out[f"param/{name}"] = safe_get_full_fp32_param(p).detach().clone()
            if step is None:  # before the first step there is no optimizer state yet
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).detach().clone()
            out[f"step/{name}"] = float(step)
        return out
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    for name, p in module.named_parameters():
        out[f"param/{name}"] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    if optimizer.state:  # a fresh optimizer would be initialised (with a step) by get_optimizer_state_dict
        state = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True))["state"]
        for name, entry in state.items():
            for key, value in entry.items():
                value = value.full_tensor() if isinstance(value, DTensor) else value
                out[f"{key}/{name}"] = float(value) if key == "step" else value.detach().clone()
    return out


class Capture(pl.Callback):
    def __init__(self) -> None:
        self.start: dict[str, Any] = {}
        self.epochs: list[dict[str, Any]] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.start = full_state(trainer, pl_module)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.epochs.append(full_state(trainer, pl_module))


def fit(strategy: Any, ckpt_path: str | None = None, save_to: Path | None = None) -> tuple[Capture, float]:
    t0 = time.perf_counter()
    capture = Capture()
    callbacks: list[Any] = [capture]
    if save_to is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_to, every_n_epochs=1, save_top_k=-1, filename="{epoch}-{step}"))
    trainer = quiet_trainer(
        strategy=strategy,
        precision="32-true",
        max_epochs=EPOCHS,
        gradient_clip_val=CLIP,  # explicit: DeepSpeed 0.19.8 clips at 1.0 when the config leaves it out
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        enable_checkpointing=save_to is not None,
    )
    trainer.fit(Regressor(), loader(), ckpt_path=ckpt_path)
    return capture, time.perf_counter() - t0


def compare(
    a: dict[str, Any], b: dict[str, Any], prefixes: tuple[str, ...] = ("param/", "exp_avg/", "exp_avg_sq/", "step/", "buffer/")
) -> dict[str, Any]:
    """Per kind: how many entries, how many differ at all, the largest absolute difference."""
    out: dict[str, Any] = {"missing": sorted(set(k for k in a if k.startswith(prefixes)) ^ set(k for k in b if k.startswith(prefixes)))}
    for prefix in prefixes:
        keys = sorted(k for k in a if k.startswith(prefix) and k in b)
        diffs = []
        for k in keys:
            x, y = a[k], b[k]
            if isinstance(x, torch.Tensor):
                diffs.append(float((x.double() - y.double()).abs().max()) if x.shape == y.shape else float("inf"))
            else:
                diffs.append(abs(float(x) - float(y)))
        out[prefix.rstrip("/")] = {"n": len(keys), "unequal": sum(d != 0 for d in diffs), "max_diff": max(diffs, default=0.0)}
    for key in ("global_step", "epoch", "lr", "scheduler_last_epoch"):
        out[key] = [a.get(key), b.get(key)]
    return out


def agree(state: dict[str, Any]) -> bool:
    """Every rank captured the same full state."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {k: v for k, v in state.items()})
    first = gathered[0]
    return all(compare(first, other)["param"]["unequal"] == 0 and not compare(first, other)["missing"] for other in gathered[1:])


def on_rank0(fn: Any) -> Any:
    result = fn() if RANK == 0 else None
    dist.barrier()
    return result


def convert_on_rank0(src: Path, dst: Path, to: str, **kwargs: Any) -> dict[str, Any]:
    from autoshard.convert import ConvertOptions, convert

    def run() -> dict[str, Any]:
        return convert(src, dst, to, ConvertOptions(**kwargs)).to_json()

    result = on_rank0(run)
    out: list[Any] = [result]
    dist.broadcast_object_list(out, src=0)
    return out[0]


# -- scenarios: DeepSpeed <-> fsdp2 -------------------------------------------------------------------------------------
def scenario_deepspeed_run() -> dict[str, Any]:
    """2 epochs on DeepSpeed (2 ranks) saving epoch 0; the epoch-0 engine state and the final one are kept."""
    capture, seconds = fit(deepspeed_strategy(), save_to=WORK / "ds")
    on_rank0(lambda: torch.save({"epoch0": capture.epochs[0], "final": capture.epochs[-1]}, WORK / "ds_ref.pt"))
    t0 = time.perf_counter()
    converted = convert_on_rank0(WORK / "ds" / "epoch=0-step=4.ckpt", WORK / "ds_to_dcp", "dcp")
    return {
        "seconds_fit": seconds,
        "seconds_convert": time.perf_counter() - t0,
        "converted": converted,
        "ranks_agree": agree(capture.epochs[-1]),
        "steps": capture.epochs[-1]["global_step"],
    }


def scenario_to_fsdp2() -> dict[str, Any]:
    """The converted DeepSpeed checkpoint resumed on fsdp2 at another world size."""
    ref = torch.load(WORK / "ds_ref.pt", weights_only=False)
    capture, seconds = fit("fsdp2", ckpt_path=str(WORK / "ds_to_dcp"))
    return {
        "loaded_vs_deepspeed": compare(ref["epoch0"], capture.start),
        "final_vs_uninterrupted": compare(ref["final"], capture.epochs[-1]),
        "seconds": seconds,
        "world_size": WORLD,
    }


def scenario_fsdp2_run() -> dict[str, Any]:
    """The same run on fsdp2 at this world size, saving epoch 0, converted to DeepSpeed for 2 ranks."""
    capture, seconds = fit("fsdp2", save_to=WORK / "fs")
    on_rank0(lambda: torch.save({"epoch0": capture.epochs[0], "final": capture.epochs[-1]}, WORK / "fs_ref.pt"))
    t0 = time.perf_counter()
    converted = convert_on_rank0(WORK / "fs" / "epoch=0-step=4.ckpt", WORK / "fs_to_ds", "deepspeed", world_size=2, precision="32-true")
    return {"seconds_fit": seconds, "seconds_convert": time.perf_counter() - t0, "converted": converted}


def scenario_to_deepspeed() -> dict[str, Any]:
    """The converted fsdp2 checkpoint resumed on DeepSpeed ZeRO-3 (2 ranks): loaded state, then the next steps."""
    ref = torch.load(WORK / "fs_ref.pt", weights_only=False)
    capture, seconds = fit(deepspeed_strategy(), ckpt_path=str(WORK / "fs_to_ds"))
    return {
        "loaded_vs_fsdp2": compare(ref["epoch0"], capture.start),
        "final_vs_uninterrupted": compare(ref["final"], capture.epochs[-1]),
        "ranks_agree": agree(capture.epochs[-1]),
        "seconds": seconds,
        "world_size": WORLD,
    }


# -- scenarios: pretrained weights into shards -----------------------------------------------------------------------------
def gpt2_config(n_embd: int = 32) -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=n_embd, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0)


class Pretrained(pl.LightningModule):
    """A GPT-2 built on the meta device (nothing allocated), optionally with an EMA teacher."""

    def __init__(self, n_embd: int = 32, teacher: bool = False) -> None:
        super().__init__()
        from transformers import GPT2LMHeadModel

        with torch.device("meta"):
            self.student = GPT2LMHeadModel(gpt2_config(n_embd))
            if teacher:
                self.teacher = GPT2LMHeadModel(gpt2_config(n_embd)).requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.student(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.student.parameters(), lr=1e-3)


class LoadedState(pl.Callback):
    """Right after setup (and init_from), before any step: the full weights, on every rank."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.weights = {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in pl_module.named_parameters(remove_duplicate=False)
        }
        self.sharded = sum(isinstance(p, DTensor) for p in pl_module.parameters())
        self.tied = pl_module.student.lm_head.weight is pl_module.student.transformer.wte.weight


def write_pretrained() -> dict[str, Any]:
    """Rank 0: a seeded GPT-2 saved by transformers (sharded with an index), and as one safetensors file, a torch file
    and a DCP directory; returns the reference weights' names."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save
    from transformers import GPT2LMHeadModel

    torch.manual_seed(123)
    model = GPT2LMHeadModel(gpt2_config())
    model.save_pretrained(WORK / "gpt2-sharded", max_shard_size="40KB")  # several files + model.safetensors.index.json
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    torch.save(sd, WORK / "gpt2-reference.pt")  # every name, lm_head.weight included (tied: equal to wte)
    save_file({k: v for k, v in sd.items() if k != "lm_head.weight"}, str(WORK / "gpt2.safetensors"))
    torch.save({"state_dict": sd}, WORK / "gpt2-lightning.ckpt")  # a torch file with the weights under state_dict
    dcp_save({"state_dict": {k: v.clone() for k, v in sd.items()}}, storage_writer=FileSystemWriter(str(WORK / "gpt2-dcp")), no_dist=True)
    return {"files": sorted(p.name for p in (WORK / "gpt2-sharded").iterdir())}


def load_pretrained(init_from: Any, teacher: bool = False, n_embd: int = 32) -> dict[str, Any]:
    from autoshard.lightning import FSDP2Strategy

    t0 = time.perf_counter()
    reference = torch.load(WORK / "gpt2-reference.pt", weights_only=True)
    loaded = LoadedState()
    strategy = FSDP2Strategy(init_from=init_from)
    trainer = quiet_trainer(strategy=strategy, precision="32-true", max_steps=1, callbacks=[loaded], num_sanity_val_steps=0)
    ids = torch.randint(0, 100, (8, 16), generator=torch.Generator().manual_seed(0))
    out: dict[str, Any] = {"error": None}
    try:
        trainer.fit(Pretrained(n_embd, teacher), DataLoader(TensorDataset(ids), batch_size=4))
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        out.update(error=type(exc).__name__, message=str(exc), seconds=time.perf_counter() - t0)
        return out
    report = strategy.init_report
    mismatched = []
    for name, value in loaded.weights.items():
        key = name.split(".", 1)[1]
        if not torch.equal(value, reference[key]):
            mismatched.append(name)
    model_bytes = sum(v.numel() * v.element_size() for k, v in reference.items() if k != "lm_head.weight")
    out.update(
        compared=len(loaded.weights),
        mismatched=mismatched,
        tied=loaded.tied,
        sharded_params=loaded.sharded,
        bytes_read=report.bytes_read if report else None,
        bytes_total=report.bytes_total if report else None,
        io_bytes=report.io_bytes if report else None,
        model_bytes=model_bytes,
        copied_teachers=list(report.copied_teachers) if report else None,
        ranks_agree=agree({f"param/{k}": v for k, v in loaded.weights.items()}),
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        seconds=time.perf_counter() - t0,
    )
    return out


def scenario_init_from() -> dict[str, Any]:
    written = on_rank0(write_pretrained)
    return {
        "written": written,
        "hf_sharded_dir": load_pretrained({"student": str(WORK / "gpt2-sharded")}),
        "safetensors_file": load_pretrained({"student": str(WORK / "gpt2.safetensors")}),
        "torch_file": load_pretrained({"student": str(WORK / "gpt2-lightning.ckpt")}),
        "dcp_dir": load_pretrained({"student": str(WORK / "gpt2-dcp")}),
        "ema_teacher": load_pretrained({"student": str(WORK / "gpt2-sharded")}, teacher=True),
        "wrong_prefix": load_pretrained(str(WORK / "gpt2-sharded")),
        "other_shapes": load_pretrained({"student": str(WORK / "gpt2-sharded")}, n_embd=48),
    }


SCENARIOS = {
    "deepspeed_run": scenario_deepspeed_run,
    "init_from": scenario_init_from,
    "to_fsdp2": scenario_to_fsdp2,
    "fsdp2_run": scenario_fsdp2_run,
    "to_deepspeed": scenario_to_deepspeed,
}


if __name__ == "__main__":
    run_scenarios(SCENARIOS)
