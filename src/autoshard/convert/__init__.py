"""``autoshard convert SRC DST --to dcp|deepspeed|safetensors``: move a run between backends, optimizer state included.

A DeepSpeed ZeRO-3 checkpoint keeps each rank's slice of every parameter, fp32 master weight and optimizer moment
in flat per-rank buffers; a DCP checkpoint keeps them per parameter name. Both are read into one neutral, in-memory
``TrainingState`` (full tensors by parameter name, optimizer state per parameter, Lightning's trainer state), and
written in the other layout, so ``Trainer.fit(ckpt_path=DST)`` resumes with the other backend, at any world size.

Everything runs in one CPU process; memory is the full weights plus optimizer state.
"""

from __future__ import annotations

from autoshard.convert.cli import HELP, cmd_convert, register_cli
from autoshard.convert.dcp import read_dcp, write_dcp
from autoshard.convert.deepspeed import read_deepspeed, write_deepspeed
from autoshard.convert.output import RECORD, beside, check_output, output_kind
from autoshard.convert.pipeline import RESUME_HINT, TARGETS, Converted, ConvertOptions, convert, read_checkpoint
from autoshard.convert.safetensors import MAX_SHARD_SIZE, parse_size, write_safetensors
from autoshard.convert.state import ConvertError, OptimizerState, TrainingState, tied_aliases
from autoshard.convert.torch_file import read_full

__all__ = [
    "HELP",
    "MAX_SHARD_SIZE",
    "RECORD",
    "RESUME_HINT",
    "TARGETS",
    "ConvertError",
    "ConvertOptions",
    "Converted",
    "OptimizerState",
    "TrainingState",
    "beside",
    "check_output",
    "cmd_convert",
    "convert",
    "output_kind",
    "parse_size",
    "read_checkpoint",
    "read_dcp",
    "read_deepspeed",
    "read_full",
    "register_cli",
    "tied_aliases",
    "write_dcp",
    "write_deepspeed",
    "write_safetensors",
]
