"""Requests from the Mooncake conversation trace, and transforms of its arrival times.

The trace (../shared/traces/conversation_trace.jsonl) gives each request an arrival time in
ms, prompt and output lengths, and one hash id per 512-token prompt block; equal leading ids
mean an equal prefix. Here each request keeps its prompt as a chain of block keys (key i stands
for the whole prefix up to block i), so a cache can look up the longest stored prefix.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK = 512  # prompt tokens per hash id in the trace


@dataclass(frozen=True)
class Request:
    id: int
    arrival: float  # seconds
    prompt_tokens: int
    output_tokens: int
    block_keys: tuple[int, ...]  # chained keys of the prompt's full blocks
    block_tokens: int

    @property
    def usable_blocks(self) -> int:
        """Full blocks a cache can serve: vLLM always computes the prompt's last token."""
        return min(len(self.block_keys), (self.prompt_tokens - 1) // self.block_tokens)


@dataclass(frozen=True)
class TraceRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: Path) -> list[TraceRow]:
    rows = []
    with path.open() as lines:
        for line in lines:
            if line.strip():
                row = json.loads(line)
                rows.append(TraceRow(float(row["timestamp"]), int(row["input_length"]),
                                     int(row["output_length"]), tuple(row["hash_ids"])))
    return rows


def sample_conversations(rows: Iterable[TraceRow], modulo: int, limit: int | None = None
                         ) -> list[TraceRow]:
    """Whole conversations: rows whose second hash id is 0 modulo `modulo` (every turn of a
    conversation shares its leading ids), as the replay benchmark samples them."""
    kept = [row for row in rows if len(row.hash_ids) >= 2 and row.hash_ids[1] % modulo == 0]
    return kept[:limit] if limit is not None else kept


def to_requests(rows: Sequence[TraceRow], block_tokens: int = TRACE_BLOCK,
                max_blocks: int | None = None, output_tokens: int | None = None,
                arrivals: Sequence[float] | None = None) -> list[Request]:
    """Each trace block becomes `block_tokens` tokens (a partial last block keeps its share,
    as the replay benchmark maps them); `max_blocks` caps prompts; `output_tokens` replaces
    the recorded output lengths; `arrivals` replaces the recorded times (see `warp`)."""
    requests = []
    start = rows[0].timestamp_ms / 1000 if rows else 0.0
    for index, row in enumerate(rows):
        ids = row.hash_ids[:max_blocks] if max_blocks else row.hash_ids
        length = min(row.input_length, len(ids) * TRACE_BLOCK)
        keys: list[int] = []
        tokens = 0
        key = 0
        for position, hash_id in enumerate(ids):
            covered = min(TRACE_BLOCK, length - position * TRACE_BLOCK)
            share = max(1, round(covered / TRACE_BLOCK * block_tokens))
            tokens += share
            key = hash((key, hash_id))
            if share == block_tokens:
                keys.append(key)
        arrival = arrivals[index] if arrivals is not None else row.timestamp_ms / 1000 - start
        requests.append(Request(index, arrival, max(tokens, 1),
                                max(1, output_tokens or row.output_length), tuple(keys),
                                block_tokens))
    return requests


@dataclass(frozen=True)
class RateStep:
    """From `trace_second` of the recorded timeline on, arrivals come `factor` times as fast."""
    trace_second: float
    factor: float


def parse_rate_steps(text: str) -> list[RateStep]:
    """`0:1,1200:3,2400:0.5`: trace seconds 0-1200 as recorded, 1200-2400 three times as
    fast (compressed into 400 s), from 2400 on at half the rate (stretched)."""
    steps = []
    for item in text.split(","):
        second, sep, factor = item.partition(":")
        if not sep or float(factor) <= 0:
            raise ValueError(f"rate step {item!r}: give TRACE_SECOND:FACTOR with FACTOR > 0, "
                             "e.g. 0:1,1200:3,2400:0.5")
        steps.append(RateStep(float(second), float(factor)))
    steps.sort(key=lambda s: s.trace_second)
    if steps[0].trace_second > 0:
        steps.insert(0, RateStep(0.0, 1.0))
    return steps


def warp(trace_seconds: Sequence[float], scale: float = 1.0,
         steps: Sequence[RateStep] = ()) -> list[float]:
    """Simulated arrival times: the recorded times compressed `scale` times overall, and
    piecewise by `steps` (each segment of the recorded timeline runs `factor` times faster)."""
    segments = list(steps) or [RateStep(0.0, 1.0)]
    out = []
    for tau in trace_seconds:
        t = 0.0
        for index, step in enumerate(segments):
            end = segments[index + 1].trace_second if index + 1 < len(segments) else float("inf")
            if tau <= step.trace_second:
                break
            t += (min(tau, end) - step.trace_second) / step.factor
        out.append(t / scale)
    return out
