"""One plain vLLM instance answering prompts (token ids) greedily with logprobs: what a
disaggregated answer must equal. Runs in the serving environment, in a process of its own.

    python -m disagg_devtools.local.single_instance REQUEST_JSON
REQUEST: {"model", "dtype", "max_model_len", "prompts": [[token ids], ...], "max_tokens",
"top" (optional: how many alternatives per step to return, for the exactness criterion)}
Prints {"tokens": [[...], ...], "logprobs": [[...], ...]} (each generated token's logprob), and
with "top" also {"top": [[[[token, logprob], ...] per step] per prompt]}, best first."""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def answer(request: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=request["model"], dtype=request.get("dtype", "auto"), enforce_eager=True,
              max_model_len=int(request.get("max_model_len", 1024)), seed=0)
    top = int(request.get("top", 0))
    params = SamplingParams(temperature=0.0, max_tokens=int(request["max_tokens"]), logprobs=top)
    outputs = llm.generate([{"prompt_token_ids": p} for p in request["prompts"]], params,
                           use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs or [], ids,
                                                    strict=True)]
                for o, ids in zip(outputs, tokens, strict=True)]
    result: dict[str, Any] = {"tokens": tokens, "logprobs": logprobs}
    if top:
        result["top"] = [[sorted(([t, lp.logprob] for t, lp in step.items()),
                                 key=lambda pair: -pair[1]) for step in o.outputs[0].logprobs or []]
                         for o in outputs]
    return result


if __name__ == "__main__":
    result = answer(json.loads(sys.argv[1]))
    sys.stdout.write("\n" + json.dumps(result) + "\n")
