"""``ShardingIntent(init_from=PATH)``: pretrained weights into a sharded model, each rank reading only its slices.

Meta-device init keeps a large model off every rank's memory, but ``reset_parameters()`` then draws random weights.
Here the file is matched against the model by name and shape before anything is sharded (the same verdict on every
rank), and each rank then copies only the rows it owns: safetensors slices and torch files memory-mapped, DCP read
into the model's DTensors. Tied weights need one name in the file; an EMA teacher absent from it copies its student.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoshard.checkpoint.formats import is_torch_file, torn_shard
from autoshard.checkpoint.readers import (
    SAFETENSORS_INDEX,
    SAFETENSORS_SINGLE,
    TIED_METADATA,
    TORCH_SINGLE,
    Stored,
    dcp_entries,
    dtype_name,
    model_entry,
    safetensors_header,
    torch_weights,
)
from autoshard.checkpoint.resume import CONSOLIDATE, model_mismatch
from autoshard.checkpoint.trust import DCP_METADATA, TRUST_PICKLE, CheckpointFormatError, load_torch_file
from autoshard.errors import AutoShardError
from autoshard.needs import EMAPair, eager_name
from autoshard.privates import in_torch


class InitFromError(AutoShardError, ValueError):
    """The weights file does not fit the model (or cannot be read): what differs, and the fix."""


@dataclass
class WeightsFile:
    """One ``init_from`` path, read as far as its headers: names and shapes, no tensor data."""

    path: Path
    kind: str  # "safetensors", "torch" or "dcp"
    shapes: dict[str, tuple[int, ...]]
    files: dict[str, Stored] = field(default_factory=dict)  # safetensors: where each name's bytes are
    entry: str | None = None  # torch / dcp: the key the weights sit under ("state_dict" in a Lightning checkpoint)
    tied: dict[str, str] = field(default_factory=dict)  # alias -> name, from autoshard's safetensors metadata
    state: Mapping[str, torch.Tensor] | None = None  # torch: the memory-mapped state dict (no page read yet)
    dtypes: dict[str, str] = field(default_factory=dict)  # name -> dtype as torch names it ("float16"), from headers

    def __post_init__(self) -> None:
        """Weights saved from a compiled model (``_orig_mod.``) read under the eager names the model has by then; not
        for DCP (read by its stored keys), nor when two stored names would become one."""
        eager = {k: eager_name(k) for k in self.shapes}
        if self.kind == "dcp" or all(k == v for k, v in eager.items()) or len(set(eager.values())) < len(eager):
            return
        self.shapes = {eager[k]: v for k, v in self.shapes.items()}
        self.files = {eager.get(k, k): v for k, v in self.files.items()}
        self.tied = {eager_name(a): eager_name(b) for a, b in self.tied.items()}
        self.dtypes = {eager.get(k, k): v for k, v in self.dtypes.items()}
        if self.state is not None:
            self.state = {eager.get(k, k): v for k, v in self.state.items()}


_PREAD = hasattr(os, "preadv") and sys.byteorder == "little"  # safetensors stores little-endian


def _kind(dtype: str) -> str:
    """bool, int, float or complex: a load may change precision within a kind, never the kind (an int64 file into
    float weights would train on integers cast to floats without a word)."""
    if dtype in ("bool", "BOOL"):
        return "bool"
    if dtype.startswith(("complex", "C")):
        return "complex"
    if dtype.startswith(("float", "bfloat", "F", "BF")):
        return "float"
    return "int"


def _contiguous_rows(rows: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(first, end) element offsets when the slice is whole rows of a row-major tensor (Shard(0)), else None."""
    if any(r.start != 0 or r.stop != n for r, n in zip(rows[1:], shape[1:])):
        return None
    inner = 1
    for n in shape[1:]:
        inner *= n
    first = rows[0].start if rows else 0
    count = (rows[0].stop - rows[0].start) if rows else 1
    return first * inner, (first + count) * inner


def _read_into(handle: Any, offset: int, out: torch.Tensor) -> int:
    """``out.nbytes`` bytes from ``offset`` straight into ``out``'s memory (pread: no mapping, no page kept). ``out``
    is a CPU tensor: the caller reads into a CPU buffer for a shard on another device."""
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        n = os.preadv(handle.fileno(), [view[done:]], offset + done)
        if n <= 0:
            raise InitFromError(
                f"init_from: {handle.name!r} ended before byte {offset + len(view)}: the file is truncated. Fix: download or copy it again"
            )
        done += n
    return done


