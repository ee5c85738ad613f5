"""`disagg-sim`: replay the conversation trace (or a transform of it) through a simulated XpYd
deployment and print TTFT, ITL, the computed share of prompt tokens and SLO attainment.

    disagg-sim --profile deepseek-v3-h200 --prefill 4 --decode 4 --policy store-aware
    disagg-sim --profile deepseek-v3-h200 --rate-steps 0:1,1200:3,2400:0.5 --policy all
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from disagg_operator.planner import Targets

from disagg_sim.cluster import POLICIES
from disagg_sim.profile import load_profile
from disagg_sim.simulate import HEADER, simulate
from disagg_sim.trace import (
    CONVERSATION_TRACE,
    TRACE_BLOCK,
    apply_rate_steps,
    parse_rate_steps,
    read_trace,
    sample_conversations,
    scaled_arrivals,
    to_requests,
)

DEFAULT_TRACE = CONVERSATION_TRACE


def parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(prog="disagg-sim", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--profile", default="deepseek-v3-h200",
                     help="a shipped profile name or a YAML file")
    cli.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    cli.add_argument("--policy", default="store-aware", choices=[*POLICIES, "all"])
    cli.add_argument("--prefill", type=int, default=4, help="prefill instances")
    cli.add_argument("--decode", type=int, default=4, help="decode instances")
    cli.add_argument("--rate-scale", type=float, default=1.0,
                     help="arrivals this many times as fast as recorded")
    cli.add_argument("--rate-steps", default="",
                     help="piecewise rate over the recorded timeline, SECOND:FACTOR,... "
                     "e.g. 0:1,1200:3,2400:0.5 (conversations repeated or thinned)")
    cli.add_argument("--modulo", type=int, default=0,
                     help="keep whole conversations: second hash id 0 modulo this (0: all)")
    cli.add_argument("--limit", type=int, default=None, help="at most this many requests")
    cli.add_argument("--block-tokens", type=int, default=TRACE_BLOCK,
                     help="tokens per trace block (the replay benchmark maps each to 32)")
    cli.add_argument("--max-blocks", type=int, default=None, help="cap prompts at this")
    cli.add_argument("--output-tokens", type=int, default=None,
                     help="replace recorded output lengths")
    cli.add_argument("--ttft-target", type=float, default=2.0, help="seconds, for SLO")
    cli.add_argument("--itl-target", type=float, default=0.05, help="seconds, for SLO")
    return cli


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        profile = load_profile(args.profile)
        steps = parse_rate_steps(args.rate_steps) if args.rate_steps else []
    except (FileNotFoundError, ValueError) as err:
        print(f"disagg-sim: {err}", file=sys.stderr)
        return 2
    if not args.trace.exists():
        print(f"disagg-sim: no trace at {args.trace}: give --trace", file=sys.stderr)
        return 2
    rows = read_trace(args.trace)
    if args.modulo:
        rows = sample_conversations(rows, args.modulo, args.limit)
    elif args.limit:
        rows = rows[:args.limit]
    if steps:
        rows = apply_rate_steps(rows, steps)
    arrivals = scaled_arrivals(rows, args.rate_scale)
    requests = to_requests(rows, args.block_tokens, args.max_blocks, args.output_tokens,
                           arrivals)
    targets = Targets(args.ttft_target, args.itl_target)
    print(f"{profile.name}: {len(requests)} requests, "
          f"{sum(r.prompt_tokens for r in requests):,} prompt tokens over "
          f"{arrivals[-1] if arrivals else 0:.0f} s; SLO TTFT <= {args.ttft_target:g}s, "
          f"ITL <= {args.itl_target * 1000:g}ms")
    print(HEADER)
    for policy in (POLICIES if args.policy == "all" else (args.policy,)):
        began = time.perf_counter()
        summary, _ = simulate(profile, requests, policy, args.prefill, args.decode, targets)
        print(f"{summary.row()}   ({time.perf_counter() - began:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
