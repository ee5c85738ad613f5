"""Run one vLLM CPU engine in its own process for the connector tests; JSON in, JSON out.

    python run_engine.py REQUEST.json RESULT.json
REQUEST: {"model", "block_size", "prompts" (texts, or lists of token ids), "max_tokens",
          "max_model_len" (default 512), "kv_transfer_config" (or null),
          "kv_transfer_params" (list, one per prompt, or null),
          "warm_prefix_cache" (optional: run the prompts once first, with prefix caching, so
          the reported run reuses their cached full blocks)}
RESULT:  {"token_ids": [[...], ...], "kv_transfer_params": [...],
          "margins": [smallest gap between the top two logprobs over the steps, per prompt]}
"""

import json
import sys


def top_two_gap(step) -> float:
    best = sorted((entry.logprob for entry in step.values()), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


def main() -> None:
    from vllm import LLM, SamplingParams

    request = json.loads(open(sys.argv[1]).read())
    prompts = [p if isinstance(p, str) else {"prompt_token_ids": p}
               for p in request["prompts"]]
    sizing = {"block_size": request["block_size"]} if request.get("block_size") else {}
    llm = LLM(model=request["model"], enforce_eager=True,
              max_model_len=request.get("max_model_len", 512), **sizing,
              kv_transfer_config=request.get("kv_transfer_config"), seed=0,
              enable_prefix_caching=bool(request.get("warm_prefix_cache")))
    if request.get("warm_prefix_cache"):
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
    params = request.get("kv_transfer_params") or [None] * len(prompts)
    sampling = [SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], logprobs=2,
                               extra_args={"kv_transfer_params": p} if p else None)
                for p in params]
    outputs = llm.generate(prompts, sampling)
    result = {"token_ids": [list(o.outputs[0].token_ids) for o in outputs],
              "kv_transfer_params": [o.kv_transfer_params for o in outputs],
              "margins": [min(top_two_gap(step) for step in o.outputs[0].logprobs or [])
                          for o in outputs]}
    open(sys.argv[2], "w").write(json.dumps(result))


if __name__ == "__main__":
    main()
