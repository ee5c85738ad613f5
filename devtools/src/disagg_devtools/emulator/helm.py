"""`helm install` of the chart into the emulator, through Helm's Go SDK (helm-sdkpy, which
needs Python 3.12: the tools environment, .venv-tools, runs helm_action.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

from disagg_devtools.emulator.sandbox import Sandbox

ROOT = Path(__file__).resolve().parents[4]
CHART = ROOT / "charts" / "disagg-operator"
HELM_ACTION = Path(__file__).with_name("helm_action.py")


async def helm_install(box: Sandbox, tools: Path, values: dict[str, Any] | None = None,
                       namespace: str = "disagg-system") -> dict[str, Any]:
    """The release (its "manifest" among the rest); `tools`: .venv-tools/bin."""
    # The emulator cannot store Helm's protobuf-encoded release Secret: keep it in memory.
    env = {**box.env, "HELM_DRIVER": "memory"}
    args = [str(tools / "python"), str(HELM_ACTION), "install", str(box.kubeconfig), namespace,
            "disagg", str(CHART)]
    if values is not None:
        args.append(json.dumps(values))
    result = await asyncio.to_thread(subprocess.run, args, env=env, capture_output=True,
                                     text=True, timeout=120, cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"helm install failed: {result.stderr[-3000:]}")
    release: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return release