def open_weights(path: str | os.PathLike[str]) -> WeightsFile:
    """Names and shapes of what ``path`` holds, reading headers only; refuses what it cannot read, with the fix (the
    checkpoint readers' refusals too, as InitFromError)."""
    try:
        return _open_weights(Path(path))
    except CheckpointFormatError as exc:
        raise InitFromError(str(exc)) from None


def _open_weights(p: Path) -> WeightsFile:
    if not p.exists():
        raise InitFromError(
            f"init_from={str(p)!r} does not exist. Fix: pass the path of a safetensors file, a Hugging Face model directory, a torch state dict file or a DCP directory, as every rank sees it"
        )
    if p.is_dir():
        if (p / SAFETENSORS_INDEX).is_file():
            index = json.loads((p / SAFETENSORS_INDEX).read_text())
            files = sorted({p / name for name in index.get("weight_map", {}).values()})
            shapes, where, tied, dtypes = safetensors_header(files)
            tied = {**tied, **(index.get("metadata") or {}).get(TIED_METADATA, {})}
            return WeightsFile(p, "safetensors", shapes, where, tied=tied, dtypes=dtypes)
        if (p / SAFETENSORS_SINGLE).is_file():
            shapes, where, tied, dtypes = safetensors_header([p / SAFETENSORS_SINGLE])
            return WeightsFile(p, "safetensors", shapes, where, tied=tied, dtypes=dtypes)
        if (p / DCP_METADATA).is_file():
            return _open_dcp(p)
        if (p / TORCH_SINGLE).is_file():
            return _open_torch(p / TORCH_SINGLE)
        listing = ", ".join(sorted(x.name for x in p.iterdir())[:6]) or "nothing"
        raise InitFromError(
            f"init_from={str(p)!r} is a directory holding {listing}: no {SAFETENSORS_SINGLE}, {SAFETENSORS_INDEX}, {TORCH_SINGLE}"
            f" or DCP .metadata. Fix: pass the model directory save_pretrained wrote, the safetensors file itself, or a checkpoint directory"
        )
    with open(p, "rb") as f:
        head = f.read(8)
    if p.suffix == ".safetensors" or (len(head) == 8 and int.from_bytes(head, "little") < p.stat().st_size and not is_torch_file(p)):
        shapes, where, tied, dtypes = safetensors_header([p])
        return WeightsFile(p, "safetensors", shapes, where, tied=tied, dtypes=dtypes)
    if is_torch_file(p):
        return _open_torch(p)
    raise InitFromError(
        f"init_from={str(p)!r} is neither a safetensors nor a torch.save file. Fix: pass a .safetensors file, a torch state dict file, or a directory"
    )


def _open_torch(p: Path) -> WeightsFile:
    # Storages memory-mapped, no page read yet; never code: objects beside the weights (a .ckpt's hyper-parameters)
    # that weights_only refuses are written out by consolidate, with the user's explicit trust.
    fix = f"write the weights alone with `{CONSOLIDATE.format(path=p)} {TRUST_PICKLE.split()[0]}` if you trust the file, and pass weights.pt"
    loaded = load_torch_file(p, action="load init_from", untrusted_fix=fix)
    entry, state = torch_weights(loaded)
    if not isinstance(state, Mapping):
        raise InitFromError(f"init_from={str(p)!r} holds a {type(state).__name__}, not a state dict. Fix: torch.save(model.state_dict(), PATH)")
    tensors = {str(k): v for k, v in state.items() if isinstance(v, torch.Tensor)}
    dtypes = {k: dtype_name(v.dtype) for k, v in tensors.items()}
    return WeightsFile(p, "torch", {k: tuple(v.shape) for k, v in tensors.items()}, entry=entry, state=tensors, dtypes=dtypes)


