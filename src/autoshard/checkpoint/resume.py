"""The one reader, from a path to a complete checkpoint: ``locate_checkpoint`` (the format, or the complete checkpoint
an interrupted save left, or the refusal with the fix), the manifest check, the DeepSpeed tag. ``open_checkpoint``
runs the three for convert and consolidate; a resume runs ``resolve_for_load`` on rank 0, then every rank checks its
share of the manifest (``saves.verify_on_every_rank``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Collection, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from autoshard.backends import get_backend
from autoshard.capability import Format
from autoshard.checkpoint import deepspeed_layout
from autoshard.checkpoint.formats import BUDGET_KEY, LIGHTNING_META, STATE_KEY, CheckpointInfo, describe, detect_format
from autoshard.checkpoint.publish import (
    DIGEST,
    MANIFEST,
    aside_path,
    fsync_dir,
    integrity_problems,
    listing,
    orphan_sidecar,
    sidecar_path,
    staged_siblings,
    unverified_warning,
)
from autoshard.checkpoint.readers import saved_shapes
from autoshard.checkpoint.trust import CheckpointFormatError, UntrustedPickleError, load_torch_file

CONSOLIDATE = "autoshard consolidate {path} weights.pt"

RESUME = "resume"  # the action of a Lightning resume: its refusals name the backend and say how to resume instead


def interrupted_save(path: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint an interrupted save left beside ``path`` (the newest first), or None. A staged
    directory counts once its last file is in (DCP: meta.pt; DeepSpeed: the manifest); a staged file never does (it
    may be torn); what stands aside was committed before, so it is complete."""
    aside = aside_path(path)
    for staged in staged_siblings(path):  # newest first
        if staged.is_dir() and not staged.is_symlink():
            info = detect_format(staged)
            if info.format is Format.DCP or (info.format is Format.DEEPSPEED and (staged / MANIFEST).is_file()):
                return staged
    if (aside.exists() or aside.is_symlink()) and detect_format(aside).complete:
        return aside
    return None


def checkpoints_inside(path: Path) -> list[str]:
    """Complete checkpoints directly inside a directory: the usual mistake is passing ModelCheckpoint's dirpath."""
    if not path.is_dir():
        return []
    return sorted(
        c.name
        for c in path.iterdir()
        if not c.name.startswith(".") and (c.is_dir() or c.suffix == ".ckpt") and detect_format(c, verify=False).complete
    )


def pick_one(path: Path) -> str:
    """The fix for a path that is not a checkpoint: the checkpoints inside it, when it is their directory."""
    inside = checkpoints_inside(path)
    if inside:
        shown = ", ".join(inside[:3]) + (", ..." if len(inside) > 3 else "")
        return f"it holds checkpoints ({shown}): pass one of them, e.g. {str(path / inside[-1])!r}"
    return "pass the .ckpt path ModelCheckpoint printed (e.g. checkpoints/last.ckpt)"


def _complete(path: Path) -> bool:
    try:
        return detect_format(path).complete  # .metadata read too: a torn sibling is no fix either
    except CheckpointFormatError:
        return False


def earlier_checkpoint(path: Path, action: str) -> str:
    """The fix for an incomplete checkpoint: a complete one beside it, by name, where there is one."""
    others = [name for name in checkpoints_inside(path.parent) if name != path.name and _complete(path.parent / name)]
    if others:
        return f"{action} an earlier complete checkpoint, e.g. {str(path.parent / others[-1])!r}"
    return f"{action} an earlier complete checkpoint, or restore this one from a backup"


def _consolidate_fix(path: Path) -> str:
    return (
        f"convert the weights with `{CONSOLIDATE.format(path=path)}`, then model.load_state_dict(torch.load('weights.pt'))"
        f" before trainer.fit(model) without ckpt_path (weights carry over; optimizer state and step counters restart)"
    )


