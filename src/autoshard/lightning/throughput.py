"""``autoshard.ThroughputMonitor``: Lightning's own ``ThroughputMonitor`` callback, with what it asks of the user
filled in, for any strategy (autoshard's fsdp2 and DeepSpeed strategies included).

FLOPs are counted by torch's ``FlopCounterMode`` on the fit's second training batch, on rank 0, as it really runs
(no extra call of any user hook). Not the first batch: a ``torch.compile``'d module first called under a dispatch
mode is never compiled (measured on torch 2.13). A counted batch that ran no backward (its ``training_step`` returned
None) is a forward only, about a third of a step: the next batch is counted instead, up to ``COUNT_TRIES`` of them,
then a warning says none was measured. Recomputation under activation checkpointing is counted (papers' MFU
leaves it out: pass ``flops_per_batch=``); under tensor parallelism DTensor matmuls count at full shape (too high by
up to the tensor-parallel size: a warning says so). The H200's peaks are its dense figures (``DENSE_PEAKS``):
Lightning lists with-sparsity ones, under names ``torch.cuda.get_device_name`` does not return. The metrics are
Lightning's plus ``step_time``, ``tflops_per_sec`` and ``tokens_per_sec`` (docs/guide.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import numbers
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch.callbacks import ThroughputMonitor as LightningThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from autoshard.errors import AutoShardError

if TYPE_CHECKING:
    import lightning.pytorch as pl

# Dense (no sparsity) peak FLOP/s per device from NVIDIA's datasheets, for chips Lightning's table misses or lists at
# their with-sparsity figures; keyed by a lower-case part of the device name, the most specific first.
DENSE_PEAKS: dict[str, dict[torch.dtype | str, float]] = {
    "h200 nvl": {torch.float64: 30e12, torch.float32: 60e12, "tfloat32": 417.5e12, torch.bfloat16: 835.5e12, torch.float16: 835.5e12},
    "h200": {torch.float64: 33.5e12, torch.float32: 66.9e12, "tfloat32": 494.7e12, torch.bfloat16: 989.4e12, torch.float16: 989.4e12},
}

# Training batches counted, from the second on, for one that ran a backward; then none is measured, with a warning.
COUNT_TRIES = 8


def _tensors(batch: Any) -> Any:
    """The tensors of a batch, depth first: tensors, mappings, sequences and dataclasses of them."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            yield from _tensors(getattr(batch, f.name))


