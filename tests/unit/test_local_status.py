"""`local status`, `local up` and `local down` on processes that died after `local up` returned:
real processes (a sleeper, and one that fails with a message), no vLLM."""

import asyncio
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from disagg_devtools.local.cli import local
from disagg_devtools.local.commands import LocalProcess
from disagg_devtools.local.runner import LocalDeployment, RunFolder, StartupError
from disagg_devtools.waiting import wait_for
from disagg_operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def deployment(tmp_path: Path):  # noqa: ANN201
    doc = yaml.safe_load((ROOT / "examples" / "tiny-gqa-1p2d.yaml").read_text())
    folder = RunFolder(tmp_path / "run")
    folder.logs.mkdir(parents=True)
    deployment = LocalDeployment("tiny", parse_spec(doc["spec"]), folder, echo=lambda _: None)
    state: dict[str, object] = {"name": "tiny", "pids": {}}
    deployment._start(LocalProcess("tiny-proxy", "proxy", (sys.executable, "-c",
                                   "import time; time.sleep(120)")), {}, state)
    deployment._start(LocalProcess("tiny-decode-1", "decode", (
        sys.executable, "-c", "print('decode: no KV cache space left'); raise SystemExit(3)")),
        {}, state)
    yield deployment
    CliRunner().invoke(local, ["down", "--run-dir", str(folder.root)])


async def test_status_up_and_down_name_the_process_that_died(deployment) -> None:
    folder = deployment.folder
    decode = deployment.find("tiny-decode-1").process
    await wait_for(lambda: decode.poll() is not None, 10, "the decode process to exit")
    result = CliRunner().invoke(local, ["status", "--run-dir", str(folder.root)])
    assert result.exit_code == 1, result.output
    assert "tiny-proxy     running (pid" in result.output
    assert "tiny-decode-1  exited with code 3" in result.output
    assert "no KV cache space left" in result.output  # the end of its log
    with pytest.raises(StartupError, match="tiny-decode-1 exited with code 3"):
        await asyncio.wait_for(deployment.up(), 10)
    result = CliRunner().invoke(local, ["down", "--run-dir", str(folder.root)])
    assert "already gone: tiny-decode-1 exited with code 3" in result.output
    assert "stopped 1 processes" in result.output or "stopped tiny-proxy" in result.output
