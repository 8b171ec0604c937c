"""The ``autoshard`` command: one small function per subcommand, so new ones (explain, consolidate) slot in."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from autoshard import __version__
from autoshard.capability import FORMATS, render_matrix
from autoshard.errors import AutoShardError


def cmd_matrix(args: argparse.Namespace) -> int:
    """Print the capability matrix: which backend runs which feature, and with --details why not."""
    print(render_matrix(args.format, details=args.details))
    return 0


def add_matrix(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "matrix",
        help="show which backend supports which feature",
        description="Show the capability matrix: fsdp2, deepspeed_zero3 and fsdp1 against every feature.",
    )
    parser.add_argument("--format", choices=FORMATS, default="text", help="table format (default: text)")
    parser.add_argument("--details", action="store_true", help="add the reason and the fix for every cell that is not 'yes'")
    parser.set_defaults(func=cmd_matrix)


def build_parser() -> argparse.ArgumentParser:
    """The parser with every subcommand; a new subcommand is one ``add_<name>(subparsers)`` line here."""
    parser = argparse.ArgumentParser(
        prog="autoshard",
        description="Ask for sharded training once; autoshard picks FSDP2 or DeepSpeed ZeRO-3, or tells you why not.",
    )
    parser.add_argument("--version", action="version", version=f"autoshard {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_matrix(subparsers)
    from autoshard import checkpoint, explain

    explain.register_cli(subparsers)
    checkpoint.register_cli(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; an autoshard refusal prints its message (not a traceback) and exits 1."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except AutoShardError as exc:
        print(f"autoshard: error: {exc}", file=sys.stderr)
        return 1