def _open_dcp(p: Path) -> WeightsFile:
    torn = torn_shard(p)  # a shard cut short would fail on the ranks that read it only, at load
    entries = dcp_entries(p)
    if torn is not None:
        raise InitFromError(
            f"init_from={str(p)!r} is a distributed checkpoint whose {torn}. Nothing was loaded or sharded yet. Fix: use a complete checkpoint (copy it again, or an earlier one)"
        )
    keys = {where[0] for where, _ in entries}
    entry = model_entry(keys)
    shapes, dtypes = {}, {}
    for where, item in entries:
        size = getattr(item, "size", None)
        if size is None:
            continue
        if entry is None and len(where) >= 1:
            name = ".".join(where)
        elif where[0] == entry and len(where) > 1:
            name = ".".join(where[1:])
        else:
            continue
        shapes[name] = tuple(size)
        dtype = getattr(getattr(item, "properties", None), "dtype", None)
        if dtype is not None:
            dtypes[name] = dtype_name(dtype)
    return WeightsFile(p, "dcp", shapes, entry=entry, dtypes=dtypes)


# -- planning: match names and shapes before anything is sharded ---------------------------------------------------
@dataclass
class InitPlan:
    """What each model tensor is read from; ``covered`` are the model names the files fill (tied aliases and
    teachers that copy their students included), ``copy_teachers`` the EMA pairs whose teacher copies its student."""

    reads: dict[str, tuple[WeightsFile, str]]  # model name -> (file, name in the file)
    covered: frozenset[str]
    copy_teachers: tuple[EMAPair, ...]
    sources: tuple[tuple[str, WeightsFile], ...]
    casts: dict[str, tuple[str, str]] = field(default_factory=dict)  # model name -> (file dtype, model dtype): same kind

    def describe_casts(self) -> str:
        """The precision changes a load makes ("" when none), for the log: they are allowed, and said."""
        groups: dict[tuple[str, str], list[str]] = {}
        for name, pair in sorted(self.casts.items()):
            groups.setdefault(pair, []).append(name)
        return "; ".join(
            f"{len(names)} tensor(s) cast from the file's {a} to the model's {b} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
            for (a, b), names in groups.items()
        )


