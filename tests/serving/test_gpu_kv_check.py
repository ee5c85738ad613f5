"""The GPU check (benchmarks/gpu_kv_check.py) on this machine's CPU, as CI can run it: every
correctness case byte-exact, the staging round trip through a real store intact, one table and
the full log written; and its checks catch a gather or scatter that misses bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from disagg_devtools.benchmark_scripts import load_benchmark

from .conftest import in_private_network

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_kv_check.py"


def load_script() -> ModuleType:
    return load_benchmark("gpu_kv_check")


def test_the_gpu_check_runs_on_the_cpu(tmp_path) -> None:
    if not in_private_network():
        pytest.fail("run in a network namespace (`make test` uses `unshare -n`)")
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results: dict[str, Any] = json.loads((tmp_path / "results.json").read_text())
    assert results["failed"] == 0
    assert len(results["correctness"]) == 11 and not any(results["correctness"].values())
    assert results["staging"]["layers_differing"] == []
    assert set(results["speed"]) and results["device"].startswith("CPU")
    log = (tmp_path / "log.txt").read_text()
    assert "part  case" in log and "rows, 0 failed" in log


@pytest.mark.parametrize("fault", ["gather", "scatter"])
def test_a_mover_that_misses_bytes_is_caught(fault) -> None:
    check = load_script()
    pages = pytest.importorskip("kvhelper.pages")

    class Faulty(pages.PageMover):  # type: ignore[misc,name-defined]
        def gather(self, block_ids: Any, buffer: Any = None, order: str = "layer") -> Any:
            out = super().gather(block_ids, buffer, order)
            if fault == "gather":
                out[-1:] = check.POISON  # its last byte never written
            return out

        def scatter(self, block_ids: Any, buffer: Any, order: str = "layer") -> None:
            if fault == "scatter":  # the last block not written at all
                block_ids, buffer = block_ids[:-1], buffer[:self.nbytes(len(block_ids) - 1)]
            super().scatter(block_ids, buffer, order)

    shape = check.CORRECTNESS[6]  # K/V-first: two regions per page
    problems = check.check_case(shape, 12, 4, torch.device("cpu"), Faulty)
    # Both buffer orders catch it; a bad gather also spoils the scatter after it.
    assert sum(f"{fault}:" in p for p in problems) == 2, problems
    assert fault == "gather" or not any("gather:" in p for p in problems), problems
