"""The simulator against the real local stack on the same replay window: whole conversations
of the conversation trace through real 1P2D deployments of the tiny MLA model (real vLLM,
Mooncake, etcd, proxy; benchmarks/trace_replay.py) and through the simulator with the
`tiny-mla-cpu` profile (simulator/profiling/cpu_tiny.py measured it on this machine).
Printed: TTFT p50/p90 and the prefill-computed share, measured and simulated, per policy:

- `kvhelper` (store lookups and store-aware routing) <-> the simulator's `store-aware`;
- `reuse-off` (no lookups, round-robin) <-> the simulator's `round-robin`.

Targets: TTFT p50 within 25%, the computed share within 5 points, the same ranking.

    .venv-serving/bin/python benchmarks/sim_validation.py --runs 2     # ~15 minutes
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from disagg_sim.profile import load_profile  # noqa: E402
from disagg_sim.simulate import simulate  # noqa: E402
from disagg_sim.trace import (  # noqa: E402
    read_trace,
    sample_conversations,
    scaled_arrivals,
    to_requests,
)
from trace_replay import TRACE, map_to_tokens, percentile, run_stack, sample  # noqa: E402

STACKS = {"kvhelper": "store-aware", "reuse-off": "round-robin"}


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--modulo", type=int, default=40)
    cli.add_argument("--limit", type=int, default=120)
    cli.add_argument("--speedup", type=float, default=20.0)
    cli.add_argument("--max-tokens", type=int, default=8)
    cli.add_argument("--runs", type=int, default=1, help="real runs per stack")
    cli.add_argument("--profile", default="tiny-mla-cpu")
    args = cli.parse_args()
    if os.getuid() == 0 and not os.environ.get("DISAGG_BENCH_NETNS"):
        os.environ["DISAGG_BENCH_NETNS"] = "1"
        os.execvp("unshare", ["unshare", "-n", "sh", "-c",
                              'ip link set lo up && exec "$0" "$@"', sys.executable, *sys.argv])
    from disagg_devtools.tiny_models import VOCAB

    block_tokens, max_blocks = 32, 24
    work = map_to_tokens(sample(TRACE, args.modulo, max_blocks, args.limit), block_tokens,
                         VOCAB, args.speedup)
    rows = sample_conversations(read_trace(TRACE), args.modulo, args.limit)
    requests = to_requests(rows, block_tokens, max_blocks, args.max_tokens,
                           scaled_arrivals(rows, args.speedup))
    assert sum(r.prompt_tokens for r in requests) == work.prompt_tokens, "replays differ"
    profile = load_profile(args.profile)
    print(f"{len(requests)} requests, {work.prompt_tokens} prompt tokens, speedup "
          f"{args.speedup:g}; simulator profile {profile.name}")
    print(f"{'stack':<11}{'policy':<13}{'':<10}{'TTFT p50':>9}{'p90':>9}{'computed':>10}")
    with tempfile.TemporaryDirectory(prefix="sim-validation-") as scratch:
        for stack, policy in STACKS.items():
            measured = [run_stack("mla", stack, 1, work, Path(scratch) / f"{stack}-{i}",
                                  args.max_tokens) for i in range(args.runs)]
            simulated, _ = simulate(profile, requests, policy, 1, 2)
            p50s = [statistics.median(m.outcome.ttft) for m in measured]
            p90s = [percentile(m.outcome.ttft, 0.9) for m in measured]
            shares = [m.computed_share for m in measured]
            for i in range(args.runs):
                print(f"{stack:<11}{policy:<13}{f'run {i + 1}':<10}{p50s[i] * 1000:>7.0f}ms"
                      f"{p90s[i] * 1000:>7.0f}ms{shares[i]:>10.3f}")
            p50 = statistics.median(p50s)
            print(f"{'':<24}{'simulated':<10}{simulated.ttft_p50 * 1000:>7.0f}ms"
                  f"{simulated.ttft_p90 * 1000:>7.0f}ms{simulated.computed_share:>10.3f}"
                  f"   TTFT p50 {simulated.ttft_p50 / p50 - 1:+.0%}, computed "
                  f"{(simulated.computed_share - statistics.median(shares)) * 100:+.1f} pts",
                  flush=True)


if __name__ == "__main__":
    main()
