"""Peak RSS per rank when fine-tuning a pretrained model under fsdp2: ``ShardingIntent(init_from=...)`` on a meta-built
model (each rank reads only its own rows) against every rank loading the whole model (``from_pretrained``) first.

    python benchmarks/init_from_rss.py [--layers 8 --dim 768 --vocab 32000] [--json out.json]

The same GPT-2-shaped model, saved once by transformers' ``save_pretrained`` (safetensors), then two process pairs of
2 gloo ranks, one per mode (the high-water mark never goes down): Linux ``VmHWM`` at ``on_train_start`` (sharded,
loaded, optimizer built, no step taken), and after imports ("base"). Nothing asserts on it: it is a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = {
    "from_pretrained": "every rank: GPT2LMHeadModel.from_pretrained, then fsdp2",
    "init_from": "meta-built, ShardingIntent(init_from=...)",
}


def peak_rss_mib() -> float:
    """VmHWM: ru_maxrss survives exec, so a worker started by a large parent would report the parent's size."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def config(args: argparse.Namespace) -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=args.layers, n_embd=args.dim, n_head=args.dim // 64, vocab_size=args.vocab, n_positions=256, bos_token_id=0, eos_token_id=0
    )


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import GPT2LMHeadModel

    import autoshard  # noqa: F401  registers strategy="fsdp2"
    from autoshard._harness import write_result
    from autoshard.lightning import FSDP2Strategy

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    base = peak_rss_mib()
    seen: dict[str, float] = {}

    class LM(pl.LightningModule):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.model.parameters(), lr=1e-5)

    class AtTrainStart(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            seen.update(peak_rss_mib=peak_rss_mib(), setup_done_s=time.perf_counter())

    start = time.perf_counter()
    if args.mode == "init_from":
        with torch.device("meta"):
            model = GPT2LMHeadModel(config(args))
        strategy = FSDP2Strategy(init_from={"model": args.weights})
    else:
        model = GPT2LMHeadModel.from_pretrained(args.weights)
        strategy = FSDP2Strategy()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, precision="32-true", max_steps=1, callbacks=[AtTrainStart()],
        logger=False, enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
    )  # fmt: skip
    ids = torch.randint(0, args.vocab, (world, 16), generator=torch.Generator().manual_seed(0))
    trainer.fit(LM(model), DataLoader(TensorDataset(ids), batch_size=1))
    report = getattr(strategy, "init_report", None)
    write_result(args.out, rank, {
        "mode": args.mode, "base_rss_mib": base, "setup_peak_rss_mib": seen["peak_rss_mib"],
        "build_and_setup_s": seen["setup_done_s"] - start,
        "bytes_read_mib": report.bytes_read / 2**20 if report else None,
    })  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--json", default=None, help="also write the numbers here")
    parser.add_argument("--mode", choices=tuple(MODES), help=argparse.SUPPRESS)  # set for the worker processes
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        worker(args)
        return
    from transformers import GPT2LMHeadModel

    from autoshard._harness import run_workers

    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "gpt2"
        model = GPT2LMHeadModel(config(args))
        model.save_pretrained(weights)
        model_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        del model
        command = f"python benchmarks/init_from_rss.py --layers {args.layers} --dim {args.dim} --vocab {args.vocab}"
        print(f"command: {command}")
        results: dict[str, Any] = {"model_mib": model_mib, "command": command}
        for mode in MODES:
            t0 = time.perf_counter()
            shape = ["--layers", str(args.layers), "--dim", str(args.dim), "--vocab", str(args.vocab)]
            results[mode] = run_workers(Path(__file__), [*shape, "--mode", mode, "--weights", str(weights)], Path(tmp) / mode, 2, 600)
            results[mode + "_s"] = time.perf_counter() - t0
    print(
        f"setup peak RSS per rank, GPT-2 {args.layers} layers x {args.dim}, vocab {args.vocab}: {model_mib:.1f} MiB fp32, 2 ranks (VmHWM at on_train_start; base = after imports):"
    )
    for mode, label in MODES.items():
        for rank, r in enumerate(results[mode]):
            read = f"; read {r['bytes_read_mib']:.1f} MiB" if r["bytes_read_mib"] is not None else ""
            print(
                f"  {label:<56} rank {rank}: peak {r['setup_peak_rss_mib']:7.1f} MiB (base {r['base_rss_mib']:6.1f}, above base {r['setup_peak_rss_mib'] - r['base_rss_mib']:6.1f} MiB{read}; build+setup {r['build_and_setup_s']:.1f} s)"
            )
    for rank in range(2):
        new, old = results["init_from"][rank], results["from_pretrained"][rank]
        peak = new["setup_peak_rss_mib"] / old["setup_peak_rss_mib"]
        growth = (new["setup_peak_rss_mib"] - new["base_rss_mib"]) / (old["setup_peak_rss_mib"] - old["base_rss_mib"])
        results[f"rank{rank}_ratio"] = {"peak": peak, "growth": growth}
        print(f"  rank {rank}: init_from / from_pretrained peak RSS {peak:.3f}; above-base growth {growth:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
