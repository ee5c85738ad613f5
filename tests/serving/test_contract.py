"""The contract between the operator image and the serving image, checked from both sides: every
command line the operator's plan renders for a kvhelper process parses with kvhelper's own
argument parser, every --kv-transfer-config with the connector's own settings parser (and names
a connector class that exists), every rendered mooncake.json loads with kvhelper's own loader,
and every environment variable rendered for a serving container is one that something in it
reads."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from disagg_operator.plan import ClusterAddressing, Plan, Process, build_plan
from disagg_operator.spec import parse_spec
from kvhelper.connector.settings import ConnectorSettings
from kvhelper.drain import parse_args as drain_args
from kvhelper.peer_check import parse_args as peer_check_args
from kvhelper.proxy.__main__ import parse_args as proxy_args
from kvhelper.registry import parse_args as registrar_args
from kvhelper.store import MooncakeConfig

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
KVHELPER_SOURCES = "\n".join(p.read_text() for p in (ROOT / "kvhelper" / "src").rglob("*.py"))
# Read by programs other than kvhelper in the serving container, each for a stated reason.
READ_ELSEWHERE = {
    "HF_HOME": "Hugging Face's cache location, read by vLLM",
    "HF_TOKEN": "the model hub token, read by vLLM's hub client",
    "VLLM_API_KEY": "the key vLLM's OpenAI server requires (its --api-key)",
    "PYTHONHASHSEED": "Python itself; keeps xxhash block hashes equal across instances",
    "POD_NAME": "etcd's command line ($(POD_NAME), expanded by Kubernetes)",
    "NCCL_SOCKET_IFNAME": "NCCL's bootstrap and socket transport (multi-node instances)",
    "GLOO_SOCKET_IFNAME": "torch.distributed's Gloo backend (multi-node instances)",
    "MC_STORE_CLUSTER_ID": "Mooncake's client: the HA masters' election key in etcd",
    "VLLM_HOST_IP": "vLLM's get_ip: where other nodes' ranks and its store connector reach it",
}


VLLM_SERVER = "vllm.entrypoints.openai.api_server"


def plan_of(example: Path) -> Plan:
    document = yaml.safe_load(example.read_text())
    return build_plan(document["metadata"]["name"], "serving", parse_spec(document["spec"]),
                      ClusterAddressing("serving"))


def processes(plan: Plan) -> list[Process]:
    """Every process, and every hook command as a process of its own."""
    found = [p for c in plan.components
             for p in (c.main, *c.sidecars, *((c.worker,) if c.worker else ()))]
    return (found + [Process(f"{p.name}-pre-stop", p.pre_stop) for p in found if p.pre_stop]
            + [Process(f"{p.name}-startup", p.startup_check) for p in found if p.startup_check])


def module_args(process: Process, module: str) -> list[str] | None:
    command = list(process.command)
    if command[1:3] == ["-m", module]:
        return command[3:]
    if module == VLLM_SERVER and command[:2] == ["vllm", "serve"]:
        return command[2:]  # multi-node instances start vLLM through its CLI
    return None


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_rendered_command_lines_parse_with_kvhelpers_own_parsers(example: Path) -> None:
    seen = set()
    for process in processes(plan_of(example)):
        if (args := module_args(process, "kvhelper.proxy")) is not None:
            proxy_args(args)
            seen.add("proxy")
        elif (args := module_args(process, "kvhelper.registry")) is not None:
            registrar_args(args)
            seen.add("registrar")
        elif (args := module_args(process, "kvhelper.drain")) is not None:
            drain_args(args)
            seen.add("drain")
        elif (args := module_args(process, "kvhelper.peer_check")) is not None:
            peer_check_args(args)
            seen.add("peer_check")
        elif (args := module_args(process, VLLM_SERVER)) is not None:
            config = json.loads(args[args.index("--kv-transfer-config") + 1])
            if "kv_connector_module_path" in config:
                module = importlib.import_module(config["kv_connector_module_path"])
                assert hasattr(module, config["kv_connector"]), config
                ConnectorSettings.parse(config.get("kv_connector_extra_config"))
                seen.add("connector")
    assert {"proxy", "registrar", "drain", "peer_check"} <= seen


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_rendered_mooncake_config_loads_with_kvhelpers_own_loader(
        example: Path, tmp_path: Path) -> None:
    plan = plan_of(example)
    for name, content in plan.config_files.items():
        path = tmp_path / name
        path.write_text(content)
        config = MooncakeConfig.load({}, environ={"MOONCAKE_CONFIG_PATH": str(path),
                                                  "POD_IP": "10.0.0.7"})
        assert config.master_server_address == plan.mooncake_master_address
        assert config.local_hostname == "10.0.0.7"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_rendered_env_var_is_read_in_its_container(example: Path) -> None:
    unread: dict[str, Any] = {}
    for process in processes(plan_of(example)):
        for name, _ in process.env:
            command = " ".join(process.command)
            if (name not in READ_ELSEWHERE and f"$({name})" not in command
                    and f'"{name}"' not in KVHELPER_SOURCES):
                unread[name] = process.name
    assert not unread, f"rendered but read by nothing: {unread}"
