"""The command line's own checks, run in the operator's environment (no vLLM here)."""

import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from disagg_devtools.emulator.cli import main as emulator_main
from disagg_devtools.local.cli import local
from disagg_operator.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", ["up", "demo"])
def test_local_from_an_environment_without_vllm_says_which_to_use(command: str,
                                                                   tmp_path: Path) -> None:
    result = CliRunner().invoke(local, [command, str(ROOT / "examples/tiny-gqa-1p2d.yaml"),
                                       "--run-dir", str(tmp_path), "--python", sys.executable])
    assert result.exit_code == 1, result.output  # a message, not a traceback
    assert "lacks vllm" in result.output and ".venv-serving/bin/disagg-local" in result.output
    assert "Traceback" not in result.output
    assert not any(tmp_path.iterdir())  # nothing was started or generated


def test_run_takes_etcd_addresses_for_an_operator_outside_the_cluster(monkeypatch) -> None:
    import kopf

    seen: dict[str, Any] = {}
    monkeypatch.setattr(kopf, "run", lambda **kwargs: seen.update(kwargs))
    endpoint = "x-etcd-client.serving.svc.cluster.local:2379"
    result = CliRunner().invoke(main, ["run", "--etcd-address", f"{endpoint}=127.0.0.1:2379",
                                       "--metrics-port", "0", "--health-port", "0"])
    assert result.exit_code == 0, result.output
    assert seen["memo"].config.etcd_address_overrides == {endpoint: "127.0.0.1:2379"}
    result = CliRunner().invoke(main, ["run", "--etcd-address", "nonsense"])
    assert result.exit_code == 2 and "ENDPOINT=HOST:PORT" in result.output


@pytest.mark.parametrize("missing", ["kopf", "kmock"])
def test_commands_without_their_extra_name_the_extra(missing: str, monkeypatch) -> None:
    """The serving environment has the operator's core and the local runner, not the
    controller or the emulator: their commands say what to install instead of a traceback."""
    for name in list(sys.modules):
        if name == missing or name.startswith((f"{missing}.", "disagg_operator.handlers",
                                               "disagg_devtools.emulator.")):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, missing, None)  # import fails as if not installed
    if missing == "kopf":
        result = CliRunner().invoke(main, ["run"])
        expected = "disagg-operator[controller]"
    else:
        result = CliRunner().invoke(emulator_main, ["demo"])
        expected = "disagg-devtools[emulator]"
    assert result.exit_code == 1 and expected in result.output, result.output
    assert "Traceback" not in result.output


def test_render_refuses_a_name_the_operator_would_refuse(tmp_path: Path) -> None:
    """`render` exited 0 for a 48-character name and printed 64-character child names."""
    doc = (ROOT / "examples/deepseek-v2-lite-1p2d.yaml").read_text()
    path = tmp_path / "long.yaml"
    path.write_text(doc.replace("name: dsv2-lite", "name: " + "x" * 48, 1))
    result = CliRunner().invoke(main, ["render", str(path)])
    assert result.exit_code == 2, result.output
    assert "metadata.name is 48 characters" in result.output
    assert "Deployment" not in result.output


@pytest.mark.parametrize("field", ["prefill", "decode"])
def test_replica_counts_have_an_upper_bound(field: str, tmp_path: Path) -> None:
    """`decode.replicas: 9999999999` reached the Deployment (int32 on the API server)."""
    import yaml

    doc = yaml.safe_load((ROOT / "examples/deepseek-v2-lite-1p2d.yaml").read_text())
    doc["spec"].setdefault(field, {})["replicas"] = 9999999999
    path = tmp_path / "many.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["render", str(path)])
    assert result.exit_code == 2, result.output
    assert f"{field}.replicas" in result.output and "1000" in result.output
