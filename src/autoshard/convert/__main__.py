"""``python -m autoshard.convert``: not a command of its own; refused with the command line that runs it
(``python -m autoshard convert ...``), as ``python -m autoshard.consolidate`` is."""

import sys

from autoshard.consolidate import refuse_module_run

raise SystemExit(refuse_module_run("convert", "SRC DST --to dcp|deepspeed|safetensors", sys.argv[1:]))
