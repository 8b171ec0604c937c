"""A stand-in for a worker that dies at exit the way issue 28's did, for tests/distributed/test_worker_exit.py (no
torch; not a ``*_worker.py``: it leaves on purpose without the harness). ``abort``: rank 1 writes its result, prints
what std::terminate prints and aborts (exit -6); ``abort_reported``: the same line, then exit 0, as a launcher that
outlived its aborted child would."""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    mode, out, rank = sys.argv[1], sys.argv[sys.argv.index("--out") + 1], int(os.environ["RANK"])
    Path(out, f"rank{rank}.json").write_text("{}")
    if rank == 1:
        print("terminate called without an active exception", file=sys.stderr, flush=True)
        if mode == "abort":
            os.abort()
