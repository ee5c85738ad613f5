"""The exactness criterion: answers through prefill/decode against one plain instance, by
per-token logprobs in float32 and by greedy tokens, and the randomized conversations it is
checked on.

The tolerance: engines that compute the same prompt split differently (whole, or a tail over a
cached or loaded context) agree in float32 to 1e-4 in every logprob (measured: the reproduction
in benchmarks/repro/vllm_cpu_rope_mla.py gives at most 4e-5 on vLLM's own prefix cache, and each
harness run measures it again on its plain instance and asserts it stays a tenth of the
tolerance). A wrong byte in the KV, or vLLM's CPU rotary kernel unfixed on MLA, moves logprobs
by 1e-2 to 1 nat. TOLERANCE sits between, an order of magnitude from each.

Greedy tokens may part only where the plain instance's own top two are within the tolerance (a
near-tie the noise can flip); the comparison of that answer stops there."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

TOLERANCE = 1e-3

# Words for prompts: text the tiny models' tokenizer splits into many tokens.
_WORDS = ("prefill decode store page block cache token latent rope head layer master etcd "
          "proxy route lease drain rollout answer prompt system user turn value key query "
          "attention transfer instance replica tenant salt hash chain window queue batch "
          "stream fault restart quorum").split()


@dataclass
class Gap:
    """How one answer compares with the plain instance's."""

    index: int
    largest: float  # the largest |logprob difference| over the steps compared
    steps: int  # steps compared (all, or up to a near-tie where the tokens parted)
    parted_at: int | None = None  # the step where greedy tokens parted, if they did
    near_tie: bool = False  # whether the plain instance's top two were within tolerance there

    @property
    def exact(self) -> bool:
        return self.largest <= TOLERANCE and (self.parted_at is None or self.near_tie)


def compare(index: int, tokens: list[int], logprobs: list[float],
            reference: list[list[list[float]]]) -> Gap:
    """`tokens` and their `logprobs` as an answer gave them; `reference`: the plain instance's
    top logprobs per step ([[token, logprob], ...], best first)."""
    largest, steps = 0.0, 0
    for step, (token, logprob, top) in enumerate(zip(tokens, logprobs, reference, strict=False)):
        best = int(top[0][0])
        if token != best:
            margin = top[0][1] - top[1][1] if len(top) > 1 else float("inf")
            return Gap(index, largest, steps, step, margin <= TOLERANCE)
        largest = max(largest, abs(logprob - top[0][1]))
        steps += 1
    return Gap(index, largest, steps)


def noise(first: list[list[list[float]]], second: list[list[list[float]]]) -> float:
    """The largest chosen-token logprob difference between two runs of one engine, over the
    steps where their greedy tokens agree."""
    largest = 0.0
    for a, b in zip(first, second, strict=False):
        if int(a[0][0]) != int(b[0][0]):
            break
        largest = max(largest, abs(a[0][1] - b[0][1]))
    return largest


def sentence(rng: random.Random, words: int) -> str:
    """Random text of `words` words that the tiny models' tokenizer splits into many tokens."""
    return " ".join(rng.choice(_WORDS) for _ in range(words))


@dataclass
class Conversations:
    """Randomized chat-like prompts: a few system prompts shared by several conversations, each
    turn a conversation's whole history plus a new question, and some turns asked again word for
    word (so stored prompts, prefixes another instance stored, and repeats all occur)."""

    seed: int
    systems: int = 2
    conversations: int = 4
    turns: int = 3
    repeats: int = 3
    history: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._system = [self._sentence(60) for _ in range(self.systems)]

    def _sentence(self, words: int) -> str:
        return sentence(self._rng, words)

    def plan(self) -> list[tuple[int, int]]:
        """(conversation, turn) in the order they are asked: turns interleave across
        conversations; -1 as the turn asks a conversation's last prompt again."""
        order = [(c, t) for t in range(self.turns) for c in range(self.conversations)]
        again = self._rng.sample(range(self.conversations), self.repeats)
        return order + [(c, -1) for c in again]

    def prompt(self, conversation: int, answer_before: str | None) -> str:
        """The next prompt of a conversation: its history, the last answer, a new question."""
        if conversation not in self.history:
            self.history[conversation] = self._system[conversation % self.systems]
        elif answer_before is not None:
            self.history[conversation] += f" assistant: {answer_before}"
        self.history[conversation] += f" user: {self._sentence(self._rng.randint(8, 30))}"
        return self.history[conversation]


def summary(gaps: list[Gap]) -> dict[str, Any]:
    return {"answers": len(gaps), "largest_gap": max((g.largest for g in gaps), default=0.0),
            "parted_at_near_ties": sum(g.parted_at is not None and g.near_tie for g in gaps),
            "not_exact": [g.index for g in gaps if not g.exact]}
