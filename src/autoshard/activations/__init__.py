"""Activation memory of one training step, measured by running that step on fake tensors (no memory, no GPU).

``memory.py`` counts model states exactly from shapes alone; activations depend on what ``training_step`` does with
a batch, so here the step itself runs: the module is built on meta, sharded with the real FSDP2 plan (activation
checkpointing, ``reshard_after_forward``, MixedPrecisionPolicy, offload policy) on a fake process group of
``world_size`` ranks in this one process, materialized as fake CPU tensors, and one warm-up step then one measured
step run in Lightning's order (``training_step`` under autocast as its precision plugin runs it, zero_grad, backward,
optimizer step, then ``on_train_batch_end`` of the callbacks and the module; under manual optimization
``training_step`` is the step, with ``self.optimizers()`` and ``manual_backward`` served by a stand-in Trainer as in
fit), the measured one under torch's FSDPMemTracker, which sees every tensor storage created and freed. The peak is
the bytes of live tensors at the step's highest point on this rank. ``benchmarks/activation_accuracy.py`` compares
it with real 2-rank runs.

Not modelled: the CUDA caching allocator (block rounding, fragmentation, reserved-but-free memory), CUDA/cuBLAS/NCCL
workspaces and the CUDA context, and tensors created outside torch's dispatcher. The figures are tensor bytes, the
quantity ``torch.cuda.max_memory_allocated`` approaches from below; leave headroom for the rest.

The step's FLOPs (torch's FlopCounterMode, counted in the warm-up step) price activation checkpointing for
``autoshard.budget``: its recomputation is the FLOPs it adds. Beside a live process group the fake one runs in
this process too, the live registry parked meanwhile (``fake_world``): no child process, so CUDA keeps working.

It leans on private torch members (FSDPMemTracker's hooks, the "fake" process group): tests/test_torch_compat.py
lists each, with what it is for, so a torch upgrade that moves one fails there by name.

One module per concern, bottom to top (the import-linter contract in pyproject.toml keeps this order):

- ``step_memory``: ``StepMemory``, what a step reports, and the tracker's categories;
- ``failures``: an exception raised under fake tensors, in words;
- ``tracker`` (torch's FSDPMemTracker for a LightningModule, ``measuring_callback``), ``batch`` (``load_batch``,
  ``call_batch``, ``describe_batch``), ``world`` (the fake process group, the parked live registry, the mesh) and
  ``stand_in`` (the stand-in Trainer of a manual-optimization step);
- ``prepare``: the module built on meta, made fake and sharded, its optimizers and the batch;
- ``step``: ``measure_step``, the step itself.
"""

from __future__ import annotations

from autoshard.activations.batch import call_batch, describe_batch, load_batch, where_defined
from autoshard.activations.step import measure_step
from autoshard.activations.step_memory import ACTIVATIONS, GATHERED, MODEL_STATES, StepMemory
from autoshard.activations.tracker import measuring_callback, step_tracker
from autoshard.activations.world import fake_world, in_detached_world

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
    "step_tracker",
    "where_defined",
]
