"""When hybrid sharding pays off, from autoshard's own estimator: ``python benchmarks/hsdp_payoff.py``.

A TinyLlama-shaped model (1.1B parameters, Hugging Face LlamaConfig, built on the meta device: no memory) under
bf16-mixed and AdamW, 8 devices per node, pure FSDP vs ``shard_size='node'``: model states per rank, and the bytes
each rank sends per step within a node and across nodes (ring collectives). The seconds are those bytes over a
stated link speed, a floor that ignores latency and overlap with compute: they show the ratio, not a step time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

NVLINK = 450e9  # bytes/s per GPU within a node (H100 NVLink, one direction)
NETWORK = 50e9  # bytes/s per GPU across nodes (400 Gb/s InfiniBand per GPU)


def tiny_llama() -> object:
    import lightning.pytorch as pl
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(
                LlamaConfig(
                    vocab_size=32000,
                    hidden_size=2048,
                    intermediate_size=5632,
                    num_hidden_layers=22,
                    num_attention_heads=32,
                    num_key_value_heads=4,
                    tie_word_embeddings=False,
                )
            )

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Model()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--world-sizes", default="16,64,256")
    parser.add_argument("--devices-per-node", type=int, default=8)
    args = parser.parse_args()
    from autoshard.intent import ShardingIntent
    from autoshard.memory import EstimateOptions, estimate_memory_many, fmt_bytes
    from autoshard.target import build_on_meta

    module = build_on_meta(tiny_llama).module
    sizes = [int(s) for s in args.world_sizes.split(",")]
    print(
        f"TinyLlama shape, {sum(p.numel() for p in module.parameters()) / 1e9:.2f}B parameters, bf16-mixed, AdamW, "
        f"{args.devices_per_node} devices per node; seconds at {NVLINK / 1e9:.0f} GB/s in a node, {NETWORK / 1e9:.0f} GB/s across"
    )
    print("| world | sharding | states per rank | sent in a node | sent across nodes | comm floor (s) |")
    print("|---|---|---|---|---|---|")
    for shard_size in (None, "node"):
        estimates = estimate_memory_many(
            module, ShardingIntent(shard_size=shard_size), world_sizes=sizes, options=EstimateOptions(devices_per_node=args.devices_per_node)
        )
        for e in estimates:
            seconds = e.intra_node_bytes / NVLINK + e.inter_node_bytes / NETWORK
            name = "pure FSDP" if shard_size is None else f"HSDP {e.shard_group} x {e.world_size // e.shard_group}"
            print(
                f"| {e.world_size} | {name} | {fmt_bytes(e.model_states)} | {fmt_bytes(e.intra_node_bytes)} | {fmt_bytes(e.inter_node_bytes)} | {seconds:.3f} |"
            )


if __name__ == "__main__":
    main()
