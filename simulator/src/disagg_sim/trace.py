"""Requests from the Mooncake conversation trace, and transforms of its arrival times.

The trace (`CONVERSATION_TRACE`: the conversation workload of the Mooncake FAST'25 trace release,
Apache License 2.0, shipped gzipped with this package; see data/README.md) gives each request an
arrival time in
ms, prompt and output lengths, and one hash id per 512-token prompt block; equal leading ids
mean an equal prefix. Here each request keeps its prompt as a chain of block keys (key i stands
for the whole prefix up to block i), so a cache can look up the longest stored prefix.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK = 512  # prompt tokens per hash id in the trace
CONVERSATION_TRACE = Path(__file__).resolve().parent / "data" / "conversation_trace.jsonl.gz"


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
    """A trace file, plain or gzipped (by its name)."""
    rows = []
    opened = gzip.open(path, "rt") if path.suffix == ".gz" else path.open()
    with opened as lines:
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
                arrivals: Sequence[float] | None = None, cache_block: int | None = None
                ) -> list[Request]:
    """Each trace block becomes `block_tokens` tokens (a partial last block keeps its share,
    as the replay benchmark maps them); `max_blocks` caps prompts; `output_tokens` replaces
    the recorded output lengths; `arrivals` replaces the recorded times (see `warp`).
    `cache_block`, a divisor of `block_tokens`: the engines cache that many tokens a block
    (vLLM's CPU build uses 16 for MLA models), so a trace block is several cache blocks, and
    a partial one holds those its share covers (the first tokens of the same trace block)."""
    size = cache_block or block_tokens
    if block_tokens % size:
        raise ValueError(f"cache_block {size} must divide block_tokens {block_tokens}")
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
            for part in range(share // size):
                key = hash((key, hash_id, part))
                keys.append(key)
            if share % size:
                break  # what follows a partial block is never a full one after it
        arrival = arrivals[index] if arrivals is not None else row.timestamp_ms / 1000 - start
        requests.append(Request(index, arrival, max(tokens, 1),
                                max(1, output_tokens or row.output_length), tuple(keys),
                                size))
    return requests


@dataclass(frozen=True)
class RateStep:
    """From `second` of the recorded timeline on, arrivals come `factor` times as often."""
    second: float
    factor: float


def parse_rate_steps(text: str) -> list[RateStep]:
    """`0:1,1200:3,2400:0.5`: as recorded until second 1200, three times the rate until 2400,
    half the rate after."""
    steps = []
    for item in text.split(","):
        second, sep, factor = item.partition(":")
        try:
            step = RateStep(float(second), float(factor))
        except ValueError:
            step = RateStep(0, 0)
        if not sep or step.factor <= 0:
            raise ValueError(f"rate step {item!r}: give SECOND:FACTOR with FACTOR > 0, "
                             "e.g. 0:1,1200:3,2400:0.5")
        steps.append(step)
    steps.sort(key=lambda s: s.second)
    if steps[0].second > 0:
        steps.insert(0, RateStep(0.0, 1.0))
    return steps


def conversation_of(row: TraceRow) -> int:
    """Turns of one conversation share their leading ids; the first is often a system prompt
    shared by everyone, so the second names the conversation."""
    return row.hash_ids[1] if len(row.hash_ids) > 1 else row.hash_ids[0]


def apply_rate_steps(rows: Sequence[TraceRow], steps: Sequence[RateStep],
                     copy_offset_ms: float = 1000.0) -> list[TraceRow]:
    """Change the arrival rate piecewise while keeping the timeline and whole conversations.

    In a segment with factor f, each conversation appears floor(f) times, and once more for a
    share f - floor(f) of conversations (chosen by a hash of the conversation, so a
    conversation keeps all its turns or none). Copy c of a conversation is another user's:
    its block ids after the first (the shared system prompt) are renamed, and its turns come
    `c * copy_offset_ms` later. A factor below 1 keeps that share of conversations.
    """
    out: list[TraceRow] = []
    start = rows[0].timestamp_ms if rows else 0.0
    for row in rows:
        second = (row.timestamp_ms - start) / 1000
        factor = [s.factor for s in steps if s.second <= second][-1] if steps else 1.0
        whole = int(factor)
        draw = hash((conversation_of(row), 0x5EED)) % 10_000 / 10_000
        copies = whole + (1 if draw < factor - whole else 0)
        for copy in range(copies):
            ids = row.hash_ids if copy == 0 else (
                row.hash_ids[0], *(hash((copy, i)) for i in row.hash_ids[1:]))
            out.append(TraceRow(row.timestamp_ms + copy * copy_offset_ms, row.input_length,
                                row.output_length, ids))
    out.sort(key=lambda r: r.timestamp_ms)
    return out


def scaled_arrivals(rows: Sequence[TraceRow], scale: float = 1.0) -> list[float]:
    """Seconds from the first arrival, compressed `scale` times."""
    start = rows[0].timestamp_ms if rows else 0.0
    return [(r.timestamp_ms - start) / 1000 / scale for r in rows]
