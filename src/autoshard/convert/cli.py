"""``autoshard convert SRC DST --to dcp|deepspeed|safetensors``: the command line around ``convert``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TextIO

from autoshard.consolidate import add_writer_flags, command_parser
from autoshard.convert.pipeline import TARGETS, ConvertOptions, convert
from autoshard.convert.safetensors import MAX_SHARD_SIZE


def cmd_convert(args: argparse.Namespace, stream: TextIO | None = None) -> int:
    """``autoshard convert SRC DST --to ...``: progress on stderr, the summary (or --json) on ``stream`` (stdout)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # this process only converts: DeepSpeed needs no accelerator here

    def progress(line: str) -> None:
        print(f"autoshard convert: {line}", file=sys.stderr, flush=True)

    result = convert(
        args.src,
        args.dst,
        args.to,
        ConvertOptions(
            world_size=args.world_size,
            tag=args.tag,
            frozen=args.frozen or (),
            max_shard_size=args.max_shard_size,
            module=args.module,
            precision=args.precision,
            force=args.force,
            progress=None if args.quiet else progress,
            trust_pickle=args.trust_pickle,
        ),
    )
    print(json.dumps(result.to_json(), indent=1) if args.json else result.describe(), file=stream or sys.stdout)
    return 0


HELP = "convert a checkpoint between DeepSpeed ZeRO-3 and fsdp2 (DCP), optimizer state included, or to safetensors"


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``autoshard convert SRC DST --to dcp|deepspeed|safetensors`` to the ``autoshard`` command."""
    description = (
        "Rewrite a checkpoint for another backend: a DeepSpeed ZeRO-3 checkpoint becomes a DCP directory that"
        " strategy='fsdp2' resumes (Trainer.fit(ckpt_path=DST)) at any world size, and back (--world-size N --precision P);"
        " weights, every parameter's optimizer state, step counts, LR schedulers and Lightning's loop state move"
        " with it. --to safetensors writes Hugging Face weights. One CPU process; DST is written beside itself and"
        " renamed into place when complete."
    )
    parser = command_parser(subparsers, "convert", HELP, description)
    parser.add_argument("src", metavar="SRC", help="the checkpoint: a DeepSpeed or DCP directory, or a full .ckpt file")
    parser.add_argument("dst", metavar="DST", help="the directory to write (must not exist, unless --force)")
    parser.add_argument(
        "--to",
        required=True,
        choices=TARGETS,
        help="dcp: for strategy='fsdp2'; deepspeed: for 'autoshard-deepspeed'; safetensors: Hugging Face weights",
    )
    parser.add_argument("--world-size", type=int, default=None, help="deepspeed only: ranks of the resuming run (default: the source's)")
    parser.add_argument(
        "--precision",
        default=None,
        help="deepspeed only: the resuming Trainer's precision, e.g. bf16-mixed or 32-true (default: the source's, when DeepSpeed)",
    )
    parser.add_argument("--tag", default=None, help="DeepSpeed source only: the tag directory (default: the one in 'latest')")
    parser.add_argument(
        "--frozen",
        action="append",
        metavar="NAME",
        help="deepspeed only: a parameter (or module path) outside the optimizer that is not a buffer; repeatable",
    )
    parser.add_argument(
        "--max-shard-size", default=MAX_SHARD_SIZE, help=f"safetensors only: split above this size (default {MAX_SHARD_SIZE}, like Hugging Face)"
    )
    parser.add_argument(
        "--module", default=None, metavar="PATH", help="safetensors only: the submodule to write, named as it names its weights (e.g. model)"
    )
    force = "replace DST if it is an output of convert --to the same target, holding nothing else (only once the new one is complete)"
    add_writer_flags(parser, force, "SRC", "a checkpoint")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.set_defaults(func=cmd_convert)