def locate_checkpoint(
    path: str | os.PathLike[str],
    action: str,
    *,
    error: type[CheckpointFormatError] = CheckpointFormatError,
    backend: str = "fsdp2",
    stacklevel: int = 2,
) -> CheckpointInfo:
    """What ``path`` holds, as a complete checkpoint, or the refusal with the fix: a save interrupted between its two
    renames leaves ``path`` missing and a complete sibling, taken with a warning. ``action`` words both ("convert",
    "consolidate", or RESUME, for which ``backend`` is the one resuming)."""
    info = detect_format(path)
    if info.complete:
        return info
    recovered = interrupted_save(info.path) if info.format is not Format.UNKNOWN else None
    if recovered is None:
        raise _not_readable(info, action, error, backend)
    if action == RESUME:
        said = (
            f"{describe(info)}; a save to it was interrupted and left the complete checkpoint {str(recovered)!r},"
            f" which is loaded instead. The next save to {str(info.path)!r} puts it back in place"
        )
    else:
        said = f"{describe(info)}; {action.removesuffix('e')}ing the complete checkpoint an interrupted save left: {str(recovered)!r}"
    warnings.warn(said, stacklevel=stacklevel + 1)
    return detect_format(recovered)


def _not_readable(info: CheckpointInfo, action: str, error: type[CheckpointFormatError], backend: str) -> CheckpointFormatError:
    """The refusal of a path that holds no complete checkpoint (and no interrupted save left one beside it)."""
    p = info.path
    if action != RESUME:
        if info.format is Format.INCOMPLETE:
            return error(f"cannot {action}: {describe(info)}. Fix: {earlier_checkpoint(p, action)}")
        return error(f"cannot {action}: {describe(info)}, so it is not a checkpoint. Fix: {pick_one(p)}")
    if info.format is Format.MISSING:
        partial = staged_siblings(p)
        why = f" (the first save to it was interrupted: {str(partial[0])!r} is partial)" if partial else ""
        return error(f"cannot resume: {describe(info)}{why}. Fix: pass the path of an existing checkpoint (a .ckpt directory or file)")
    if info.format is Format.INCOMPLETE:
        return error(
            f"cannot resume: {describe(info)}. autoshard never leaves a partial save under the final name, so this one"
            f" was written without autoshard or copied partially. Fix: {earlier_checkpoint(p, 'resume from')}"
        )
    return error(
        f"cannot resume: {describe(info)}, so it is not a checkpoint. {backend} resumes from a directory written by"
        f" torch.distributed.checkpoint with Lightning's meta.pt, or from one torch.save file. Fix: {pick_one(p)}"
    )


def resolve_for_load(path: str | os.PathLike[str], backend: str = "fsdp2", world_size: int | None = None) -> Path:
    """The path to load for ``backend``, or CheckpointFormatError before anything is loaded. ``world_size`` (the
    resuming run's) is checked against ZeRO-3 partitions, which DeepSpeed cannot reshard."""
    info = locate_checkpoint(path, RESUME, backend=backend)
    p = info.path
    resumes = get_backend(backend).resumes
    if info.format is Format.DEEPSPEED and Format.DEEPSPEED not in resumes:
        raise CheckpointFormatError(
            f"cannot resume with {backend}: {describe(info)}. {backend} cannot read DeepSpeed's partitioned files;"
            f" backend that reads it: DeepSpeed (strategy='autoshard-deepspeed', the strategy that wrote it). Fix: resume"
            f" with that strategy; or convert it, optimizer state, step and schedulers included, with `autoshard convert"
            f" {p} {p}-fsdp2 --to dcp` and resume from {str(p) + '-fsdp2'!r}; or {_consolidate_fix(p)}"
        )
    if info.format in (Format.DCP, Format.DCP_RAW) and Format.DCP not in resumes:
        raise CheckpointFormatError(
            f"cannot resume with DeepSpeed: {describe(info)}, written by fsdp2 (torch.distributed.checkpoint)."
            f" Backend that reads it: fsdp2 (strategy='fsdp2', at any world size). Fix: resume with strategy='fsdp2';"
            f" or convert it, optimizer state, step and schedulers included, with `autoshard convert {p} {p}-deepspeed"
            f" --to deepspeed --world-size N --precision P` (devices x nodes, the Trainer's precision) and resume from"
            f" {str(p) + '-deepspeed'!r}; or {_consolidate_fix(p)}"
        )
    if info.format is Format.DEEPSPEED:
        _check_deepspeed_resume(info, world_size)
    if info.format is Format.DCP_RAW:
        raise CheckpointFormatError(
            f"cannot resume: {describe(info)}: it holds tensors but no Lightning trainer state (loops, callbacks),"
            f" so it was written by torch.distributed.checkpoint directly. Fix: {_consolidate_fix(p)}"
        )
    if info.format is Format.FULL:
        _check_full_file(p)
    return p


