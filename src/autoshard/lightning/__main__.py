"""``python -m autoshard.lightning docs/lightning-changes.md``: regenerate the list of what ``import autoshard``
changes in Lightning, from the record the changes leave (autoshard.lightning.guards.installed)."""

from __future__ import annotations

import argparse

from autoshard.lightning import write_changes


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m autoshard.lightning", allow_abbrev=False, description=__doc__)
    parser.add_argument("path", help="the page to update between its generated-changes markers")
    write_changes(parser.parse_args().path)


if __name__ == "__main__":
    main()
