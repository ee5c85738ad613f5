"""Run one vLLM CPU engine in its own process for the connector tests; JSON in, JSON out.

    python run_engine.py REQUEST.json RESULT.json
REQUEST: {"model", "block_size", "prompts", "max_tokens", "kv_transfer_config" (or null),
          "kv_transfer_params" (list, one per prompt, or null)}
RESULT:  {"token_ids": [[...], ...], "kv_transfer_params": [...]}
"""

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    request = json.loads(open(sys.argv[1]).read())
    sizing = {"block_size": request["block_size"]} if request.get("block_size") else {}
    llm = LLM(model=request["model"], enforce_eager=True, max_model_len=512, **sizing,
              kv_transfer_config=request.get("kv_transfer_config"), seed=0,
              enable_prefix_caching=False)
    params = request.get("kv_transfer_params") or [None] * len(request["prompts"])
    sampling = [SamplingParams(temperature=0.0, max_tokens=request["max_tokens"],
                               extra_args={"kv_transfer_params": p} if p else None)
                for p in params]
    outputs = llm.generate(request["prompts"], sampling)
    result = {"token_ids": [list(o.outputs[0].token_ids) for o in outputs],
              "kv_transfer_params": [o.kv_transfer_params for o in outputs]}
    open(sys.argv[2], "w").write(json.dumps(result))


if __name__ == "__main__":
    main()
