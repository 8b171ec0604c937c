"""What a simulated (or measured) step reports: ``StepMemory``, the bytes of live tensors at its peak, by kind, and
FSDPMemTracker's categories grouped as reported."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# FSDPMemTracker's categories (torch.distributed._tools.fsdp2_mem_tracker._FSDPRefType values), grouped as reported.
MODEL_STATES = ("Sharded Param", "Sharded Grad", "OptState", "Buffer", "Inputs")
GATHERED = ("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter")
ACTIVATIONS = ("Activation", "Temp")


@dataclass(frozen=True)
class StepMemory:
    """Bytes of live tensors on one rank at the peak of one training step: ``peak = model_states + gathered +
    activations`` (the groups above). ``incomplete`` says why a ``forward_only`` peak, a lower bound, lacks the rest."""

    world_size: int
    rank: int
    peak: int
    activations: int
    gathered: int
    model_states: int
    at: str
    forward_only: bool
    notes: tuple[str, ...] = ()
    by_kind: tuple[tuple[str, int], ...] = ()
    precision: str = ""
    activation_checkpointing: bool | int | str = False  # as ShardingIntent spells it: False, True, k, 'selective'
    incomplete: str = ""  # forward_only: why the whole step did not run, with its Fix ("" when it did)
    flops: int = 0  # floating-point operations of one whole step (forward, recomputation, backward) on this rank

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["notes"] = list(self.notes)
        out["by_kind"] = dict(self.by_kind)
        return out
