"""The ``autoshard`` command: one small function per subcommand, so new ones (explain, consolidate) slot in.

``--version``, ``--help`` and ``matrix`` import neither torch nor Lightning, so they answer at once: the
subcommands whose modules import torch are listed by name and built only when chosen.
"""

from __future__ import annotations

import argparse
import json
import importlib
import sys
from collections.abc import Container, Sequence

from autoshard import __version__
from autoshard.backends.matrix import FORMATS, render_matrix
from autoshard.errors import AutoShardError

# Subcommand -> (the module whose ``register_cli`` builds it, its one-line help for ``autoshard --help``).
# tests/test_cli.py checks that each help line here is the one register_cli gives.
LAZY: dict[str, tuple[str, str]] = {
    "explain": ("autoshard.explain", "show what autoshard would do with a module: needs, backend, plan, memory per rank"),
    "consolidate": ("autoshard.consolidate", "turn a sharded (DCP or DeepSpeed) checkpoint into one torch.save file of full weights"),
    "convert": ("autoshard.convert", "convert a checkpoint between DeepSpeed ZeRO-3 and fsdp2 (DCP), optimizer state included, or to safetensors"),
}


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
    parser.add_argument("--format", choices=FORMATS, default="text", help="output format (default: text)")
    parser.add_argument(
        "--json", dest="format", action="store_const", const="json", help="the same as --format json: every cell with its reason and fix"
    )
    parser.add_argument("--details", action="store_true", help="add the reason and the fix for every cell that is not 'yes'")
    parser.set_defaults(func=cmd_matrix)


def build_parser(load: Container[str] = tuple(LAZY)) -> argparse.ArgumentParser:
    """The parser with every subcommand; a new subcommand is one ``add_<name>(subparsers)`` line here.

    Of the LAZY subcommands only those in ``load`` are built in full (their module imported); the others appear in
    ``--help`` with their one-line help and cannot be parsed.
    """
    parser = argparse.ArgumentParser(
        prog="autoshard",
        description="Ask for sharded training once; autoshard picks FSDP2 or DeepSpeed ZeRO-3, or tells you why not.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"autoshard {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_matrix(subparsers)
    for name, (module, summary) in LAZY.items():
        if name in load:
            importlib.import_module(module).register_cli(subparsers)
        else:
            subparsers.add_parser(name, help=summary)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; an autoshard refusal prints its message (not a traceback) and exits 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)  # the top level has options without values only
    args = build_parser(load={command}).parse_args(argv)
    try:
        return args.func(args)
    except AutoShardError as exc:
        if getattr(args, "json", False):  # --json: stdout is one object whatever happened, a refusal included
            print(json.dumps({"command": args.command, "error": {"type": type(exc).__name__, "message": str(exc)}}, indent=1))
        else:
            print(f"autoshard: error: {exc}", file=sys.stderr)
        return 1
