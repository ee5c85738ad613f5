"""Run one vLLM CPU engine in its own process for the connector tests; JSON in, JSON out.

    python run_engine.py REQUEST.json RESULT.json
REQUEST: {"model", "block_size", "prompts" (texts, or lists of token ids), "max_tokens",
          "max_model_len" (default 512), "kv_transfer_config" (or null),
          "kv_transfer_params" (list, one per prompt, or null),
          "warm_prefix_cache" (optional: run the prompts once first, with prefix caching, so
          the reported run reuses their cached full blocks),
          "one_at_a_time" (optional: each prompt alone, not batched with the others)}
RESULT:  {"token_ids": [[...], ...], "kv_transfer_params": [...]}
"""

import json
import sys


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
    params = request.get("kv_transfer_params") or [None] * len(prompts)
    sampling = [SamplingParams(temperature=0.0, max_tokens=request["max_tokens"],
                               extra_args={"kv_transfer_params": p} if p else None)
                for p in params]
    groups = ([[i] for i in range(len(prompts))] if request.get("one_at_a_time")
              else [list(range(len(prompts)))])
    outputs = []
    for group in groups:
        if request.get("warm_prefix_cache"):
            llm.generate([prompts[i] for i in group],
                         SamplingParams(temperature=0.0, max_tokens=1))
        outputs += llm.generate([prompts[i] for i in group], [sampling[i] for i in group])
    result = {"token_ids": [list(o.outputs[0].token_ids) for o in outputs],
              "kv_transfer_params": [o.kv_transfer_params for o in outputs]}
    open(sys.argv[2], "w").write(json.dumps(result))


if __name__ == "__main__":
    main()