def _check_deepspeed_resume(info: CheckpointInfo, world_size: int | None) -> None:
    """DeepSpeed loads the tag ``latest`` names, one ZeRO-3 partition file per rank: say so before it fails."""
    p = info.path
    deepspeed_layout.check_version()
    tags = deepspeed_layout.tags(p)
    if info.tag is None or deepspeed_layout.latest_tag(p) != info.tag:
        tag = info.tag or (tags[-1] if tags else "TAG")
        raise CheckpointFormatError(
            f"cannot resume: {describe(info)}. DeepSpeed resumes the tag its 'latest' file names, and autoshard never"
            f" picks another. Fix: write the tag to resume into it, e.g. `echo {tag} > {str(p / deepspeed_layout.LATEST)!r}`"
            f"{' (the newest tag)' if tags and tag == tags[-1] else ''}"
        )
    saved = deepspeed_layout.zero3_world_size(p, info.tag)
    if world_size is not None and saved is not None and saved != world_size:
        out = f"{p}-world{world_size}"
        raise CheckpointFormatError(
            f"cannot resume: {describe(info)}, whose ZeRO-3 partitions are for {saved} ranks (zero_pp_rank_0 ..."
            f" zero_pp_rank_{saved - 1}), and this run has {world_size} (devices x nodes). DeepSpeed loads one partition"
            f" file per rank and cannot reshard them. Fix: `autoshard convert {p} {out} --to deepspeed --world-size"
            f" {world_size}` and resume from {out!r} (optimizer state, step and schedulers included); or resume with"
            f" devices x nodes = {saved}"
        )


def _check_full_file(path: Path) -> None:
    """A bare state dict (what consolidate writes) is weights, not a Lightning checkpoint: say how to use it; a
    truncated file is named here rather than in Lightning's traceback."""
    try:
        loaded = load_torch_file(path, action="resume")
    except UntrustedPickleError:  # custom objects inside: Lightning's own loader judges them, as it always did
        return
    if not isinstance(loaded, Mapping):
        return
    keys = set(loaded)
    if "state_dict" not in keys:
        shown = ", ".join(sorted(map(str, keys))[:4])
        raise CheckpointFormatError(
            f"cannot resume: {str(path)!r} is a torch.save file without 'state_dict' (keys: {shown}, ...): weights only,"
            f" such as `autoshard consolidate` writes, not a Lightning checkpoint. Fix: model.load_state_dict(torch.load"
            f"({str(path)!r})) before trainer.fit(model), without ckpt_path"
        )


def finish_interrupted_commit(path: str | os.PathLike[str]) -> Path | None:
    """Before a new save (rank 0): put back under ``path`` the complete sibling a crash between two renames left."""
    p = Path(path)
    staged_sidecar = orphan_sidecar(p) if p.is_file() else None
    if staged_sidecar is not None:
        os.replace(staged_sidecar, sidecar_path(p))  # the file was swapped in, its sidecar not yet
        fsync_dir(p.parent)
    if p.exists() or p.is_symlink():
        return None
    recovered = interrupted_save(p)
    if recovered is not None:
        os.rename(recovered, p)
        fsync_dir(p.parent)
    return recovered


def reshaped_names(saved: Mapping[str, tuple[int, ...] | None], model: Mapping[str, tuple[int, ...]]) -> list[str]:
    """The names both hold, saved with another shape (a load with strict=False still fails on them)."""
    return sorted(k for k in set(model) & set(saved) if saved[k] is not None and tuple(saved[k] or ()) != tuple(model[k]))


