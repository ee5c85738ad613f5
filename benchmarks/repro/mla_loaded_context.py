"""Diagnostic for the capacity benchmark's MLA finding: does a batch of prefills that attend to
context loaded from the store cost as much as computing that context?

A local kvhelper 1P1D deployment of the compute-sized MLA model; straight to its prefill
instance, batches of 1, 2 and 4 concurrent requests (one token each), twice each: cold
768-token prompts, then 704-token prompts (computed and stored) sent again with 64 new tokens,
whose 704 tokens the prefill instance's own lookup loads from the store. Prints each batch's
wall time.

    .venv-serving/bin/python benchmarks/repro/mla_loaded_context.py

About 2 minutes on 2 cores. As root it runs in a private network namespace.
"""

from __future__ import annotations

import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import capacity  # noqa: E402  (the benchmark beside this folder)
from trace_replay import stack_doc  # noqa: E402

SERVED = "tiny-mla"


async def _batch(url: str, prompts: list[list[int]]) -> float:
    """Seconds until every prompt's first token came back, all sent at once."""
    async with aiohttp.ClientSession() as session:
        began = time.perf_counter()
        timings = [capacity.Timing(0.0) for _ in prompts]
        await asyncio.gather(*(capacity.stream(session, url, SERVED, prompt, 1, timing, began)
                               for prompt, timing in zip(prompts, timings, strict=True)))
        failed = [t.error for t in timings if t.error]
        if failed:
            raise SystemExit(f"a request failed: {failed[0]}")
        return time.perf_counter() - began


def main() -> None:
    from disagg_devtools.local.runner import LocalDeployment, RunFolder, share_cores, stop_recorded
    from disagg_devtools.processes import free_port, isolate_benchmark
    from disagg_devtools.tiny_models import VOCAB, make_mla
    from disagg_operator.spec import parse_spec

    isolate_benchmark()
    share_cores(1)
    rng = random.Random(5)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(10, VOCAB) for _ in range(count)]

    with tempfile.TemporaryDirectory(prefix="mla-context-") as scratch:
        model = make_mla(Path(scratch) / "model", size="compute")
        doc = stack_doc("mla", "kvhelper", prefills=1, decodes=1, model=str(model))
        doc["spec"]["model"]["servedModelName"] = SERVED
        folder = RunFolder(Path(scratch) / "run")
        deployment = LocalDeployment(doc["metadata"]["name"], parse_spec(doc["spec"]), folder,
                                     proxy_port=free_port(), echo=lambda _: None)
        try:
            asyncio.run(deployment.up(timeout=900))
            url = next(f"http://127.0.0.1:{i.spec.port}" for i in deployment.started
                       if i.spec.role == "prefill" and i.spec.port)
            asyncio.run(_batch(url, [tokens(64)]))  # warm-up
            for size in (1, 2, 4):
                for _ in range(2):
                    cold = asyncio.run(_batch(url, [tokens(768) for _ in range(size)]))
                    stored = [tokens(704) for _ in range(size)]
                    asyncio.run(_batch(url, stored))
                    time.sleep(1.0)  # the stores are asynchronous; none is awaited here
                    loaded = asyncio.run(_batch(url, [p + tokens(64) for p in stored]))
                    print(f"batch of {size}: cold 768 tokens {cold * 1000:.0f} ms; 704 loaded "
                          f"+ 64 computed {loaded * 1000:.0f} ms", flush=True)
        finally:
            stop_recorded(folder, lambda _: None)


if __name__ == "__main__":
    main()
