"""Activation memory of one training step, measured by running that step on fake tensors (no memory, no GPU).

Model states follow from shapes (``memory.py``); activations depend on what ``training_step`` does with a batch, so
the step itself runs: built on meta, sharded with the real FSDP2 plan on a fake process group of ``world_size``
ranks in this process, as fake CPU tensors; a warm-up step, then one measured under torch's FSDPMemTracker, in
Lightning's order. ``benchmarks/activation_accuracy.py`` compares it with real 2-rank runs.

The figures are tensor bytes, what ``torch.cuda.max_memory_allocated`` approaches from below: the caching
allocator, CUDA/NCCL workspaces and the CUDA context are not modelled. The warm-up step's FLOPs price activation
checkpointing for ``autoshard.budget``. One module per concern (docs/architecture.md), in the order of the
import-linter contract in pyproject.toml.
"""

from __future__ import annotations

from autoshard.activations.batch import call_batch, describe_batch, load_batch, where_defined
from autoshard.activations.step import measure_step
from autoshard.activations.step_memory import ACTIVATIONS, GATHERED, MODEL_STATES, StepMemory
from autoshard.activations.tracker import measuring_callback, step_tracker
from autoshard.activations.world import fake_world, in_detached_world, settle_autograd_engine

__all__ = [
    "ACTIVATIONS",
    "GATHERED",
    "MODEL_STATES",
    "StepMemory",
    "call_batch",
    "describe_batch",
    "fake_world",
    "in_detached_world",
    "load_batch",
    "measure_step",
    "measuring_callback",
    "settle_autograd_engine",
    "step_tracker",
    "where_defined",
]
