"""`local status`, `local up` and `local down` on processes that died after `local up` returned:
real processes (a sleeper, and one that fails with a message), no vLLM."""

import asyncio
import sys
import time
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


def bare_deployment(tmp_path: Path) -> tuple[LocalDeployment, dict[str, object]]:
    """A deployment of the tiny example that has started nothing, and its state to record
    the processes a test starts in it."""
    doc = yaml.safe_load((ROOT / "examples" / "tiny-gqa-1p2d.yaml").read_text())
    folder = RunFolder(tmp_path / "run")
    folder.logs.mkdir(parents=True)
    deployment = LocalDeployment("tiny", parse_spec(doc["spec"]), folder, echo=lambda _: None)
    return deployment, {"name": "tiny", "pids": {}}


@pytest.fixture
def deployment(tmp_path: Path):  # noqa: ANN201
    deployment, state = bare_deployment(tmp_path)
    folder = deployment.folder
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


def test_down_stops_a_process_that_outlives_its_wrapper(tmp_path: Path) -> None:
    """vLLM's server can hang in its shutdown after SIGTERM. Its wrapper shell dies of the
    same SIGTERM, and `local down` only watched the wrapper, so it never sent the SIGKILL and
    the server ran on after the deployment was gone (a killed replay left one behind)."""
    import os
    import signal

    from disagg_devtools.local.runner import stop_recorded

    def running(pid: int) -> bool:  # an unreaped zombie has ended
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] != "Z"

    deployment, state = bare_deployment(tmp_path)
    folder = deployment.folder
    pid_file = tmp_path / "server.pid"
    stubborn = ("import os, signal, sys, time\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                "time.sleep(120)\n")
    deployment._start(LocalProcess("tiny-decode-0", "decode", (sys.executable, "-c", stubborn)),
                      {}, state)
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    server = int(pid_file.read_text())
    stop_recorded(folder, lambda _: None, grace=1.0)
    deadline = time.monotonic() + 5
    while running(server):
        if time.monotonic() > deadline:
            os.kill(server, signal.SIGKILL)
            pytest.fail("the server outlived `local down`")
        time.sleep(0.05)


def test_down_stops_the_store_and_etcd_after_their_clients(tmp_path: Path) -> None:
    """A Mooncake client's teardown writes to etcd (5 s per write it cannot make): stopped
    all at once, the proxy outlived its grace and was killed. Its client must find etcd and
    the master still running when it is told to stop."""
    from disagg_devtools.local.runner import stop_recorded

    deployment, state = bare_deployment(tmp_path)
    folder = deployment.folder
    pids = {name: tmp_path / f"{name}.pid" for name in ("etcd", "tiny-mooncake-master-0")}
    server = "import os, time; open({!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    for name, pid_file in pids.items():
        deployment._start(LocalProcess(name, "store", (sys.executable, "-c",
                                                         server.format(str(pid_file)))), {},
                          state)
    seen, ready = tmp_path / "seen", tmp_path / "ready"
    client = ("import os, signal, sys, time\n"
              "def running(pid):\n"  # a zombie has ended
              "    try:\n"
              "        stat = open(f'/proc/{pid}/stat').read()\n"
              "    except FileNotFoundError:\n"
              "        return False\n"
              "    return stat.rsplit(')', 1)[1].split()[0] != 'Z'\n"
              "def stop(*_):\n"
              "    time.sleep(0.5)\n"  # as a teardown that talks to them takes a while
              f"    found = [running(int(open(p).read())) "
              f"for p in {[str(p) for p in pids.values()]!r}]\n"
              f"    open({str(seen)!r}, 'w').write(repr(found))\n"
              "    sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, stop)\n"
              f"open({str(ready)!r}, 'w').write('ready')\n"
              "time.sleep(120)\n")
    deployment._start(LocalProcess("tiny-proxy", "proxy", (sys.executable, "-c", client)), {},
                      state)
    deadline = time.monotonic() + 10
    # Its SIGTERM handler in place (a loaded machine starts Python slowly), and the servers up.
    while not (ready.exists() and all(p.exists() and p.read_text() for p in pids.values())):
        assert time.monotonic() < deadline, "the servers did not start"
        time.sleep(0.05)
    stop_recorded(folder, lambda _: None, grace=5.0)
    assert seen.read_text() == "[True, True]"
