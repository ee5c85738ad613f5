"""Shared by every test run (the operator's environment and the serving one): a skipped test
fails the run unless its reason is on the allow-list below, so that a test whose data or tool
is missing can never pass unnoticed as "skipped"."""

from __future__ import annotations

from typing import Any

import pytest

# A skip reason (its start) -> why such a skip is allowed. Keep it short.
ALLOWED_SKIPS: dict[str, str] = {
    "no GPU here": "the GPU checks run only where the device tool lends a GPU",
}
_skipped: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        longrepr: Any = report.longrepr
        reason = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)
        _skipped.append((report.nodeid, reason.removeprefix("Skipped: ")))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    refused = [(node, reason) for node, reason in _skipped
               if not any(reason.startswith(allowed) for allowed in ALLOWED_SKIPS)]
    if refused and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(f"{len(refused)} skipped test(s) not on the allow-list "
                                "(tests/conftest.py ALLOWED_SKIPS): a skip fails the run",
                                red=True)
            for node, reason in refused:
                reporter.write_line(f"  {node}: {reason}", red=True)