def sources_of(init_from: str | os.PathLike[str] | Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> dict[str, str]:
    """``{module path: weights path}`` from the intent's field ("" is the whole LightningModule)."""
    if init_from is None:
        return {}
    if isinstance(init_from, (str, os.PathLike)):
        return {"": os.fspath(init_from)}
    items = init_from.items() if isinstance(init_from, Mapping) else init_from
    return {str(k): os.fspath(v) for k, v in items}


def _model_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """What a state dict of ``module`` holds, tied names included: parameters and persistent buffers."""
    out: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    for path, sub in module.named_modules(remove_duplicate=False):
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                out[f"{path}.{name}" if path else name] = buf
    return out


def _under(name: str, prefix: str) -> bool:
    return not prefix or name == prefix or name.startswith(prefix + ".")


def _key(name: str, prefix: str) -> str:
    return name[len(prefix) + 1 :] if prefix else name


def plan_init_from(module: nn.Module, init_from: Mapping[str, str], ema_pairs: Iterable[EMAPair] = ()) -> InitPlan:
    """Match every file against the part of the model it is for; InitFromError naming every missing, unexpected
    and reshaped tensor (with a fix) before any shard exists."""
    if not init_from:
        return InitPlan({}, frozenset(), (), ())
    modules = dict(module.named_modules())
    unknown = [prefix for prefix in init_from if prefix and prefix not in modules]
    if unknown:
        raise InitFromError(
            f"init_from names module path(s) {', '.join(map(repr, unknown))}, which {type(module).__name__} does not have."
            f" Fix: use the attribute path of the submodule the weights belong to, one of: {', '.join(repr(n) for n in list(modules)[1:7])}"
        )
    targets = _model_tensors(module)
    owners: dict[int, list[str]] = {}
    for name, t in targets.items():
        owners.setdefault(id(t), []).append(name)
    sources = tuple((prefix, open_weights(path)) for prefix, path in init_from.items())
    reads: dict[str, tuple[WeightsFile, str]] = {}
    problems: list[str] = []
    fixes: list[str] = []
    pairs = tuple(ema_pairs)
    for prefix, src in sources:  # every file first: a tied alias or a teacher may be filled by another one
        for name in targets:
            key = _key(name, prefix)
            if not _under(name, prefix):
                continue
            if key in src.shapes:
                reads[name] = (src, key)
            elif key in src.tied and src.tied[key] in src.shapes:
                reads[name] = (src, src.tied[key])
    for prefix, src in sources:
        mine = {n: tuple(t.shape) for n, t in targets.items() if _under(n, prefix)}
        unexpected = [n for n in (f"{prefix}.{k}" if prefix else k for k in src.shapes) if n not in mine]
        missing = [n for n in mine if n not in reads and not _filled_otherwise(n, targets, owners, reads, pairs)]
        saved: dict[str, tuple[int, ...] | None] = {n: src.shapes[key] for n, (s, key) in reads.items() if s is src}
        saved.update({n: src.shapes[_key(n, prefix)] for n in unexpected})
        wanted = {n: mine[n] for n in [*missing, *(n for n in saved if n in mine)]}
        mismatch = model_mismatch(saved, wanted)
        if mismatch:
            where = f"the module at {prefix!r}" if prefix else type(module).__name__
            mismatch = mismatch.replace("the checkpoint", "the file").replace("(checkpoint (", "(file (")
            problems.append(f"init_from {str(src.path)!r} does not match {where}: {mismatch}")
            fixes.append(_prefix_fix(src, prefix, targets))
    if problems:
        fix = next(
            (f for f in fixes if f),
            "load weights saved from this architecture, or point init_from at the submodule they belong to: init_from={'<module path>': PATH}",
        )
        raise InitFromError(f"{'; '.join(problems)}. Nothing was loaded or sharded yet. Fix: {fix}")
    casts = _check_dtypes(reads, targets, module)
    copy = tuple(p for p in pairs if not any(_under(n, p.teacher) for n in reads))
    covered = set(reads)
    for name in targets:
        if _filled_otherwise(name, targets, owners, reads, pairs):
            covered.add(name)
    return InitPlan(reads, frozenset(covered), copy, sources, casts)


def _check_dtypes(reads: Mapping[str, tuple[WeightsFile, str]], targets: Mapping[str, torch.Tensor], module: nn.Module) -> dict[str, tuple[str, str]]:
    """Refuse a tensor whose file dtype is another kind than the model's (int or bool into float, float into int);
    return the precision changes within a kind (an fp16 file into fp32 weights), which load and are logged."""
    casts: dict[str, tuple[str, str]] = {}
    wrong: list[tuple[str, str, str, WeightsFile, str]] = []
    for name, (src, key) in sorted(reads.items()):
        stored = src.dtypes.get(key)
        if stored is None:
            continue
        wanted = dtype_name(targets[name].dtype)
        if _kind(stored) != _kind(wanted):
            wrong.append((name, stored, wanted, src, key))
        elif stored != wanted:
            casts[name] = (stored, wanted)
    if wrong:
        name, stored, wanted, src, _ = wrong[0]
        more = f" (and {len(wrong) - 1} more: {', '.join(w[0] for w in wrong[1:4])}{', ...' if len(wrong) > 4 else ''})" if len(wrong) > 1 else ""
        raise InitFromError(
            f"init_from {str(src.path)!r} does not match {type(module).__name__}: {name} is {stored} in the file and {wanted} in"
            f" the model{more}. Loading would cast {_kind(stored)} values into {_kind(wanted)} tensors without a word, so"
            f" nothing was loaded or sharded. Fix: point init_from at this model's own weights; if these values are meant"
            f" as they are, {_conversion(src, {key: want for _, _, want, file, key in wrong if file is src})}"
        )
    return casts


def _conversion(src: WeightsFile, wanted: Mapping[str, str]) -> str:
    """The Fix's one line that converts exactly the tensors named in ``wanted`` (name in the file -> the model's dtype)
    into a new file beside ``src``, and leaves every other tensor as it is (an int64 buffer beside float weights)."""
    casts = "{" + ", ".join(f"{k!r}: torch.{d}" for k, d in sorted(wanted.items())) + "}"
    update = f"sd.update({{k: sd[k].to(d) for k, d in {casts}.items()}})"
    files = sorted({w.file for w in src.files.values()})
    if src.kind == "safetensors" and len(files) == 1:
        out = files[0].with_name(f"{files[0].stem}-converted.safetensors")
        return (
            f'convert only those tensors into a new file, e.g. `python -c "import torch; from safetensors.torch import'
            f" load_file, save_file; sd = load_file({str(files[0])!r}); {update}; save_file(sd, {str(out)!r},"
            f" metadata={{'format': 'pt'}})\"`, then init_from={str(out)!r}"
        )
    if src.kind == "safetensors":
        return f"convert only these tensors, each to the model's dtype, in the shard of {str(src.path)!r} that holds it: {casts}"
    first = "" if src.kind == "torch" else f"`{CONSOLIDATE.format(path=src.path)}`, then "
    path = src.path if src.kind == "torch" else Path("weights.pt")
    inner = f"['{src.entry}']" if src.kind == "torch" and src.entry else ""
    out = path.with_name(f"{path.stem}-converted.pt")
    return (
        f'convert only those tensors into a new file, e.g. {first}`python -c "import torch; sd = torch.load({str(path)!r},'
        f' weights_only=True){inner}; {update}; torch.save(sd, {str(out)!r})"`, then init_from={str(out)!r}'
    )


def _filled_otherwise(
    name: str, targets: Mapping[str, torch.Tensor], owners: Mapping[int, list[str]], reads: Mapping[str, Any], pairs: tuple[EMAPair, ...]
) -> bool:
    """A name the files do not hold but that still gets its value: a tied alias of a name they hold, or a tensor of
    an EMA teacher none of whose tensors are in them (it copies its student)."""
    if any(other in reads for other in owners.get(id(targets[name]), ())):
        return True
    for pair in pairs:
        if _under(name, pair.teacher) and not any(_under(n, pair.teacher) for n in reads):
            student = pair.student + name[len(pair.teacher) :]
            return student in reads or any(o in reads for o in owners.get(id(targets.get(student)), ()))
    return False


def _prefix_fix(src: WeightsFile, prefix: str, targets: Mapping[str, torch.Tensor]) -> str:
    """The module path under which the file's names would match, when there is one."""
    sample = next(iter(src.shapes), None)
    if sample is None:
        return ""
    for name in targets:
        if name.endswith("." + sample):
            candidate = name[: -len(sample) - 1]
            hits = sum(1 for k in src.shapes if f"{candidate}.{k}" in targets)
            if candidate != prefix and hits >= 0.9 * len(src.shapes):
                return f"init_from={{{candidate!r}: {str(src.path)!r}}}: the file's names are those of the submodule at {candidate!r}"
    stripped = [k.split(".", 1)[1] for k in src.shapes if "." in k]
    if stripped and sum(1 for k in stripped if (f"{prefix}.{k}" if prefix else k) in targets) >= 0.9 * len(src.shapes):
        outer = next(iter(src.shapes)).split(".", 1)[0]
        return f"the file's names carry an extra leading {outer!r}: save the submodule's own state_dict(), or load the file with that prefix stripped"
    return ""


def plan_everywhere(module: nn.Module, init_from: Mapping[str, str], ema_pairs: Iterable[EMAPair], gather: Callable[[Any], list[Any]]) -> InitPlan:
    """``plan_init_from`` on every rank, raising the same error on all of them if any rank fails (a file missing on
    one node must not leave the others waiting in the first collective)."""
    plan: InitPlan | None = None
    error: str | None = None
    try:
        plan = plan_init_from(module, init_from, ema_pairs)
    except Exception as exc:  # noqa: BLE001 - any failure, named on every rank: one rank raising alone hangs the others
        error = (
            str(exc)
            if isinstance(exc, AutoShardError)
            else f"init_from: {type(exc).__name__}: {exc}. Fix: make the init_from path(s) readable, whole, on every rank"
        )
    errors = gather(error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        ranks = [rank for rank, _ in failed]
        where = "" if len(failed) == len(errors) else f" (on rank(s) {', '.join(map(str, ranks))} only)"
        raise InitFromError(failed[0][1] + where)
    assert plan is not None
    return plan


# -- loading: each rank its own rows -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class InitReport:
    """What one rank read: a person sees it in the log, the tests check that no rank read the whole model."""

    tensors: int
    bytes_read: int
    bytes_total: int  # of the model's tensors the files fill, full size
    copied_teachers: tuple[str, ...]  # absent from the files: they copy their students (copy_students_into_teachers)
    seconds: float
    sources: tuple[str, ...]
    io_bytes: int | None = None  # what the OS counted this process reading meanwhile (Linux rchar; not mmap faults)
    casts: str = ""  # InitPlan.describe_casts(): the precision changes made (fp16 file into fp32 weights)

    def describe(self) -> str:
        teachers = f"; EMA teacher(s) {', '.join(self.copied_teachers)} start as copies of their students" if self.copied_teachers else ""
        share = self.bytes_read / self.bytes_total if self.bytes_total else 0.0
        casts = f"; {self.casts}" if self.casts else ""
        return (
            f"autoshard: init_from loaded {self.tensors} tensors from {', '.join(map(repr, self.sources))} into the shards:"
            f" this rank read {self.bytes_read / 2**20:.2f} MiB of {self.bytes_total / 2**20:.2f} MiB ({share:.0%}) in"
            f" {self.seconds:.2f} s{teachers}{casts}"
        )


def _local(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The tensor this rank holds and the slice of the full tensor it is (all of it for a plain tensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        shape, offset = in_torch.compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return t, tuple(slice(0, s) for s in t.shape)


@torch.no_grad()
def load_init_from(module: nn.Module, plan: InitPlan) -> InitReport:
    """Copy each rank's slice of every planned tensor into its shard; collective for DCP sources (every rank calls it)."""
    start, io_start = time.perf_counter(), _io_read()
    targets = _model_tensors(module)
    done: set[int] = set()
    nbytes = total = count = 0
    dcp: dict[int, tuple[WeightsFile, dict[str, torch.Tensor]]] = {}
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def handle(f: Path) -> Any:
            if f not in handles:
                handles[f] = stack.enter_context(open(f, "rb", buffering=0))
            return handles[f]

        for name, (src, key) in sorted(plan.reads.items()):
            tensor = targets[name]
            if id(tensor) in done:
                continue
            done.add(id(tensor))
            local, rows = _local(tensor.detach())
            total += tensor.numel() * tensor.element_size()
            count += 1
            if src.kind == "dcp":
                dcp.setdefault(id(src), (src, {}))[1][key] = tensor.detach()
                nbytes += local.numel() * local.element_size()
                continue
            if local.numel() == 0:
                continue
            if src.kind == "safetensors":
                stored = src.files[key]
                span = _contiguous_rows(rows, stored.shape)
                if span is not None and stored.dtype is not None and _PREAD:
                    # Shard(0) rows are one byte range: read it into the shard, or into a CPU buffer when dtypes differ
                    # or the shard is not in CPU memory (Lightning may have moved it to the GPU already).
                    direct = local.dtype == stored.dtype and local.is_contiguous() and local.device.type == "cpu"
                    buffer = local if direct else torch.empty(local.shape, dtype=stored.dtype)
                    nbytes += _read_into(handle(stored.file), stored.offset + span[0] * buffer.element_size(), buffer)
                    if not direct:
                        local.copy_(buffer)
                    continue
                from safetensors import safe_open  # another placement (Shard(1), tensor parallel): safetensors slices it

                with safe_open(str(stored.file), framework="pt", device="cpu") as f:
                    part = f.get_slice(key)[rows] if rows else f.get_tensor(key)
                    local.copy_(part.reshape(local.shape))
                nbytes += part.numel() * part.element_size()
                continue
            assert src.state is not None  # a torch file, memory-mapped: only the pages of these rows are touched
            part = src.state[key][rows] if rows else src.state[key]
            local.copy_(part.reshape(local.shape))
            nbytes += part.numel() * part.element_size()
    for src, wanted in dcp.values():
        from torch.distributed.checkpoint import FileSystemReader, load

        load({src.entry: wanted} if src.entry else wanted, storage_reader=FileSystemReader(str(src.path)))
    copied = [pair.teacher for pair in plan.copy_teachers]  # the strategy copies them next, students now loaded
    io_end = _io_read()
    io = io_end - io_start if io_start is not None and io_end is not None else None
    sources = tuple(str(src.path) for _, src in plan.sources)
    return InitReport(count, nbytes, total, tuple(copied), time.perf_counter() - start, sources, io, plan.describe_casts())


def _io_read() -> int | None:
    """Bytes this process has read through read syscalls (Linux /proc/self/io ``rchar``), or None elsewhere."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except (OSError, StopIteration, ValueError):
        return None