def model_mismatch(saved: Mapping[str, tuple[int, ...] | None], model: Mapping[str, tuple[int, ...]]) -> str | None:
    """How a model's state dict differs from a checkpoint's: missing and unexpected names, other shapes; None if equal."""
    missing = sorted(set(model) - set(saved))
    unexpected = sorted(set(saved) - set(model))
    reshaped = reshaped_names(saved, model)
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing from the checkpoint: {listing(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} in the checkpoint but not in the model: {listing(unexpected)}")
    if reshaped:
        shown = [f"{k} (checkpoint {tuple(saved[k] or ())}, model {tuple(model[k])})" for k in reshaped]
        parts.append(f"{len(reshaped)} with another shape: {listing(shown, 3)}")
    return "; ".join(parts) or None


def weights_refusal(
    path: Path, model_name: str, saved: Mapping[str, tuple[int, ...] | None], model: Mapping[str, tuple[int, ...]], strict: bool = True
) -> CheckpointFormatError | None:
    """The refusal of a resume whose saved weights differ from the model (missing and unexpected names under
    ``strict``, another shape always), in one set of words for a DCP directory and a full file; None if they match."""
    reshaped = reshaped_names(saved, model)
    mismatch = model_mismatch(saved, model) if strict or reshaped else None
    if mismatch:
        # strict=False skips missing and unexpected names only: a tensor of another shape still fails, so it is left out.
        load = (
            "model.load_state_dict(torch.load('weights.pt'), strict=False)"
            if not reshaped
            else "sd = model.state_dict(); model.load_state_dict({k: v for k, v in torch.load('weights.pt').items() if k in sd"
            " and v.shape == sd[k].shape}, strict=False)"
        )
        skipped = (
            f" (strict=False skips missing and unexpected names only; this leaves out the {len(reshaped)} tensor(s) of"
            f" another shape, {listing(reshaped, 3)}, which keep their initial values)"
            if reshaped
            else ""
        )
        return CheckpointFormatError(
            f"cannot resume from {str(path)!r}: its model weights do not match this {model_name}: {mismatch}."
            f" Fix: resume from a checkpoint of this model, or to start from the weights that match, run"
            f" `{CONSOLIDATE.format(path=path)}`, then {load} before trainer.fit(model) without ckpt_path{skipped}"
        )
    return None


WEIGHTS_ONLY_MISSING = ("lr_schedulers", "optimizer_states", "callbacks")  # what Lightning's weights_only dump leaves out


def weights_only_refusal(path: Path, keys: Collection[str]) -> CheckpointFormatError | None:
    """A Lightning checkpoint saved with weights only (its loops, no optimizer, scheduler or callback state) cannot
    resume a fit, which restores them all: said with what it lacks and how to start from its weights instead. ``keys``:
    its top-level keys (a DCP directory's meta.pt, whose optimizer states are shards, has neither)."""
    if "loops" not in keys or "lr_schedulers" in keys:
        return None
    lacks = [k for k in WEIGHTS_ONLY_MISSING if k not in keys]
    return CheckpointFormatError(
        f"cannot resume from {str(path)!r}: it was saved with weights only (ModelCheckpoint(save_weights_only=True),"
        f" or trainer.save_checkpoint(path, weights_only=True)), so it holds the model's weights and the loops' progress"
        f" but not {', '.join(map(repr, lacks))}: no optimizer state, learning-rate schedulers or callback states, which"
        f" a resume (trainer.fit(..., ckpt_path=...)) restores. Fix: to start from its weights, pass"
        f" strategy=FSDP2Strategy(init_from={str(path)!r}) (or ShardingIntent(init_from=...)) and fit without"
        f" ckpt_path: the optimizer state and step counters restart; to resume exactly, save without save_weights_only"
    )


def load_failure(path: Path, model_name: str, model: Mapping[str, tuple[int, ...]], failures: Mapping[int, Any]) -> CheckpointFormatError:
    """torch's CheckpointException (a BaseException) as an autoshard error: which keys differ, or what failed where."""
    try:
        refusal = weights_refusal(path, model_name, saved_shapes(path), model)
    except Exception:  # noqa: BLE001 - .metadata unreadable: report torch's failure below
        refusal = None
    if refusal is not None:
        return refusal
    ranks = ", ".join(map(str, sorted(failures)))
    first = next(iter(failures.values()), None)
    error = first[0] if isinstance(first, tuple) else first
    what = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}" if error else "no detail"
    return CheckpointFormatError(
        f"cannot resume from {str(path)!r}: torch.distributed.checkpoint failed on rank(s) {ranks}: {what}."
        f" Fix: resume with the LightningModule and the optimizers (configure_optimizers) that wrote this checkpoint"
    )