def batch_size(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    first = next((t for t in _tensors(batch) if t.dim() > 0), None)
    if first is None:
        raise AutoShardError(
            f"ThroughputMonitor counts samples as the first dimension of the batch's first tensor, and this"
            f" {type(batch).__name__} holds no tensor with a dimension. Fix: ThroughputMonitor(batch_size_fn=lambda batch: ...)"
        )
    return int(first.shape[0])


def _token_ids(batch: Any) -> torch.Tensor | None:
    return next((t for t in _tensors(batch) if t.dim() >= 2 and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool), None)


def token_count(batch: Any) -> int:
    """Tokens in a batch: the element count of its first integer tensor with two or more dimensions (token ids,
    batch x sequence). A batch without one counts one per sample."""
    ids = _token_ids(batch)
    return int(ids.numel()) if ids is not None else batch_size(batch)


def compute_dtype(trainer: pl.Trainer) -> torch.dtype:
    """The dtype matmuls run in: an autoshard strategy's resolved precision, else the Trainer's precision string."""
    plan = getattr(trainer.strategy, "precision_plan", None)
    if plan is not None:
        return plan.compute.torch
    precision = str(trainer.precision)
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    if precision.startswith("64"):
        return torch.float64
    if "transformer-engine" in precision:
        return torch.int8  # as Lightning's ThroughputMonitor
    return torch.float32


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak dense FLOP/s of one ``device`` in ``dtype``: ``DENSE_PEAKS``, else Lightning's table; None where unknown
    (any CPU: silently; a GPU: with a warning that says how to give it)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        chip = next((key for key in DENSE_PEAKS if key in name.lower()), None)
        if chip is not None:
            key: torch.dtype | str = dtype
            if dtype is torch.float32 and torch.get_float32_matmul_precision() != "highest":
                key = "tfloat32"  # as Lightning: float32 matmuls run on TF32 tensor cores unless told otherwise
            if key in DENSE_PEAKS[chip]:
                return DENSE_PEAKS[chip][key]
    elif device.type == "cpu":
        return None
    with warnings.catch_warnings(record=True) as said:  # Lightning's "FLOPs not found": said once below, with a Fix
        warnings.simplefilter("always")
        peak = get_available_flops(device, dtype)
    if peak is None:
        why = "; ".join(str(w.message) for w in said) or "not in Lightning's table"
        rank_zero_warn(
            f"autoshard.ThroughputMonitor: the peak FLOP/s of {device} in {dtype} is unknown ({why}), so MFU is not logged"
            f" (samples, tokens and FLOP/s are). Fix: ThroughputMonitor(peak_flops=...), the device's dense peak in FLOP/s"
        )
    return None if peak is None else float(peak)


def tensor_parallel_size(strategy: Any) -> int:
    """The size of the ``"tensor_parallel"`` dim of a strategy's device mesh (Lightning's ModelParallelStrategy and
    autoshard's fsdp2 name it so), 1 for strategies without one."""
    try:
        mesh = strategy.device_mesh
    except (AttributeError, AssertionError, RuntimeError):  # no mesh, or not built yet
        return 1
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return int(mesh["tensor_parallel"].size()) if "tensor_parallel" in names else 1


class Meter(Throughput):
    """Lightning's ``Throughput`` plus seconds per batch, TFLOP/s per device and tokens per second (its "items")."""

    def compute(self) -> dict[str, int | float]:
        metrics = super().compute()
        device = f"device{self.separator}"
        if metrics.get(f"{device}batches_per_sec"):
            metrics[f"{device}step_time"] = 1.0 / metrics[f"{device}batches_per_sec"]
        if f"{device}flops_per_sec" in metrics:
            metrics[f"{device}tflops_per_sec"] = metrics[f"{device}flops_per_sec"] / 1e12
        if f"{device}items_per_sec" in metrics:
            metrics[f"{device}tokens_per_sec"] = metrics[f"{device}items_per_sec"]
        if "items_per_sec" in metrics:
            metrics["tokens_per_sec"] = metrics["items_per_sec"]
        return metrics


def _positive(value: Any) -> bool:
    """A finite number above 0 (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 < float(value) < float("inf")


def _as_number(value: Any, example: str) -> str:
    """``value`` written as the number it stands for (``'989e12'`` -> ``9.89e+14``), else ``example``."""
    try:
        number = float(str(value).strip().replace("_", ""))
    except ValueError:
        return example
    return f"{number:g}" if 0 < number < float("inf") and not isinstance(value, bool) else example


def check_arguments(batch_size_fn: Any, length_fn: Any, peak_flops: Any, flops_per_batch: Any, kwargs: dict[str, Any]) -> None:
    """Refuse at construction what Lightning takes without a word and then fails on mid-run (a string peak, a
    ``length_fn`` that is not a function), or logs wrong without failing (a negative peak gives a negative MFU, a zero
    one drops it silently), naming the argument and its value."""
    where = "autoshard.ThroughputMonitor"
    for name, value in (("peak_flops", peak_flops), ("flops_per_batch", flops_per_batch)):
        if value is not None and not _positive(value):
            what = "the dense peak FLOP/s of one device" if name == "peak_flops" else "the FLOPs of one training batch on one device"
            leave = "leave it out to log no MFU" if name == "peak_flops" else "leave it out to have them counted"
            example = "989.4e12 (an H100 or H200 in bf16)" if name == "peak_flops" else "6 * parameters * tokens per batch (a transformer's estimate)"
            raise AutoShardError(
                f"{where}({name}={value!r}): {name} is {what}, a positive number. Fix: {name}={_as_number(value, example)}, or {leave}"
            )
    for name, value, ok in (
        ("batch_size_fn", batch_size_fn, "None (the first dimension of the first tensor)"),
        ("length_fn", length_fn, "'tokens' (the default), None"),
    ):
        if value is not None and not callable(value) and not (name == "length_fn" and value == "tokens"):
            raise AutoShardError(
                f"{where}({name}={value!r}): {name} is a function of the batch returning a count. Fix: {name}=lambda batch: ..., or {ok}"
            )
    unknown = sorted(set(kwargs) - {"window_size", "separator"})
    if unknown:
        known = ["batch_size_fn", "length_fn", "peak_flops", "flops_per_batch", "window_size", "separator"]
        close = {k: difflib.get_close_matches(k, known, n=1, cutoff=0.5) for k in unknown}
        fix = ", ".join(f"{c[0]}={kwargs[k]!r} instead of {k}=" if c else f"drop {k}" for k, c in close.items())
        raise AutoShardError(
            f"{where} got {', '.join(f'{k}={kwargs[k]!r}' for k in unknown)}: its keyword arguments are {', '.join(known[:4])}"
            f" and Lightning's window_size and separator. Fix: {fix}"
        )
    window = kwargs.get("window_size", 100)
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise AutoShardError(
            f"{where}(window_size={window!r}): rates are measured between the first and last of window_size batches, so at least 2. Fix: window_size=100 (the default)"
        )


class _Flops:
    """Handed to Lightning's ThroughputMonitor instead of the user's module (never given an attribute): it reads only
    ``flops_per_batch``."""

    def __init__(self, flops: int | None) -> None:
        self.flops_per_batch = flops


class ThroughputMonitor(LightningThroughputMonitor):
    """Lightning's ``ThroughputMonitor`` with FLOPs measured, the device's peak looked up, samples and tokens counted.

    Args:
        batch_size_fn: samples in a batch; default ``batch_size`` (the first dimension of the first tensor).
        length_fn: tokens (Lightning's "items") in a batch; default ``"tokens"``: ``token_count``, the element count
            of the first integer tensor with two or more dimensions, or nothing logged when the batch has none;
            None: no tokens.
        peak_flops: the dense peak FLOP/s of one device for MFU; default: ``device_peak_flops`` (known GPUs; none
            on a CPU, so MFU is logged there only when given).
        flops_per_batch: FLOPs of one training batch on one device (forward and backward); default: the module's
            own ``flops_per_batch`` attribute, else measured on the second training batch, or the first after it
            that ran a backward (``measured_flops``).
        **kwargs: Lightning's ``Throughput`` arguments: ``window_size`` (default 100 batches), ``separator``.
    """

    def __init__(
        self,
        batch_size_fn: Callable[[Any], int] | None = None,
        length_fn: Callable[[Any], int] | Literal["tokens"] | None = "tokens",
        *,
        peak_flops: float | None = None,
        flops_per_batch: int | None = None,
        **kwargs: Any,
    ) -> None:
        check_arguments(batch_size_fn, length_fn, peak_flops, flops_per_batch, kwargs)
        super().__init__(batch_size_fn or batch_size, token_count if length_fn == "tokens" else length_fn, **kwargs)  # type: ignore[arg-type]
        self.peak_flops = peak_flops
        self.flops_per_batch = flops_per_batch
        self.measured_flops: int | None = None  # FlopCounterMode's count of one training batch on rank 0, once measured
        self._tokens = length_fn == "tokens"
        self._counter: Any = None
        self._train_batches = 0
        self._tries = 0  # counted batches that ran no backward
        self._backward = False  # a backward ran in the counted batch

    # -- setup: the meters, with the peak ------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Lightning's setup, with ``Meter`` and this peak (Lightning's ignores an override and misses the H200)."""
        peak = self.peak_flops if self.peak_flops is not None else device_peak_flops(trainer.strategy.root_device, compute_dtype(trainer))
        self.available_flops = peak  # type: ignore[assignment]  # Lightning annotates it int; a peak is a float
        meters = self._throughputs  # private Lightning member: autoshard.privates.in_lightning
        stages = [trainer.state.stage]
        if stage == TrainerFn.FITTING and trainer.enable_validation:
            stages.append(RunningStage.VALIDATING)
        for each in stages:
            assert each is not None
            meters[each] = Meter(available_flops=self.available_flops, world_size=trainer.world_size, **self.kwargs)
        if stage == TrainerFn.FITTING:  # a second fit (another module, other batches) is measured afresh
            self._train_batches, self._tries, self.measured_flops = 0, 0, None
            if self._tokens:
                self.length_fn = token_count

    # -- FLOPs: counted on the second training batch that ran a backward, rank 0 ---------------------------------------
    def _flops(self, pl_module: pl.LightningModule) -> Any:
        """What Lightning's hooks are handed for the module: the module itself when it defines ``flops_per_batch``
        (Lightning's convention), else the argument or the measured count."""
        if self.flops_per_batch is None and hasattr(pl_module, "flops_per_batch"):
            return pl_module
        return _Flops(self.flops_per_batch if self.flops_per_batch is not None else self.measured_flops)

    def _measuring(self, pl_module: pl.LightningModule) -> bool:
        return self.flops_per_batch is None and self.measured_flops is None and not hasattr(pl_module, "flops_per_batch")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        counting = self._train_batches >= 1 and self._tries < COUNT_TRIES
        if trainer.is_global_zero and counting and self._counter is None and self._measuring(pl_module):
            from torch.utils.flop_counter import FlopCounterMode

            self._backward = False
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()  # left in on_train_batch_end; on_exception and teardown leave it too

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Lightning's hook after every backward it runs (automatic optimization and ``manual_backward`` alike)."""
        self._backward = True

    def _stop_counting(self) -> int | None:
        counter, self._counter = self._counter, None
        if counter is None:
            return None
        counter.__exit__(None, None, None)
        return int(counter.get_total_flops())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        flops = self._stop_counting()
        if flops is not None and not self._backward:
            self._tries += 1
            if self._tries == COUNT_TRIES:
                self._warn_unmeasured(f"none of training batches 2-{COUNT_TRIES + 1} ran a backward")
        elif flops is not None:
            self.measured_flops = flops
            rank_zero_info(
                f"autoshard.ThroughputMonitor: {flops / 1e9:.4g} GFLOP per training batch on one device (FlopCounterMode,"
                f" batch {self._train_batches + 1} of the fit)"
            )
            tp = tensor_parallel_size(trainer.strategy)
            if tp > 1:
                rank_zero_warn(
                    f"autoshard.ThroughputMonitor: under tensor parallelism ({tp} ranks) FlopCounterMode counts each sharded"
                    f" matmul at the DTensor's full shape, so FLOP/s and MFU read up to {tp}x too high. Fix:"
                    f" ThroughputMonitor(flops_per_batch=...), the FLOPs of one batch on one device"
                )
        if self._train_batches == 0 and self._tokens and _token_ids(batch) is None:
            self.length_fn = None  # no token ids in the batch: no tokens logged (Lightning's lengths must be >= samples)
        self._train_batches += 1
        super().on_train_batch_end(trainer, self._flops(pl_module), outputs, batch, batch_idx)  # type: ignore[arg-type]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if 0 < self._tries < COUNT_TRIES and self.measured_flops is None:
            self._warn_unmeasured(f"the fit ended before a training batch after the first ran a backward ({self._tries} counted ran none)")

    def _warn_unmeasured(self, why: str) -> None:
        """Say that no FLOPs were measured rather than log a forward's count as a step's (a third of it)."""
        rank_zero_warn(
            f"autoshard.ThroughputMonitor: {why}: a training_step that returns None makes Lightning skip the backward,"
            f" and a backward run outside Lightning's manual_backward is not seen. No FLOPs were measured, so FLOP/s and"
            f" MFU are not logged (samples and tokens are). Fix: ThroughputMonitor(flops_per_batch=...), the FLOPs of one"
            f" training batch on one device"
        )

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
        super().on_validation_batch_end(trainer, self._eval_flops(pl_module), *args, **kwargs)

    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
        super().on_test_batch_end(trainer, self._eval_flops(pl_module), *args, **kwargs)

    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
        super().on_predict_batch_end(trainer, self._eval_flops(pl_module), *args, **kwargs)

    def _eval_flops(self, pl_module: pl.LightningModule) -> Any:
        """A forward-only batch: the module's own ``flops_per_batch`` if it has one (Lightning's behaviour), else no
        FLOPs (the training count includes a backward)."""
        return pl_module if hasattr(pl_module, "flops_per_batch") else _Flops(None)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        with contextlib.suppress(Exception):  # the user's error is the one to see, not the counter's
            self._stop_counting()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_counting()
