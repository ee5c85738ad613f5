"""The simulator against the real local stack on the same replay window: whole conversations
of the conversation trace through real 1P2D deployments of the tiny MLA model (real vLLM,
Mooncake, etcd, proxy; benchmarks/trace_replay.py) and through the simulator with a
`tiny-mla-cpu` profile that simulator/profiling/cpu_tiny.py measures right before each run's
replays (this machine's speed drifts by up to 3x over minutes, so a profile taken at another
time says little about these replays; `--profile tiny-mla-cpu` uses the shipped one).
Printed per run: TTFT p50/p90, the prefill-computed share and where a request's time goes at
the proxy (mean store lookup / prefill / decode to the first token), measured and simulated,
per policy:

- `kvhelper` (store lookups and store-aware routing) <-> the simulator's `store-aware`;
- `reuse-off` (no lookups, round-robin) <-> the simulator's `round-robin`.

Targets: TTFT p50 within 25%, the computed share within 5 points, the same ranking.

    .venv-serving/bin/python benchmarks/sim_validation.py --runs 2     # ~20 minutes
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "simulator" / "profiling"))

from cpu_tiny import measure_profile  # noqa: E402
from disagg_sim.profile import Profile, load_profile, parse_profile  # noqa: E402
from disagg_sim.simulate import phase_means, simulate  # noqa: E402
from disagg_sim.trace import (  # noqa: E402
    read_trace,
    sample_conversations,
    scaled_arrivals,
    to_requests,
)
from trace_replay import (  # noqa: E402
    TRACE,
    engine_block_tokens,
    map_to_tokens,
    percentile,
    phase_column,
    run_stack,
    sample,
)

STACKS = {"kvhelper": "store-aware", "reuse-off": "round-robin"}


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--modulo", type=int, default=40)
    cli.add_argument("--limit", type=int, default=120)
    cli.add_argument("--speedup", type=float, default=20.0)
    cli.add_argument("--max-tokens", type=int, default=8)
    cli.add_argument("--runs", type=int, default=1, help="real runs per stack")
    cli.add_argument("--engine-threads", type=int, default=1,
                     help="OpenMP threads per engine, unbound (0: vLLM's own binding)")
    cli.add_argument("--profile", default="measure",
                     help="`measure` (a profile measured before each run) or a profile name")
    args = cli.parse_args()
    from disagg_devtools.processes import isolate_benchmark

    isolate_benchmark()  # stopped with kill: still stop what it started; own loopback
    from disagg_devtools.local.runner import share_cores
    from disagg_devtools.tiny_models import VOCAB

    share_cores(args.engine_threads)  # for the profile's deployment and the replays alike
    block_tokens, max_blocks = 32, 24
    cache_block = engine_block_tokens("mla", block_tokens)
    work = map_to_tokens(sample(TRACE, args.modulo, max_blocks, args.limit), block_tokens,
                         VOCAB, args.speedup, cache_block=cache_block)
    rows = sample_conversations(read_trace(TRACE), args.modulo, args.limit)
    requests = to_requests(rows, block_tokens, max_blocks, args.max_tokens,
                           scaled_arrivals(rows, args.speedup), cache_block=cache_block)
    assert sum(r.prompt_tokens for r in requests) == work.prompt_tokens, "replays differ"
    print(f"{len(requests)} requests, {work.prompt_tokens} prompt tokens, speedup "
          f"{args.speedup:g}; simulator profile: {args.profile}")
    print(f"{'run':<5}{'stack':<11}{'policy':<13}{'':<11}{'TTFT p50':>9}{'p90':>9}"
          f"{'computed':>10}")
    errors: dict[str, list[float]] = {stack: [] for stack in STACKS}
    with tempfile.TemporaryDirectory(prefix="sim-validation-") as scratch:
        for run in range(1, args.runs + 1):
            profile = current_profile(args.profile)
            for stack, policy in STACKS.items():
                measured = run_stack("mla", stack, 1, work,
                                     Path(scratch) / f"{stack}-{run}", args.max_tokens)
                simulated, cluster = simulate(profile, requests, policy, 1, 2)
                sim_phases = phase_means(cluster.outcomes, profile.store_lookup_s
                                         if policy == "store-aware" else 0.0)
                p50 = statistics.median(measured.outcome.ttft)
                print(f"{run:<5}{stack:<11}{policy:<13}{'measured':<11}{p50 * 1000:>7.0f}ms"
                      f"{percentile(measured.outcome.ttft, 0.9) * 1000:>7.0f}ms"
                      f"{measured.computed_share:>10.3f}   phases {phase_column(measured.phases)}"
                      f", skipped prefill {measured.routes.get('skip_prefill', 0):.0f}")
                errors[stack].append(simulated.ttft_p50 / p50 - 1)
                print(f"{'':<29}{'simulated':<11}{simulated.ttft_p50 * 1000:>7.0f}ms"
                      f"{simulated.ttft_p90 * 1000:>7.0f}ms{simulated.computed_share:>10.3f}"
                      f"   TTFT p50 {errors[stack][-1]:+.0%}, computed "
                      f"{(simulated.computed_share - measured.computed_share) * 100:+.1f} pts"
                      f"   phases {phase_column(sim_phases)}, skipped prefill "
                      f"{simulated.skipped_prefill}", flush=True)
    for stack, errs in errors.items():
        print(f"{stack}: simulated TTFT p50 vs measured, each run: "
              f"{' '.join(f'{e:+.0%}' for e in errs)} (target within 25%)")


def current_profile(name: str) -> Profile:
    if name != "measure":
        return load_profile(name)
    began = time.monotonic()
    profile = parse_profile(measure_profile(echo=lambda _: None), "measured profile")
    print(f"     profile measured in {time.monotonic() - began:.0f}s: prefill "
          f"{profile.prefill.prompt_seconds(768, 0) * 1000:.0f}ms for 768 tokens, transfer "
          f"{profile.transfer.latency_s * 1000:.0f}ms, store load "
          f"{profile.store_load_seconds(512) * 1000:.1f}ms for 512 tokens", flush=True)
    return profile


if __name__ == "__main__":
    main()
