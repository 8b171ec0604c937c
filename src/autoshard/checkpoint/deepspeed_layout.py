"""Everything autoshard knows about DeepSpeed's checkpoint files, in one place, pinned to the releases it was checked on.

A DeepSpeed checkpoint directory holds ``latest`` (the name of the tag DeepSpeed loads) and one directory per tag.
Under ZeRO-3 a tag holds, for each data-parallel rank R, ``zero_pp_rank_R_mp_rank_00_model_states.pt`` (buffers,
parameter shapes, Lightning's checkpoint as the client state) and ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``
(rank R's flat fp32 partition of every sub-group, with its optimizer state). Each parameter's slice on a rank is
``ceil(numel / world)`` elements, the last one zero-padded.

None of this is a DeepSpeed API: ``autoshard.privates.in_deepspeed`` lists the members it mirrors, with the releases
they were checked on, and tests/test_deepspeed_compat.py checks them and the partition rules against the installed
DeepSpeed. Importing this module imports no deepspeed.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from autoshard.privates.in_deepspeed import PIN, SUPPORTED_DEEPSPEED

# -- names ----------------------------------------------------------------------------------------------------------
LATEST = "latest"  # DeepSpeed's pointer to the tag directory it loads
LIGHTNING_TAG = "checkpoint"  # the tag Lightning's DeepSpeedStrategy saves under (convert writes it too)
LIGHTNING_PREFIX = "_forward_module."  # Lightning's wrapper around the LightningModule: every parameter name starts so
MODEL_FILES = "*mp_rank_*_model_states.pt"  # every tag directory holds one (ZeRO-3: one per rank)
ZERO12_MODEL_FILES = "mp_rank_*_model_states.pt"  # ZeRO stage 1/2: one model_states file, whole parameters
ZERO3_MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")  # groups: data-, model-parallel rank
ZERO3_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
BF16_PREFIX = "bf16_"  # DeepSpeed's bf16 mode names its optimizer files so, and looks for that name only
NVME_SWAP_DIR = "offloaded_tensors"  # NVMe-offloaded optimizer state: swap files only the writing engine reads
RECOVERY_SCRIPT = "zero_to_fp32.py"  # DeepSpeed copies it beside every checkpoint (deepspeed/utils/zero_to_fp32.py)
_WRITER = re.compile(r"zero_pp_rank_(\d+)_")

# What DeepSpeed's engine writes into a model_states file besides the client state (Lightning's checkpoint):
# DeepSpeedEngine._common_checkpoint_state, plus what _save_checkpoint and other releases add around it.
ENGINE_KEYS = frozenset(
    {
        "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
        "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
        "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
        "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info",
        "ds_autoep_layers", "autoep_layers",
    }
)  # fmt: skip
# The DeepSpeed types its files pickle: what torch.load(weights_only=True) must be allowed to build to read them
# (autoshard.checkpoint.TRUSTED_TYPES), found by loading real files (tests/test_bad_inputs_reads.py, one test each).
PICKLED_TYPES: tuple[str, ...] = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",  # every ZeRO optimizer file: the static scale of bf16/fp32 runs
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",  # ... and of fp16 runs, dynamic
    "deepspeed.runtime.zero.config.ZeroStageEnum",  # every ZeRO optimizer file: zero_stage
    "deepspeed.utils.tensor_fragment.fragment_address",  # ZeRO-1/2 optimizer files: param_slice_mappings
)
SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's (and autoshard's) default zero_optimization.sub_group_size


def model_states_name(rank: int, mp_rank: int = 0) -> str:
    """Rank ``rank``'s ZeRO-3 model_states file (``DeepSpeedEngine._get_ckpt_name``)."""
    return f"zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_model_states.pt"


def optim_states_name(rank: int, bf16: bool, mp_rank: int = 0) -> str:
    """Rank ``rank``'s ZeRO optimizer file (``DeepSpeedEngine._get_rank_zero_ckpt_name``): ``bf16_`` under bf16."""
    return f"{BF16_PREFIX if bf16 else ''}zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def writer_rank(name: str) -> int:
    """The rank that wrote a file of a DeepSpeed checkpoint (``zero_pp_rank_R_...``: rank R's partition); 0 for the
    rest (rank 0 writes ``latest``, the shared model states and zero_to_fp32.py)."""
    found = _WRITER.search(name)
    return int(found.group(1)) if found else 0


# -- a checkpoint directory -----------------------------------------------------------------------------------------
def tags(path: Path) -> list[str]:
    """The tag directories of a DeepSpeed checkpoint (those holding model states), oldest first."""
    subs = [sub for sub in path.iterdir() if sub.is_dir() and any(sub.glob(MODEL_FILES))]
    return [sub.name for sub in sorted(subs, key=lambda sub: (sub.stat().st_mtime, sub.name))]


