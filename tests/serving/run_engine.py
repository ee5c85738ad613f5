"""Run one vLLM CPU engine in its own process for the connector tests; JSON in, JSON out.

    python run_engine.py REQUEST.json RESULT.json
REQUEST: {"model", "block_size", "prompts" (texts, lists of token ids, or vLLM prompt dicts such
          as {"prompt_token_ids": [...], "cache_salt": "..."}), "max_tokens",
          "max_model_len" (default 512), "kv_transfer_config" (or null),
          "kv_transfer_params" (list, one per prompt, or null),
          "warm_prefix_cache" (optional: run each prompt once first, from scratch, with prefix
          caching, so the reported run reuses its cached full blocks; that first, cold run
          is reported as "cold_token_ids"; with "over_earlier_prompts", that first run reuses
          the blocks earlier prompts left in the prefix cache, as a prefill instance reuses
          the blocks other instances stored),
          "prefix_caching" (optional: keep vLLM's prefix cache on, for MLA too),
          "tensor_parallel_size" (optional, default 1: with more, worker processes),
          "one_at_a_time" (optional: each prompt alone, not batched with the others),
          "engine_args" (optional: more of vLLM's engine arguments, e.g. a small
          num_gpu_blocks_override so that requests get preempted),
          "reference" (optional: afterwards, run the prompts again on this same engine without
          kv_transfer_params: what recomputing them gives here),
          "logprobs" (optional: this many top logprobs per generated token)}
RESULT:  {"token_ids": [[...], ...], "finish_reasons": [...], "kv_transfer_params": [...],
          "cold_token_ids" (with "warm_prefix_cache"),
          "logprobs" and "cold_logprobs" (with "logprobs"): per prompt, per step, the top
          [[token_id, logprob], ...] best first,
          "reference_token_ids" (with "reference")}

The engine runs in this one process (the caller sets VLLM_ENABLE_V1_MULTIPROCESSING=0, and the
executor is "uni", vLLM's default for one GPU): the arithmetic is the same as with separate
engine-core and worker processes, and start-up takes a third of the time on a small machine.
"""

import json
import os
import sys
import time
from typing import Any


def keep_prefix_caching_on() -> None:
    """vLLM's CPU platform turns prefix caching off for MLA models (its CPU MLA backend is
    "reference quality"), so an ordinary instance would compute every prompt from scratch, while
    a decode instance that loaded KV computes only the rest of the prompt, over cached blocks.
    To compare like with like, the baseline keeps prefix caching on."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    update = platform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        update(cls, vllm_config)
        vllm_config.cache_config.enable_prefix_caching = True

    platform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore


def bind_workers(tp: int) -> None:
    """Give each TP worker its own share of this process's cores: vLLM's automatic binding
    wants a NUMA node per worker, and a small machine has one."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        return
    share = len(cores) // tp
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(
        ",".join(map(str, cores[rank * share:(rank + 1) * share])) for rank in range(tp)))


def finish_connector_work(llm: Any) -> None:
    """Step the engine until no finished request waits on the connector. A server's engine
    keeps stepping while any does (e.g. a decode save, save_decode_cache); LLM.generate returns
    as soon as the outputs are complete. In-process engine only (see the module doc)."""
    core = llm.llm_engine.engine_core.engine_core
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not core.scheduler.has_requests():
            return
        core.step()
    raise RuntimeError("the connector still holds finished requests after 120 s")


def top_logprobs(output: Any) -> list[list[list[float]]]:
    """Per generated token, its top logprobs as [token_id, logprob] pairs, best first."""
    return [sorted(([token, entry.logprob] for token, entry in step.items()),
                   key=lambda pair: -pair[1])
            for step in output.outputs[0].logprobs or []]


def main() -> None:
    request = json.loads(open(sys.argv[1]).read())
    tp = request.get("tensor_parallel_size", 1)
    if tp > 1:
        bind_workers(tp)
    from disagg_devtools.vllm_cpu_kernels import register
    from vllm import LLM, SamplingParams

    register()  # vLLM loads it too, but a forked job may inherit "plugins already loaded"
    prefix_caching = bool(request.get("warm_prefix_cache") or request.get("prefix_caching"))
    if prefix_caching:
        keep_prefix_caching_on()
    prompts = [p if isinstance(p, str | dict) else {"prompt_token_ids": p}
               for p in request["prompts"]]
    sizing = {"block_size": request["block_size"]} if request.get("block_size") else {}
    llm = LLM(model=request["model"], enforce_eager=True, tensor_parallel_size=tp,
              distributed_executor_backend="uni" if tp == 1 else "mp",
              max_model_len=request.get("max_model_len", 512), **sizing,
              kv_transfer_config=request.get("kv_transfer_config"), seed=0,
              enable_prefix_caching=prefix_caching, **request.get("engine_args", {}))
    params = request.get("kv_transfer_params") or [None] * len(prompts)

    top = request.get("logprobs")

    def sampling(extra: dict[str, Any] | None) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], logprobs=top,
                              extra_args={"kv_transfer_params": extra} if extra else None)

    groups = ([[i] for i in range(len(prompts))] if request.get("one_at_a_time")
              else [list(range(len(prompts)))])
    outputs, cold = [], []
    for group in groups:
        if request.get("warm_prefix_cache"):
            # From scratch, as a prefill instance with nothing stored computes it: not over
            # another prompt's cached blocks (vLLM's CPU MLA kernels write slightly other
            # latents that way), unless "over_earlier_prompts" asks for just that.
            if not request.get("over_earlier_prompts"):
                llm.reset_prefix_cache()
            cold += llm.generate([prompts[i] for i in group], sampling(None))
        outputs += llm.generate([prompts[i] for i in group],
                                [sampling(params[i]) for i in group])
        # Stores end after the answer (asynchronous saves): the next prompt must find what
        # this one stored, as the tests that look up earlier prompts expect.
        finish_connector_work(llm)
    result: dict[str, Any] = {"token_ids": [list(o.outputs[0].token_ids) for o in outputs],
                              "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
                              "kv_transfer_params": [o.kv_transfer_params for o in outputs]}
    if cold:
        result["cold_token_ids"] = [list(o.outputs[0].token_ids) for o in cold]
    if top is not None:
        result["logprobs"] = [top_logprobs(o) for o in outputs]
        if cold:
            result["cold_logprobs"] = [top_logprobs(o) for o in cold]
    if request.get("reference"):
        again = [llm.generate([prompts[i] for i in group], sampling(None)) for group in groups]
        result["reference_token_ids"] = [list(o.outputs[0].token_ids)
                                         for batch in again for o in batch]
    open(sys.argv[2], "w").write(json.dumps(result))


if __name__ == "__main__":
    main()
