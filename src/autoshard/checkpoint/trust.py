"""Reading checkpoint files without running their code: every reader unpickles through here, with exactly the types
in ``TRUSTED_TYPES`` allowed; the refusals name what a file wanted and how to read it anyway (``--trust-pickle``).
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from autoshard.checkpoint import deepspeed_layout
from autoshard.errors import AutoShardError

DCP_METADATA = ".metadata"  # torch.distributed.checkpoint writes it last, atomically, once every rank has written
TRUST_PICKLE = "--trust-pickle (trust_pickle=True)"


class CheckpointFormatError(AutoShardError, ValueError):
    """A path that cannot be loaded (or overwritten) as asked: what it is, what reads it, and the fix."""


# -- reading files: never code ---------------------------------------------------------------------------------------
# The types autoshard lets torch.load(weights_only=True) build besides tensors and plain values: exactly what the files
# of a DeepSpeed or Lightning checkpoint hold, found by loading real ones (tests/test_bad_inputs_reads.py, one test
# each). Anything else a pickle names is refused (UntrustedPickleError), or loaded under --trust-pickle alone.
DEEPSPEED_TYPES: tuple[str, ...] = deepspeed_layout.PICKLED_TYPES  # LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address
# Lightning 2.6's own .ckpt / meta.pt / DeepSpeed client state hold plain values only (loops, callbacks, schedulers,
# precision); a user's hyper-parameters may hold their own types (a Path, a Namespace), which stay refused.
LIGHTNING_TYPES: tuple[str, ...] = ()
TRUSTED_TYPES: tuple[str, ...] = DEEPSPEED_TYPES + LIGHTNING_TYPES
WEIGHTS_ONLY_REFUSAL = "Weights only load failed"  # how torch's restricted unpickler's refusals begin
_FORCE, _NO_FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


class UntrustedPickleError(CheckpointFormatError):
    """A file whose pickle names a global outside what weights_only and TRUSTED_TYPES allow: loading it runs code."""


def trusted_types(import_missing: bool = False) -> list[Any]:
    """The classes of TRUSTED_TYPES, from modules already imported (deepspeed costs seconds to import; a file that
    needs its types imports it: ``import_missing``); those that cannot be imported (deepspeed absent) are left out."""
    found = []
    for qualname in TRUSTED_TYPES:
        module_name, _, name = qualname.rpartition(".")
        module = sys.modules.get(module_name)
        if module is None and import_missing:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
        if module is not None and hasattr(module, name):
            found.append(getattr(module, name))
    return found


@contextmanager
def weights_only_loads(trust_pickle: bool = False) -> Iterator[None]:
    """Every torch.load inside reads weights only, even one that passes weights_only=False (zero_to_fp32, DCP's byte
    entries): torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD, set for the duration."""
    if trust_pickle:
        yield
        return
    saved = {key: os.environ.pop(key, None) for key in (_FORCE, _NO_FORCE)}
    os.environ[_FORCE] = "1"
    try:
        with torch.serialization.safe_globals(trusted_types(import_missing=True)):
            yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def _refused_globals(path: Path, exc: BaseException) -> list[str]:
    """The globals a refused pickle names (read from its opcodes, never run), less the trusted ones."""
    try:
        found = list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except (RuntimeError, ValueError, OSError, pickle.UnpicklingError):  # not a zip file: the refusal's text names one
        found = []
    found = [g for g in found if g not in TRUSTED_TYPES] or re.findall(r"GLOBAL ([\w.]+)", str(exc))
    return list(dict.fromkeys(found))


def untrusted(path: Path, names: list[str], action: str, fix: str | None = None) -> UntrustedPickleError:
    """The refusal of a file whose pickle would build ``names``."""
    shown = ", ".join(f"`{n}`" for n in names[:4]) + (", ..." if len(names) > 4 else "")
    return UntrustedPickleError(
        f"cannot {action}: {str(path)!r} is a pickle that names {shown}: neither a tensor nor a type a Lightning or"
        f" DeepSpeed checkpoint holds (autoshard.checkpoint.TRUSTED_TYPES), and unpickling it would run code chosen by"
        f" whoever wrote the file, so autoshard reads it with torch.load(weights_only=True) and refuses it. Fix: "
        + (
            fix
            or f"if you trust who wrote it (your own run), pass {TRUST_PICKLE}, which unpickles it as"
            f" torch.load(weights_only=False) does; otherwise ask its author for the weights as safetensors"
        )
    )


def unreadable(path: Path, exc: BaseException, action: str) -> CheckpointFormatError:
    """The refusal of a file torch.load cannot parse: cut short, or damaged."""
    size = path.stat().st_size if path.is_file() else 0
    why = (str(exc).strip().splitlines() or [""])[0].split(". ")[0]
    return CheckpointFormatError(
        f"cannot {action}: {str(path)!r} ({size:,d} bytes) cannot be read ({type(exc).__name__}: {why}): it is"
        f" truncated or damaged, as a copy, download or save that stopped early leaves it. Fix: copy the checkpoint"
        f" again from where it was written, or use an earlier one"
    )


def load_torch_file(path: str | os.PathLike[str], *, action: str = "read", trust_pickle: bool = False, untrusted_fix: str | None = None) -> Any:
    """``torch.load`` of one file on the CPU, memory-mapped where torch can, running no code unless ``trust_pickle``;
    a damaged file is a CheckpointFormatError naming it, not torch's traceback."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            mmap = f.read(4) == b"PK\x03\x04"  # torch maps zip files only (torch.save's format since 1.6)
        if trust_pickle:
            return torch.load(p, map_location="cpu", mmap=mmap, weights_only=False)
        try:
            with torch.serialization.safe_globals(trusted_types()):
                return torch.load(p, map_location="cpu", mmap=mmap, weights_only=True)
        except pickle.UnpicklingError as exc:
            wanted = _refused_globals(p, exc) if WEIGHTS_ONLY_REFUSAL in str(exc) else []
            if not wanted or not set(wanted) <= set(TRUSTED_TYPES):
                raise
            with torch.serialization.safe_globals(trusted_types(import_missing=True)):  # a DeepSpeed file: import its types
                return torch.load(p, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as exc:
        wanted = _refused_globals(p, exc) if WEIGHTS_ONLY_REFUSAL in str(exc) else []
        if wanted and set(wanted) <= set(TRUSTED_TYPES):
            raise CheckpointFormatError(
                f"cannot {action}: {str(p)!r} holds DeepSpeed objects ({', '.join(wanted)}), which need deepspeed to be"
                f' read. Fix: pip install "autoshard[deepspeed]" (no GPU needed)'
            ) from None
        if wanted:
            raise untrusted(p, wanted, action, untrusted_fix) from None
        raise unreadable(p, exc, action) from None
    except (RuntimeError, OSError, EOFError, ValueError, IndexError) as exc:
        raise unreadable(p, exc, action) from None


def _without_tensor_data(value: Any) -> Any:
    """``value`` with each plain tensor inside its dicts, lists and tuples replaced by an empty one of its dtype: what
    ``unreadable_globals`` pickles (the tensors' bytes would only cost memory; their type is what it checks)."""
    if type(value) in (torch.Tensor, torch.nn.Parameter):
        return torch.empty(0, dtype=value.dtype)
    if type(value) in (dict, list, tuple):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        stripped = {k: _without_tensor_data(v) for k, v in items}
        return stripped if isinstance(value, dict) else type(value)(stripped.values())
    return value


def unreadable_globals(value: Any) -> list[str]:
    """The globals ``torch.save(value)`` would name that a weights-only load refuses (what ``load_torch_file`` reads
    back without trust_pickle): [] when it reads back. Pickled in memory and loaded there, as the reader will."""
    buffer = io.BytesIO()
    torch.save(_without_tensor_data(value), buffer)
    buffer.seek(0)
    try:
        with torch.serialization.safe_globals(trusted_types()):
            torch.load(buffer, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        buffer.seek(0)
        found = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(buffer) if g not in TRUSTED_TYPES]
        return found or re.findall(r"GLOBAL ([\w.]+)", str(exc)) or [str(exc).strip().splitlines()[0]]
    return []


# DCP writes its .metadata with plain pickle and torch reads it so (any global): these are all it holds.
_DCP_METADATA_CLASSES = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
}
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"  # its dataclasses and enums


class _MetadataUnpickler(pickle.Unpickler):
    refused: list[str]

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_CLASSES or module == _DCP_METADATA_MODULE:
            found = super().find_class(module, name)
            if module != _DCP_METADATA_MODULE or (isinstance(found, type) and found.__module__ == module):
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        self.refused.append(f"{module}.{name}")
        raise pickle.UnpicklingError(f"{module}.{name} refused")


def read_dcp_metadata(path: Path, action: str = "read") -> Any:
    """A DCP checkpoint's .metadata, unpickled with only the classes DCP writes into it (torch's own reader would
    build any global a crafted file names): UntrustedPickleError otherwise."""
    f = Path(path) / DCP_METADATA
    with open(f, "rb") as handle:
        unpickler = _MetadataUnpickler(handle)
        unpickler.refused = []
        try:
            return unpickler.load()
        except pickle.UnpicklingError:
            if unpickler.refused:
                raise untrusted(
                    f,
                    unpickler.refused,
                    action,
                    "restore the checkpoint from a backup, or use an earlier one: DCP never writes anything but its own metadata classes there",
                ) from None
            raise
