"""Static checks and the Helm chart; tools come from .venv-tools (`make test` creates it)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from disagg_devtools.emulator.helm import helm_install
from disagg_devtools.emulator.sandbox import Sandbox, sandbox

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tools() -> Path:
    where = Path(os.environ.get("DISAGG_TOOLS_BIN", ROOT / ".venv-tools" / "bin"))
    if not (where / "python").exists():
        pytest.fail(f"no static-check tools at {where}: run `make test`, which creates "
                    ".venv-tools from requirements-tools.txt")
    return where


def run(*args: str | Path, env: dict[str, str] | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Sandbox]:
    async with sandbox(tmp_path / "cluster") as box:
        yield box


def stored(box: Sandbox, plural: str) -> list[dict[str, Any]]:
    return [dict(obj.raw) for (res, _, _), obj in box.emulator.objects.items()
            if res.plural == plural and not obj.deleted]


@pytest.fixture(scope="session")
def chart_manifests(tools: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chart's objects as `helm install` renders them (default values), in one file."""

    async def install() -> str:
        async with sandbox(tmp_path_factory.mktemp("helm")) as box:
            release = await helm_install(box, tools)
            return str(release["manifest"])

    out = tmp_path_factory.mktemp("chart") / "chart-manifests.yaml"
    out.write_text(asyncio.run(install()))
    return out
