"""A real `mooncake_master` on loopback, started and stopped by PID.

Used wherever the store has to exist outside Kubernetes: the tests, the benchmarks and the local
runner. The binary comes with the `mooncake-transfer-engine-non-cuda` wheel, beside the Python
that runs us.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from disagg_devtools.processes import free_port, log_tail, stop_process


def master_binary() -> str:
    found = shutil.which("mooncake_master", path=os.path.dirname(sys.executable))
    found = found or shutil.which("mooncake_master")
    if not found:
        raise FileNotFoundError("no mooncake_master binary: install "
                                "mooncake-transfer-engine-non-cuda (or the CUDA build)")
    return found


@dataclass
class MooncakeMaster:
    """One master. `restart()` keeps the port, so clients configured with it reconnect."""

    log_path: Path
    port: int = 0
    extra_args: list[str] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> MooncakeMaster:
        self.port = self.port or free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [master_binary(), "--rpc_address=127.0.0.1", f"--rpc_port={self.port}",
                 f"--metrics_port={free_port()}", *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self._accepting():  # ready when its RPC port accepts connections
            if self.process.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.process.returncode}:\n"
                                   + self.log_tail())
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"mooncake_master not listening on {self.address} after "
                                   f"{timeout:g}s:\n" + self.log_tail())
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        stop_process(self.process)

    def restart(self, timeout: float = 15.0) -> MooncakeMaster:
        """Stop, wait until the port is free again, start on the same port."""
        self.stop()
        deadline = time.monotonic() + timeout
        while self._accepting():
            if time.monotonic() > deadline:
                raise TimeoutError(f"port {self.port} still taken after the master stopped")
            time.sleep(0.05)
        return self.start(timeout)

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines)

    def _accepting(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