def open_checkpoint(
    path: str | os.PathLike[str], action: str, *, tag: str | None = None, error: type[CheckpointFormatError] = CheckpointFormatError
) -> CheckpointInfo:
    """The one reader for a command that reads a whole checkpoint in one process (``action``: convert, consolidate):
    located, checked against its manifest, its DeepSpeed tag settled (``tag``, else ``latest``'s, never another)."""
    info = locate_checkpoint(path, action, error=error, stacklevel=3)
    if not check_integrity(info.path):
        warnings.warn(unverified_warning(info.path), stacklevel=3)
    if info.format is Format.DEEPSPEED:
        info = replace(info, tag=deepspeed_tag(info, tag, action))
    elif tag is not None:
        raise error(f"cannot {action} with --tag {tag!r}: {describe(info)}, which has no tags (DeepSpeed checkpoints have). Fix: drop --tag")
    return info


def deepspeed_tag(info: CheckpointInfo, tag: str | None, action: str) -> str:
    """``tag`` if it is one, else the one ``latest`` names; refused otherwise: another tag than the user meant would
    convert other weights without a word."""
    p = info.path
    tags = deepspeed_layout.tags(p)
    present = f"its tags: {', '.join(tags)}" if tags else "it holds no tag directory with model states"
    newest = " (the newest)" if len(tags) > 1 else ""
    if tag is not None:
        if tag in tags:
            return tag
        named = deepspeed_layout.latest_tag(p)
        latest = f"; 'latest' names {named!r}" if named else ""
        instead = ", or leave --tag out to read the tag 'latest' names" if info.tag is not None else ""
        choose = f"--tag {tags[-1]}{newest}{instead}" if tags else "copy the whole checkpoint directory again"
        raise CheckpointFormatError(f"cannot {action} {str(p)!r} with --tag {tag!r}: no such tag directory ({present}{latest}). Fix: {choose}")
    if info.tag is not None:
        return info.tag
    choose = (
        f"pass --tag with the one you mean, e.g. --tag {tags[-1]}{newest}, or write its name into {str(p / deepspeed_layout.LATEST)!r}"
        if tags
        else "copy the whole checkpoint directory again"
    )
    raise CheckpointFormatError(f"cannot {action}: {describe(info)}; autoshard reads the tag 'latest' names and never guesses another. Fix: {choose}")


def stored_budget_decision(path: Any, trust_pickle: bool = False) -> dict[str, Any] | None:
    """The memory-budget decision a checkpoint holds, or None, read cheaply before anything is sharded (a DCP
    directory's meta.pt, a full file, a DeepSpeed tag's rank-0 ``client_state``); anything else is left to the load,
    which refuses it in words."""
    info = detect_format(path, verify=False)
    if info.format is Format.DCP:
        file = info.path / LIGHTNING_META
    elif info.format is Format.FULL:
        file = info.path
    elif info.format is Format.DEEPSPEED and info.tag is not None:
        file = info.path / info.tag / deepspeed_layout.model_states_name(0)
        if not file.is_file():
            return None
    else:
        return None
    loaded = load_torch_file(file, action="resume", trust_pickle=trust_pickle)
    extra = loaded.get(STATE_KEY) if isinstance(loaded, Mapping) else None
    stored = extra.get(BUDGET_KEY) if isinstance(extra, Mapping) else None
    return dict(stored) if isinstance(stored, Mapping) else None


def corrupted(path: str | os.PathLike[str], problems: list[str]) -> CheckpointFormatError:
    """The refusal for a checkpoint whose files differ from what the save recorded."""
    return CheckpointFormatError(
        f"{str(path)!r} is corrupted: {'; '.join(problems)}. autoshard recorded every file's {DIGEST} when it saved"
        f" this checkpoint, so loading it would bring back different weights or state without an error."
        f" Fix: restore the checkpoint from a backup, or use the previous checkpoint"
    )


def check_integrity(path: str | os.PathLike[str]) -> bool:
    """Every file of ``path`` against its manifest, in this process; False when there is none (the caller warns)."""
    problems = integrity_problems(path)
    if problems:
        raise corrupted(path, problems)
    return problems is not None
