"""What the docs generators share: write their files, or with --check fail on a stale one."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from pathlib import Path


def write_or_check(description: str, folder: Path, makers: Mapping[str, Callable[[], str]]) -> int:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="fail if a file is stale")
    args = parser.parse_args()
    stale = []
    for name, make in makers.items():
        target, text = folder / name, make()
        if args.check:
            if not target.exists() or target.read_text() != text:
                stale.append(name)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}: run `make docs`", file=sys.stderr)
    return 1 if stale else 0
