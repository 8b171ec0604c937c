"""``autoshard calibrate``: the rates a memory budget prices configurations with (``autoshard.budget.Rates``), measured
on this machine's device, written to a JSON file that ``decide`` reads when ``AUTOSHARD_RATES`` names it.

Why: the built-in rates are one H200's (docs/benchmarks.md). On another device the price order of the candidates can
differ (recomputation is cheap where matmuls are fast; selective checkpointing's Python policy costs what the host's
CPU costs), and the order is what the decision follows. What it measures, in about half a minute on a GPU:

- recomputation: a stack of decoder layers of Llama's shape, forward and backward with and without every block checkpointed;
  the extra FLOPs (torch's FlopCounterMode) over the extra time;
- selective checkpointing: the same with ``"selective"``; its price per recomputed FLOP over the one above;
- host copies (CUDA only): pinned host-to-device and device-to-host copies of 256 MiB.
Collective bandwidths need several devices and keep their built-in values (the file says so).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoshard.budget import RATES_ENV, RATES_FORMAT, Rates, is_rates_file, read_rates
from autoshard.checkpoint.saves import unused_sibling
from autoshard.consolidate import command_parser
from autoshard.errors import AutoShardError


class CalibrateError(AutoShardError):
    """The rates could not be measured or written."""


class _Block(nn.Module):
    """A decoder layer of Llama's shape (q, k, v and o projections, causal attention, a gated MLP): what selective
    checkpointing's policy meets in the models it is for (a plain MLP block would recompute no matmul at all)."""

    def __init__(self, width: int, heads: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, 3 * width, bias=False)
        self.down = nn.Linear(3 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, s, self.heads, w // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attended.transpose(1, 2).reshape(b, s, w))
        h = self.norm2(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


def _blocks(width: int, depth: int, device: torch.device, dtype: torch.dtype) -> nn.ModuleList:
    return nn.ModuleList(_Block(width) for _ in range(depth)).to(device=device, dtype=dtype)


def _step(blocks: nn.ModuleList, x: torch.Tensor) -> None:
    for block in blocks:
        x = block(x)
    x.float().pow(2).mean().backward()


def _timed(run: Callable[[], None], device: torch.device, repeats: int) -> float:
    """The median wall time of ``run`` after one warm-up, synchronised on CUDA."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    run()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure_checkpointing(device: torch.device, width: int, depth: int, tokens: int, repeats: int) -> dict[str, tuple[float, int]]:
    """(seconds, FLOPs) of one forward and backward per activation-checkpointing mode."""
    from torch.utils.flop_counter import FlopCounterMode

    from autoshard.adapters.checkpointing import apply_checkpointing

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(4, tokens // 4, width, device=device, dtype=dtype, requires_grad=True)
    out: dict[str, tuple[float, int]] = {}
    for mode in (False, True, "selective"):
        blocks = _blocks(width, depth, device, dtype)
        for index, block in enumerate(blocks):
            apply_checkpointing(block, mode, index)
        with FlopCounterMode(display=False) as counter:
            _step(blocks, x)
        out[str(mode)] = (_timed(lambda b=blocks: _step(b, x), device, repeats), int(counter.get_total_flops()))
    return out


def _host_bytes_per_s(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    n = 256 << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    to_device = _timed(lambda: dev.copy_(host, non_blocking=True), device, 5)
    to_host = _timed(lambda: host.copy_(dev, non_blocking=True), device, 5)
    return 2 * n / (to_device + to_host)


def measured_device(device: str | None) -> torch.device:
    """``--device`` as a device calibrate can time, refused before anything is measured: a device type torch does
    not know, ``meta`` (no data, so its "timings" are Python's overhead, written as rates), a CUDA device this machine
    does not have, or another accelerator (calibrate synchronises CUDA only, so its timings would be launch times)."""
    cudas = torch.cuda.device_count() if torch.cuda.is_available() else 0
    here = "cpu" if not cudas else "one of " + ", ".join(["cpu", *(f"cuda:{i}" for i in range(cudas))])
    if device is None:
        return torch.device("cuda" if cudas else "cpu")
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        fix = "--device cuda" if device.strip().lower().startswith("gpu") and cudas else f"--device {here}"
        raise CalibrateError(f"--device {device!r} is not a device torch knows. Fix: {fix}") from None
    if where.type == "cuda" and (where.index or 0) >= cudas:
        has = f"{cudas} CUDA device(s)" if cudas else "no CUDA device (torch " + torch.__version__ + ")"
        raise CalibrateError(
            f"--device {device!r}: this machine has {has}, and the rates are measured on the device itself. Fix: run"
            f" calibrate on the machine whose GPU the runs use, or --device {here}"
        )
    if where.type not in ("cpu", "cuda"):
        why = "meta tensors hold no data, so nothing would be computed to time" if where.type == "meta" else "calibrate times cpu and cuda only"
        raise CalibrateError(f"--device {device!r}: {why}. Fix: --device {here}")
    return where


def check_repeats(repeats: int) -> None:
    if repeats < 1:
        raise CalibrateError(
            f"--repeats {repeats}: each rate is the median of the timed repeats, so it needs at least one. Fix: --repeats 5 (the default)"
        )


def calibrate(device: str | None = None, *, width: int | None = None, depth: int = 4, tokens: int | None = None, repeats: int = 5) -> dict[str, Any]:
    """Measure the rates on ``device`` (default: CUDA when there is one); a figure within noise (a small or busy
    machine) keeps the built-in value, and ``kept`` says why."""
    where = measured_device(device)
    check_repeats(repeats)
    gpu = where.type == "cuda"
    width = width or (2048 if gpu else 256)
    tokens = tokens or (8192 if gpu else 512)
    modes = _measure_checkpointing(where, width, depth, tokens, repeats)
    (none_s, none_f), (full_s, full_f), (sel_s, sel_f) = modes["False"], modes["True"], modes["selective"]
    base, rates, kept = Rates(), {}, {}
    if full_s > none_s and full_f > none_f:
        rates["flops_per_s"] = (full_f - none_f) / (full_s - none_s)
    else:
        kept["flops_per_s"] = f"recomputing every block took no measurable time ({full_s - none_s:+.2e} s)"
    if "flops_per_s" in rates and sel_s > none_s and sel_f > none_f:
        rates["selective_factor"] = max(1.0, (sel_s - none_s) / (sel_f - none_f) * rates["flops_per_s"])
    else:
        kept["selective_factor"] = "selective checkpointing's extra time or FLOPs could not be told from noise"
    host = _host_bytes_per_s(where)
    if host is not None:
        rates["host_bytes_per_s"] = host
    else:
        kept["host_bytes_per_s"] = "no CUDA device: host copies are not measured"
    kept["intra_node_bytes_per_s"] = kept["inter_node_bytes_per_s"] = "collectives need several devices: built-in value"
    return {
        "format": RATES_FORMAT,
        "device": torch.cuda.get_device_name(where) if gpu else "cpu",
        "torch": torch.__version__,
        "rates": replace(base, **rates).to_dict(),
        "kept": kept,
        "measured": {mode: {"seconds": s, "flops": f} for mode, (s, f) in modes.items()},
        "model": {"width": width, "depth": depth, "tokens": tokens, "dtype": "bfloat16" if gpu else "float32"},
    }


def check_out(out: Path) -> None:
    """Refuse ``out`` unless calibrate may write it there: a new path, or a rates file calibrate wrote (its ``format`` key)."""
    if out.is_dir() or (out.exists() and not is_rates_file(out)):
        what = "a directory" if out.is_dir() else "a file calibrate did not write (no 'format': 'autoshard-rates' in it)"
        raise CalibrateError(f"refusing to write {str(out)!r}: it is {what}. Fix: --out a new path, e.g. {str(unused_sibling(out))!r}")
    parent = next(p for p in out.absolute().parents if p.exists() or p == p.parent)  # what mkdir would start from
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        what = "is a file, not a directory" if not parent.is_dir() else "is a directory you cannot write"
        raise CalibrateError(
            f"cannot write {str(out)!r}: {str(parent)!r} {what}. Fix: --out a path in a directory you can write, e.g. {str(default_path())!r}"
        )


def write_rates(result: dict[str, Any], out: Path) -> None:
    """Write ``result`` to ``out`` atomically, replacing only a rates file calibrate wrote (``check_out``)."""
    check_out(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staged = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        staged.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(staged, out)
    except OSError as exc:
        raise CalibrateError(f"cannot write {str(out)!r} ({exc.strerror or exc}). Fix: --out a path in a directory you can write") from exc


def default_path() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autoshard" / "rates.json"


def cmd_calibrate(args: argparse.Namespace, stream: Any = None) -> int:
    stream = stream or sys.stdout
    out = Path(args.out) if args.out else default_path()
    where = measured_device(args.device)  # each refused before the minute of measuring, not after
    check_repeats(args.repeats)
    check_out(out)
    result = calibrate(str(where), repeats=args.repeats)
    write_rates(result, out)
    read_rates(out)  # what decide will read: refused here, not at the next fit, if it does not parse
    if args.json:
        print(json.dumps({**result, "path": str(out)}, indent=1), file=stream)
        return 0
    r = result["rates"]
    print(
        f"autoshard calibrate: {result['device']}: recomputation {r['flops_per_s'] / 1e12:.1f} TFLOP/s, selective"
        f" checkpointing x{r['selective_factor']:.2f}, host copies {r['host_bytes_per_s'] / 1e9:.1f} GB/s",
        file=stream,
    )
    for field, why in result["kept"].items():
        print(f"  kept {field}: {why}", file=stream)
    print(f"written to {out}; a memory budget reads it when {RATES_ENV} names it:\n  export {RATES_ENV}={out}", file=stream)
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``autoshard calibrate`` to the ``autoshard`` command."""
    summary = "measure the rates a memory budget prices configurations with, on this machine's device"
    parser = command_parser(subparsers, "calibrate", summary, __doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", default=None, help=f"the rates file to write (default: {default_path()})")
    parser.add_argument("--device", default=None, help="the device to measure, e.g. cuda:1 (default: cuda when there is one, else cpu)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (the median is kept)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.set_defaults(func=cmd_calibrate)