def latest_tag(path: Path) -> str:
    """What DeepSpeed's ``latest`` file names ("" when there is none): the tag DeepSpeed itself loads."""
    latest = path / LATEST
    return latest.read_text().strip() if latest.is_file() else ""


def layout(path: Path) -> tuple[str | None, str] | None:
    """(tag, detail) of a DeepSpeed ZeRO checkpoint directory, or None when ``path`` is not one. The tag is None
    when ``latest`` does not settle it (it names a missing tag, or is absent beside several): never a guess."""
    named = latest_tag(path)
    if named and (path / named).is_dir():
        return named, f"a DeepSpeed ZeRO checkpoint (tag '{named}')"
    found = tags(path)
    if not found and not (path / LATEST).is_file():
        return None
    if not named and len(found) == 1:
        return found[0], f"a DeepSpeed ZeRO checkpoint (tag '{found[0]}')"
    present = f"tags present: {', '.join(found)}" if found else "no tag directory with model states is"
    if named:
        return None, f"a DeepSpeed ZeRO checkpoint whose 'latest' names tag '{named}', which is not there ({present})"
    return None, f"a DeepSpeed ZeRO checkpoint without a 'latest' naming one of its tags ({present})"


def zero3_world_size(path: Path, tag: str) -> int | None:
    """The ranks a ZeRO-3 tag directory was written for (one model_states file each); None for ZeRO-1/2 layouts.
    DeepSpeed's engine loads one optimizer file per rank of the resuming run (``_get_all_zero_checkpoint_names``)."""
    ranks = {int(m.group(1)) for f in (path / tag).iterdir() if (m := ZERO3_MODEL_FILE.match(f.name))}
    return len(ranks) or None


def recovery_script(deepspeed_file: str) -> Path:
    """zero_to_fp32.py of the deepspeed package whose ``__file__`` is given (``_copy_recovery_script`` copies it)."""
    return Path(deepspeed_file).parent / "utils" / RECOVERY_SCRIPT


# -- ZeRO-3 partitions ----------------------------------------------------------------------------------------------
def partition_numel(numel: int, world: int) -> int:
    """Elements of one parameter per rank under ZeRO-3: DeepSpeed pads the last rank's slice
    (zero_to_fp32's ``zero3_partitioned_param_info``)."""
    return math.ceil(numel / world)


def rank_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s ZeRO-3 partition of ``t``, flat, zero-padded at the end."""
    flat = t.reshape(-1)
    part = partition_numel(flat.numel(), world)
    piece = flat[rank * part : (rank + 1) * part]
    if piece.numel() < part:
        piece = torch.cat([piece, piece.new_zeros(part - piece.numel())])
    return piece


def sub_groups(names: list[str], numels: Mapping[str, int], world: int, sub_group_size: int = SUB_GROUP_SIZE) -> list[list[str]]:
    """How ZeRO-3 splits one parameter group into flat sub-groups (``DeepSpeedZeroOptimizer_Stage3
    ._create_fp16_sub_groups``): consecutive parameters until their partitions reach sub_group_size."""
    total = sum(partition_numel(numels[n], world) for n in names)
    if sub_group_size >= total:
        return [names]
    out, current, size = [], [], 0
    for name in names:
        current.append(name)
        size += partition_numel(numels[name], world)
        if size >= sub_group_size or name == names[-1]:
            out.append(current)
            current, size = [], 0
    return out


# -- the releases this was checked on -------------------------------------------------------------------------------
def installed_version() -> str | None:
    """The installed deepspeed's version, read from its metadata (no import), or None."""
    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def check_version(version: str | None = None) -> None:
    """Warn, once per version, when the installed DeepSpeed (or ``version``) is outside SUPPORTED_DEEPSPEED: its
    files may be laid out otherwise. A warning, not an error: a newer release may well keep the layout."""
    found = version or installed_version()
    if found is None:
        return
    try:
        inside = SpecifierSet(SUPPORTED_DEEPSPEED).contains(Version(found), prereleases=True)
    except InvalidVersion:
        inside = False
    if not inside:
        warnings.warn(
            f"autoshard reads and writes DeepSpeed checkpoint files as deepspeed {SUPPORTED_DEEPSPEED} lays them out"
            f" (file names, ZeRO-3 partitions, keys); found deepspeed {found}. If a DeepSpeed checkpoint fails to"
            f" convert, consolidate or resume, {PIN}",
            stacklevel=3,
        )
