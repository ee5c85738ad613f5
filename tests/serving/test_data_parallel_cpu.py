"""Data parallelism for real: the rendered commands of a prefill instance and a decode instance
that each run two data-parallel ranks (`dataParallelSize: 2`; each rank its own scheduler,
KV cache and kvhelper connector). Pages are keyed by content, never by rank, so a decode rank
loads what either prefill rank stored:

- through the proxy, which leaves the choice of rank to vLLM's own balancing (pairs of
  requests sent at once, so both ranks of both instances serve);
- rank to rank, pinned with vLLM's `X-data-parallel-rank` header: prefill rank 1 to decode
  rank 0 and prefill rank 0 to decode rank 1.

Every answer must equal one ordinary instance's greedy tokens (the same arithmetic: full
blocks from its own prefix cache, one request at a time), and every decode request must have
loaded its prompt's pages. The negative control is one more pinned request whose last stored
page is corrupted between prefill and decode: its tokens must differ.

The model is the tiny MLA model with dense MLPs: vLLM's CPU build cannot run MoE layers under
data parallelism (their token gather across ranks, `all_gatherv`, is not implemented by its
CPU communicator; seen with vLLM 0.32)."""

from __future__ import annotations

import json
import re
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from disagg_devtools.master_process import MooncakeMaster
from disagg_devtools.processes import free_port
from disagg_devtools.tiny_models import make_mla
from disagg_operator.plan import VLLM_PORT
from kvhelper.keys import block_key
from kvhelper.proxy.app import prefill_request

from .conftest import in_private_network
from .engines import corrupt_values, fingerprint_in, run_engine
from .rendered import HostAddressing, Node, cpu_environment, local_command, tiny_mla_plan

HOST = "127.0.0.1"
MAX_TOKENS = 8
MODEL = "tiny-mla"


def prompt(i: int, repeats: int) -> str:
    return " ".join(f"question {i} for a data-parallel rank" for _ in range(repeats))


# A long and a short prompt per pair: the short one's prefill ends first, so its decode
# usually lands on decode's first rank and the long one's on the second.
PAIRS = [(prompt(2 * i, 7), prompt(2 * i + 1, 3)) for i in range(2)]
PINNED = [(prompt(10, 5), 1, 0), (prompt(11, 5), 0, 1)]  # (prompt, prefill rank, decode rank)
CORRUPTED = (prompt(12, 5), 0, 1)


def post(url: str, body: dict[str, Any], rank: int | None = None) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    if rank is not None:
        headers["X-data-parallel-rank"] = str(rank)
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def body(text: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}


def by_rank(log: str, action: str) -> dict[str, int]:
    """Request (the proxy's id, or vLLM's) -> the data-parallel rank whose connector logged
    `action` ("stored" or "loaded") for it."""
    found = re.findall(rf"Worker_DP(\d+)[^\n]*request (?:cmpl-)?(\S+?)(?:-0)?-[0-9a-f]+: "
                       rf"{action} \d+ KV blocks", log)
    return {request: int(rank) for rank, request in found}


@pytest.fixture(scope="module")
def dense_mla(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_mla(tmp_path_factory.mktemp("models") / "mla-dense", dense=True)


def test_decode_ranks_load_pages_that_any_prefill_rank_stored(dense_mla, tmp_path,
                                                              monkeypatch) -> None:
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", HOST)  # the corrupting store client's
    if not in_private_network():
        pytest.fail("run in a network namespace (`make test` uses `unshare -n`)")
    master = MooncakeMaster(tmp_path / "master.log").start()
    plan = tiny_mla_plan(dense_mla, HostAddressing(HOST, master.port),
                         {"dataParallelSize": 2}, {"dataParallelSize": 2})
    (tmp_path / "mooncake.json").write_text(plan.config_files["mooncake.json"])
    prefill, decode = plan.component("prefill"), plan.component("decode")
    assert prefill is not None and decode is not None
    node = Node(tmp_path)
    prefill_url, decode_url = f"http://{HOST}:{VLLM_PORT}", f"http://{HOST}:{VLLM_PORT + 1}"
    try:
        # Both ranks of an instance share the two cores, one thread each.
        env = {**cpu_environment(), "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
        argv, prefill_env = local_command(prefill.main, HOST, env, tmp_path)
        node.start("prefill", argv, prefill_env)
        argv, decode_env = local_command(decode.main, HOST, env, tmp_path)
        argv[argv.index("--port") + 1] = str(VLLM_PORT + 1)
        node.start("decode", argv, decode_env)
        proxy_port = free_port()
        node.start("proxy", [sys.executable, "-m", "kvhelper.proxy", "--host", HOST, "--port",
                             str(proxy_port), "--prefill", prefill_url, "--decode", decode_url],
                   cpu_environment())
        for url in (prefill_url, decode_url, f"http://{HOST}:{proxy_port}"):
            node.wait_http(f"{url}/health", 600)

        answers: dict[str, dict[str, Any]] = {}
        def through_proxy(text: str) -> dict[str, Any]:
            return post(f"http://{HOST}:{proxy_port}/v1/completions", body(text))

        with ThreadPoolExecutor(2) as pool:
            for pair in PAIRS:
                answers.update(zip(pair, pool.map(through_proxy, pair), strict=True))
        pinned_ids = {}
        for text, prefill_rank, decode_rank in [*PINNED, CORRUPTED]:
            first = post(f"{prefill_url}/v1/completions", prefill_request(body(text)),
                         prefill_rank)
            if text == CORRUPTED[0]:
                params = first["kv_transfer_params"]
                corrupt_values(master.address, [block_key(
                    fingerprint_in(node.log("prefill")), params["kvhelper_prefix_hash"], None)])
            answers[text] = post(f"{decode_url}/v1/completions",
                                 {**body(text), "kv_transfer_params": first["kv_transfer_params"]},
                                 decode_rank)
            pinned_ids[text] = (first["id"], answers[text]["id"])
        prefill_log, decode_log = node.log("prefill"), node.log("decode")
    finally:
        node.stop()
        master.stop()

    stored, loaded = by_rank(prefill_log, "stored"), by_rank(decode_log, "loaded")
    print(f"stored by prefill rank: {stored}\nloaded by decode rank: {loaded}")
    assert set(stored.values()) == {0, 1} and set(loaded.values()) == {0, 1}
    assert len(loaded) == len(answers), "every decode request loaded its prompt's pages"
    for text, prefill_rank, decode_rank in PINNED:
        prefill_id, decode_id = pinned_ids[text]
        assert stored[prefill_id.removeprefix("cmpl-")] == prefill_rank
        assert loaded[decode_id.removeprefix("cmpl-")] == decode_rank

    texts = list(answers)
    choices = [answers[t]["choices"][0] for t in texts]
    corrupted = texts.index(CORRUPTED[0])
    (tmp_path / "baseline").mkdir()
    expected, _ = run_engine(tmp_path / "baseline", "baseline", {
        "model": str(dense_mla), "block_size": 32, "max_tokens": MAX_TOKENS,
        "prompts": [c["prompt_token_ids"] for c in choices], "one_at_a_time": True,
        "warm_prefix_cache": True, "prefix_caching": True})
    tokens = [c["token_ids"] for c in choices]
    assert tokens[corrupted] != expected["token_ids"][corrupted], "the corruption went unseen"
    del tokens[corrupted], expected["token_ids"][corrupted]
    assert tokens == expected["token_ids"]
