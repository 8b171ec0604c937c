"""What deciding a memory budget costs, per model size: ``python benchmarks/budget_decide_time.py [--sizes
2x128,4x256,8x512,12x768] [--seq 256] [--batch 4] [--json out.json]``.

For Hugging Face GPT-2 decoders of growing size (layers x width; 12x768 is GPT-2's 124M), at world size 8: the budget
is set halfway between the cheapest configuration's simulated peak and the most saving one's, so that the search
walks several configurations; reported are the seconds ``autoshard.budget.decide`` takes, the simulated steps it
ran, what it chose, and, next to it, one real training step of the same micro-batch in this process (forward,
backward, AdamW; no sharding) so that the decision can be compared with an epoch of such steps. One process, this
machine's threads; nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from autoshard.budget import DecideOptions, decide, describe_config, price  # noqa: E402
from autoshard.intent import ShardingIntent  # noqa: E402

WORLD, VOCAB = 8, 8192
CHEAPEST = {"reshard_after_forward": False, "activation_checkpointing": False, "offload": "none"}
MOST = {"reshard_after_forward": True, "activation_checkpointing": True, "offload": "params"}


def gpt(layers: int, width: int, seq: int) -> type[pl.LightningModule]:
    class GPT(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            from transformers import GPT2Config, GPT2LMHeadModel

            config = GPT2Config(n_layer=layers, n_embd=width, n_head=max(2, width // 64), vocab_size=VOCAB, n_positions=seq, use_cache=False)
            self.model = GPT2LMHeadModel(config)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return GPT


def real_step_seconds(factory: type[pl.LightningModule], batch: list[torch.Tensor], steps: int = 3) -> float:
    module = factory()
    optimizer = module.configure_optimizers()
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = module.training_step(batch, 0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--sizes", default="2x128,4x256,8x512,12x768")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--real-step-up-to", type=int, default=8 * 512, help="run a real step only for layers x width up to this")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    command = "python benchmarks/budget_decide_time.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"$ {command.strip()}\n")
    print(f"world size {WORLD}, micro-batch {args.batch} x {args.seq} tokens, bf16-mixed, AdamW; {torch.get_num_threads()} threads\n")
    print("| layers x width | parameters | budget (MiB) | decided in | simulated steps | chosen | one real step (unsharded, here) |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for size in args.sizes.split(","):
        layers, width = (int(v) for v in size.split("x"))
        factory = gpt(layers, width, args.seq)
        batch = [torch.randint(0, VOCAB, (args.batch, args.seq))]
        with torch.device("meta"):
            params = sum(p.numel() for p in factory().parameters())
        (cheap, _), (most, _) = price(factory, batch, ShardingIntent(), WORLD, [CHEAPEST, MOST])
        budget = (cheap + most) // 2
        progress: list[str] = []
        start = time.perf_counter()
        decision = decide(factory, batch, ShardingIntent(memory_budget=budget), WORLD, options=DecideOptions(progress=progress.append))
        seconds = time.perf_counter() - start
        step = real_step_seconds(factory, batch) if layers * width <= args.real_step_up_to else None
        rows.append(
            {
                "size": size,
                "parameters": params,
                "budget": budget,
                "seconds": seconds,
                "steps": len(progress),
                "chosen": decision.chosen,
                "real_step": step,
            }
        )
        shown = f"{step:.2f} s" if step is not None else "not run"
        print(
            f"| {size} | {params / 1e6:.1f} M | {budget / 2**20:.1f} | {seconds:.1f} s | {len(progress)} | {describe_config(decision.chosen)} | {shown} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
