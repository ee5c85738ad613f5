"""How long a prefill or decode step takes on one instance: the coefficients the planner sizes
replicas with and the simulator runs on (a profile file holds one set per model and hardware).

    prefill step = base + per_token * tokens + per_token_context * sum(chunk * mean context)
                   + per_context_token * sum(context before each chunk)
    decode step  = base + per_sequence * running + per_context_token * sum(contexts)
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillModel:
    base_s: float
    per_token_s: float
    per_token_context_s: float = 0.0
    max_batched_tokens: int = 8192  # vLLM's token budget per step (chunked prefill)
    gpus: int = 1
    # Each token of context (cached, or computed in an earlier chunk) that a step's new
    # tokens attend to, read again in that step. MLA pays it: vLLM's MLA prefill expands the
    # cached latent back into keys and values (kv_b_proj) for every context chunk, every
    # step. GQA reads its cached keys as they are (0).
    per_context_token_s: float = 0.0

    def step_seconds(self, tokens: int, token_context: float, context: float = 0.0) -> float:
        return (self.base_s + self.per_token_s * tokens + self.per_token_context_s * token_context
                + self.per_context_token_s * context)

    def prompt_seconds(self, tokens: float, cached: float = 0.0) -> float:
        """One prompt alone: its uncached `tokens` in budget-sized chunks after `cached`."""
        budget = self.max_batched_tokens
        chunks = max(1, math.ceil(tokens / budget))
        context = chunks * cached + budget * chunks * (chunks - 1) / 2
        return (chunks * self.base_s + self.per_token_s * tokens
                + self.per_token_context_s * tokens * (cached + tokens / 2)
                + self.per_context_token_s * context)

    def tokens_per_second(self, cached: float = 0.0, prompt_tokens: float = 0.0) -> float:
        """Saturated throughput: full budget steps, at a mean cached context of `cached` for
        prompts of `prompt_tokens` uncached tokens each (0: one prompt per step)."""
        budget = self.max_batched_tokens
        prompts = budget / max(1.0, prompt_tokens) if 0 < prompt_tokens < budget else 1.0
        return budget / self.step_seconds(budget, budget * (cached + budget / 2),
                                          prompts * cached)


@dataclass(frozen=True)
class DecodeModel:
    base_s: float
    per_sequence_s: float
    per_context_token_s: float
    max_sequences: int = 256
    kv_capacity_tokens: int = 1_000_000
    gpus: int = 1

    def step_seconds(self, batch: float, context_per_sequence: float) -> float:
        return (self.base_s + self.per_sequence_s * batch
                + self.per_context_token_s * batch * context_per_sequence)

    def batch_within(self, step_target_s: float, context_per_sequence: float,
                     reserved_per_sequence: float) -> int:
        """The most sequences one instance runs with a step no longer than the target, within
        its sequence limit and KV space (at least 1)."""
        per = self.per_sequence_s + self.per_context_token_s * context_per_sequence
        by_time = (step_target_s - self.base_s) / per if per > 0 else float("inf")
        by_kv = self.kv_capacity_tokens / max(1.0, reserved_per_sequence)
        return max(1, int(min(by_time, by_kv, self.max_sequences)))
