"""The ``autoshard`` command. ``--version``, ``--help`` and ``matrix`` import neither torch nor Lightning, so they
answer at once: the other subcommands are built only when chosen. No parser accepts abbreviations (``--devices`` once
became ``--devices-per-node``); with ``--json`` every error is one JSON object on stdout, exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import itertools
import json
import os
import re
import signal
import sys
import threading
from collections.abc import Container, Iterator, Sequence
from contextlib import contextmanager, redirect_stdout
from typing import NoReturn, TextIO

from autoshard import __version__
from autoshard.backends.matrix import FORMATS, render_matrix
from autoshard.errors import AutoShardError, closest

# Subcommand -> (the module whose ``register_cli`` builds it, its one-line help for ``autoshard --help``).
# tests/test_cli.py checks that each help line here is the one register_cli gives.
LAZY: dict[str, tuple[str, str]] = {
    "explain": ("autoshard.explain", "show what autoshard would do with a module: needs, backend, plan, memory per rank"),
    "consolidate": ("autoshard.consolidate", "turn a sharded (DCP or DeepSpeed) checkpoint into one torch.save file of full weights"),
    "convert": ("autoshard.convert", "convert a checkpoint between DeepSpeed ZeRO-3 and fsdp2 (DCP), optimizer state included, or to safetensors"),
    "calibrate": ("autoshard.calibrate", "measure the rates a memory budget prices configurations with, on this machine's device"),
}


class UsageError(AutoShardError):
    """A command line argparse refused, with the parser whose usage goes with it: raised instead of argparse's exit,
    so that main() answers in JSON under --json."""

    def __init__(self, message: str, parser: argparse.ArgumentParser) -> None:
        super().__init__(message)
        self.parser = parser


class Parser(argparse.ArgumentParser):
    """argparse without abbreviations whose errors reach main(); subparsers are of this class too."""

    def __init__(self, *args: object, allow_abbrev: bool = False, **kwargs: object) -> None:
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, self)


def cmd_matrix(args: argparse.Namespace, stream: TextIO | None = None) -> int:
    """Print the capability matrix: which backend runs which feature, and with --details why not."""
    print(render_matrix(args.format, details=args.details), file=stream or sys.stdout)
    return 0


def add_matrix(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "matrix",
        allow_abbrev=False,
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
    """The parser with every subcommand; of the LAZY ones only those in ``load`` are built in full (imported)."""
    parser = Parser(
        prog="autoshard",
        allow_abbrev=False,
        description="Ask for sharded training once; autoshard picks FSDP2 or DeepSpeed ZeRO-3, or tells you why not.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"autoshard {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_matrix(subparsers)
    for name, (module, summary) in LAZY.items():
        if name in load:
            importlib.import_module(module).register_cli(subparsers)
        else:
            subparsers.add_parser(name, help=summary, allow_abbrev=False)
    return parser


def wants_json(argv: Sequence[str]) -> bool:
    """Whether the command line asks for JSON (``--json``, or matrix's ``--format json``), read from the raw words
    because a command line argparse refused has no parsed value."""
    words = list(argv[: list(argv).index("--")] if "--" in argv else argv)
    return "--json" in words or "--format=json" in words or ("--format", "json") in itertools.pairwise(words)


def command_parser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The subcommand's parser when there is one: argparse reports "unrecognized arguments" from the top level."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    return sub.choices[command] if sub is not None and command in sub.choices else parser


def usage_fix(message: str, parser: argparse.ArgumentParser) -> str:
    """The Fix for argparse's message: the option or choice a near-miss meant, else where the options are listed."""
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    unknown = re.match(r"unrecognized arguments: (.*)", message)
    if unknown:
        words = [w.split("=")[0] for w in unknown.group(1).split() if w.startswith("--")]
        hints = [f"{closest(w, options)} (not {w})" for w in words if closest(w, options)]
        if hints:
            return f"{', '.join(hints)}; options are never abbreviated (`{parser.prog} --help` lists them)"
    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if choice:
        near = closest(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)))
        if near:
            return f"did you mean {near!r}?"
        return f"choose one of {choice.group(2)}"
    return f"see `{parser.prog} --help`"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; an autoshard refusal prints its message (not a traceback) and exits 1. stdout carries the
    result alone (a library's print goes to stderr); a closed pipe ends quietly; SIGTERM raises, so a writer removes
    its staging."""
    stdout = sys.stdout
    try:
        return _main(list(sys.argv[1:] if argv is None else argv), stdout)
    except BrokenPipeError:
        _drop(stdout)
        return 1


def _main(argv: list[str], stdout: TextIO) -> int:
    command = next((a for a in argv if not a.startswith("-")), None)  # the top level has options without values only
    as_json = wants_json(argv)
    with redirect_stdout(sys.stderr):
        parser = build_parser(load={command})
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        refused = exc.parser if exc.parser is not parser else command_parser(parser, command)
        message = f"{exc}. Fix: {usage_fix(str(exc), refused)}"
        if as_json:
            print(json.dumps({"command": command, "error": {"type": "UsageError", "message": message}}, indent=1), file=stdout)
            return 1
        refused.print_usage(sys.stderr)
        print(f"{refused.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        with _terminate_as_exit():
            return _run(args, stdout)
    except AutoShardError as exc:
        if as_json or getattr(args, "json", False):  # --json: stdout is one object whatever happened, a refusal included
            print(json.dumps({"command": args.command, "error": {"type": type(exc).__name__, "message": str(exc)}}, indent=1), file=stdout)
        else:
            print(f"autoshard: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader of stdout is gone: main() ends quietly, no JSON error for nobody
        raise
    except Exception as exc:  # not a refusal autoshard knows: a bug, or an input no check caught yet
        if not as_json:
            raise
        message = (
            f"{type(exc).__name__}: {exc}. This is not a refusal autoshard knows (a bug, or an input no check catches"
            f" yet). Fix: run the same command without --json for the traceback, and report it"
        )
        print(json.dumps({"command": args.command, "error": {"type": type(exc).__name__, "message": message}}, indent=1), file=stdout)
        return 1


def _run(args: argparse.Namespace, stdout: TextIO) -> int:
    """The subcommand, its result on ``stdout`` and anything else printed while it runs on stderr; a command that
    takes no ``stream`` prints where it likes."""
    if "stream" not in inspect.signature(args.func).parameters:
        return args.func(args)
    with redirect_stdout(sys.stderr):
        return args.func(args, stream=stdout)


def _drop(stream: TextIO) -> None:
    """After the reader closed the pipe: point stdout at /dev/null, so the interpreter's last flush raises nothing
    (the Python docs' recipe for SIGPIPE)."""
    with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):  # not a file descriptor (a test's buffer)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


@contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM (``kill``, a scheduler's time limit) raised as SystemExit(143) in the main thread while a command runs:
    the writers' ``with Publisher(...)`` blocks then remove their staging, as on Ctrl-C, instead of leaving it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> NoReturn:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
