"""The local runner's translation of the operator's plan into processes on one machine."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from disagg_devtools.local.commands import (
    LocalAddressing,
    LocalPlanError,
    LocalProcess,
    Programs,
    assign_ports,
    local_processes,
)
from disagg_operator.plan import CONFIG_DIR, build_plan
from disagg_operator.spec import parse_spec

SPEC = {"model": {"name": "/models/tiny", "servedModelName": "tiny", "blockSize": 32},
        "decode": {"replicas": 2}}
PROGRAMS = Programs(python="/venv/bin/python", binaries={"mooncake_master": "/venv/bin/mm"})


def processes(spec: dict[str, object] | None = None,
              env: dict[str, str] | None = None) -> list[LocalProcess]:
    addressing = LocalAddressing(etcd=("127.0.0.1:2399",), master_port=5100)
    plan = build_plan("tiny", "local", parse_spec(spec or SPEC), addressing)
    ports = assign_ports(plan, addressing, 8080, iter(range(6000, 7000)).__next__)
    return local_processes(plan, ports, Path("/run/cfg"), PROGRAMS, env or {})


def by_name(found: list[LocalProcess]) -> dict[str, LocalProcess]:
    return {p.name: p for p in found}


def test_every_replica_and_sidecar_becomes_one_process() -> None:
    names = sorted(by_name(processes()))
    assert names == ["tiny-decode-0", "tiny-decode-0-registrar", "tiny-decode-1",
                     "tiny-decode-1-registrar", "tiny-mooncake-master-0", "tiny-prefill-0",
                     "tiny-prefill-0-registrar", "tiny-proxy-0"]


def test_listeners_bind_loopback_on_their_own_ports() -> None:
    found = by_name(processes())
    ports = [p.port for p in found.values() if p.port is not None]
    assert len(ports) == len(set(ports)) == 5
    for process in found.values():
        joined = " ".join(process.argv)
        assert "0.0.0.0" not in joined
        assert not re.search(r"(^|[ =:])(8000|2379|50051)\b", joined), joined
    decode_1 = found["tiny-decode-1"]
    argv = list(decode_1.argv)
    assert argv[0] == "/venv/bin/python"
    assert argv[argv.index("--port") + 1] == str(decode_1.port)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    master = found["tiny-mooncake-master-0"]
    assert master.argv[0] == "/venv/bin/mm" and "--rpc_port=5100" in master.argv


def test_registrar_points_at_its_own_instance() -> None:
    found = by_name(processes())
    registrar = list(found["tiny-decode-1-registrar"].argv)
    port = found["tiny-decode-1"].port
    assert registrar[registrar.index("--url") + 1] == f"http://127.0.0.1:{port}"
    assert registrar[registrar.index("--health-url") + 1] == f"http://127.0.0.1:{port}/health"
    assert registrar[registrar.index("--etcd") + 1] == "127.0.0.1:2399"
    assert found["tiny-decode-1-registrar"].env["POD_NAME"] == "tiny-decode-1"


def test_each_instance_drains_itself_with_the_plans_hook() -> None:
    found = by_name(processes({**SPEC, "decode": {"replicas": 2,
                                                  "terminationGracePeriodSeconds": 60}}))
    decode_1 = found["tiny-decode-1"]
    hook = list(decode_1.pre_stop)
    assert hook[:3] == ["/venv/bin/python", "-m", "kvhelper.drain"]
    assert hook[hook.index("--url") + 1] == f"http://127.0.0.1:{decode_1.port}"
    assert hook[hook.index("--timeout") + 1] == "50" and decode_1.stop_grace == 60
    assert found["tiny-prefill-0"].stop_grace == 300
    assert not found["tiny-decode-1-registrar"].pre_stop
    assert not found["tiny-proxy-0"].pre_stop


def test_config_files_and_kv_settings_point_at_the_run_folder() -> None:
    prefill = by_name(processes())["tiny-prefill-0"]
    config = json.loads(prefill.argv[prefill.argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"]["mooncake_config_path"] == \
        "/run/cfg/mooncake.json"
    assert prefill.env["MOONCAKE_CONFIG_PATH"] == "/run/cfg/mooncake.json"
    assert prefill.env["POD_IP"] == "127.0.0.1"  # the store's own address (kvhelper.store)
    assert "HF_HOME" not in prefill.env  # a path inside the pod
    assert not any(CONFIG_DIR in arg for arg in prefill.argv)


def test_a_token_secret_comes_only_from_the_callers_environment() -> None:
    spec = {**SPEC, "hfTokenSecret": {"name": "hf", "key": "token"}}
    with pytest.raises(LocalPlanError, match="spec.hfTokenSecret.*export"):
        processes(spec)
    prefill = by_name(processes(spec, {"HF_TOKEN": "s3cret"}))["tiny-prefill-0"]
    assert prefill.env["HF_TOKEN"] == "s3cret"
    assert not any("s3cret" in arg for arg in prefill.argv)


def test_a_rollout_starts_a_named_apart_generation_and_refuses_what_it_cannot_restart(
        ) -> None:
    from disagg_devtools.local.runner import outside_vllm_roles

    addressing = LocalAddressing(etcd=("127.0.0.1:2399",), master_port=5100)
    old = build_plan("tiny", "local", parse_spec(SPEC), addressing)
    new_spec = {**SPEC, "model": {**SPEC["model"], "blockSize": 16}}  # type: ignore[dict-item]
    new = build_plan("tiny", "local", parse_spec(new_spec), addressing)
    assert outside_vllm_roles(old, new) is None
    ports = assign_ports(new, addressing, 8080, iter(range(6000, 7000)).__next__)
    started = local_processes(new, ports, Path("/run/cfg"), PROGRAMS, {},
                              skip_roles=frozenset({"etcd", "mooncake-master", "proxy"}),
                              generation=2)
    assert sorted(p.name for p in started) == [
        "tiny-decode-g2-0", "tiny-decode-g2-0-registrar", "tiny-decode-g2-1",
        "tiny-decode-g2-1-registrar", "tiny-prefill-g2-0", "tiny-prefill-g2-0-registrar"]
    bigger_store = {**SPEC, "kvTransfer": {"mooncake": {"globalSegmentSize": "8Gi"}}}
    assert "config files" in str(outside_vllm_roles(
        old, build_plan("tiny", "local", parse_spec(bigger_store), addressing)))
    other_port = {**SPEC, "proxy": {"service": {"port": 9000}}}
    assert outside_vllm_roles(
        old, build_plan("tiny", "local", parse_spec(other_port), addressing)) == "changes proxy"
