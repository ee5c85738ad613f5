"""The planner against static configurations in the simulator, on the whole conversation trace
with the DeepSeek-V3 on H200 profile (store-aware routing), and the same planner fed raw
prompt tokens instead of uncached ones, and AIConfigurator's disaggregated picks:

1. the recorded trace: the best static P:D of a sweep (fewest instances meeting both p90
   targets), and the planner (target: meet them with at most 10% more instances);
2. the rate-step transform 0:1,1200:3,2400:0.5: a static configuration sized for the peak
   (the fewest instances with at least 95% of requests within both targets), and the planner
   (target: SLO attainment >= 95% on <= 70% of that static's instance-hours); beside them,
   what a schedule that knew the steps in advance would run (each phase the fewest instances
   serving 95% of its requests within both targets, switched at the step, serving at once).

Each workload also runs the planner with instances that serve at once, deciding every 30 s
(`--startup`, `--startup-interval`): the profile's 300 s start-up, with decisions every 180 s,
is Dynamo's planner's setting, and no planner that reacts to load meets the rate-step target
with it (docs/results/planner.md has the arithmetic).

    .venv/bin/python benchmarks/sim_autoscaling.py        # about two minutes
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import yaml
from disagg_operator.planner import Bounds, Replicas, Targets
from disagg_sim.autoscale import Decision
from disagg_sim.evaluation import (
    Run,
    best_static,
    known_steps,
    planner_run,
    scheduled_run,
    static_run,
    sweep,
)
from disagg_sim.profile import load_profile
from disagg_sim.simulate import fmt
from disagg_sim.trace import (
    CONVERSATION_TRACE,
    apply_rate_steps,
    parse_rate_steps,
    read_trace,
    scaled_arrivals,
    to_requests,
)

ROOT = Path(__file__).resolve().parents[1]
TRACE = CONVERSATION_TRACE
AIC = ROOT / "benchmarks" / "data" / "aiconfigurator-deepseek-v3-h200.yaml"


PEAK_SLO = 0.95


def sized_for_peak(runs: list[Run]) -> Run | None:
    """The fewest instances serving at least PEAK_SLO of requests within both targets."""
    enough = [r for r in runs if (r.summary.requests_within or 0) >= PEAK_SLO
              and r.summary.finished == r.summary.requests]
    return min(enough, key=lambda r: (r.instances, -(r.summary.requests_within or 0)),
               default=None)


def in_effect(decisions: list[Decision], every_s: float) -> list[tuple[int, Replicas]]:
    """The replicas the planner's latest decision had set at each multiple of `every_s`."""
    marks: list[tuple[int, Replicas]] = []
    mark, latest = every_s, None
    for decision in decisions:
        while decision.at > mark:
            if latest is not None:
                marks.append((int(mark), latest))
            mark += every_s
        latest = decision.replicas
    return marks


def line(run: Run, targets: Targets, reference: Run | None = None) -> str:
    s = run.summary
    ratio = f"{s.instance_hours / reference.summary.instance_hours:>6.2f}x" if reference else ""
    return (f"{run.label:<30}{run.instances:>6.2f}{s.instance_hours:>8.2f}{ratio:>8}"
            f"{fmt(s.ttft_p90):>9}{fmt(s.itl_p90):>8}{s.computed_share:>9.3f}"
            f"{s.slo_attainment or 0:>8.1%}{s.requests_within or 0:>8.1%}  "
            f"{'meets' if run.meets(targets) else 'misses'}")


HEADER = (f"{'configuration':<30}{'inst':>6}{'inst-h':>8}{'vs ref':>8}{'TTFT p90':>9}"
          f"{'ITL p90':>8}{'computed':>9}{'SLO min':>8}{'SLO req':>8}  targets")


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--profile", default="deepseek-v3-h200")
    cli.add_argument("--trace", type=Path, default=TRACE)
    cli.add_argument("--ttft", type=float, default=4.0, help="TTFT p90 target, seconds")
    cli.add_argument("--itl", type=float, default=0.05, help="ITL p90 target, seconds")
    cli.add_argument("--rate-steps", default="0:1,1200:3,2400:0.5")
    cli.add_argument("--max-prefill", type=int, default=12)
    cli.add_argument("--max-decode", type=int, default=4)
    cli.add_argument("--interval", type=float, default=180.0,
                     help="planner interval, seconds (Dynamo's planner default)")
    cli.add_argument("--scale-down-window", type=float, default=360.0)
    cli.add_argument("--startup", type=float, nargs="*", default=[0.0],
                     help="also run the planner with these instance start-up times (s), "
                     "deciding every --startup-interval")
    cli.add_argument("--startup-interval", type=float, default=30.0,
                     help="planner interval of the --startup runs, seconds (instances that "
                     "serve sooner allow decisions more often)")
    args = cli.parse_args()
    began = time.perf_counter()
    profile = load_profile(args.profile)
    targets = Targets(args.ttft, args.itl)
    bounds = Bounds(1, args.max_prefill * 2, 1, args.max_decode * 2)
    rows = read_trace(args.trace)
    configs = [(p, d) for p in range(1, args.max_prefill + 1)
               for d in range(1, args.max_decode + 1)]
    steps = parse_rate_steps(args.rate_steps)
    stepped = apply_rate_steps(rows, steps)
    workloads = {"recorded trace": to_requests(rows, arrivals=scaled_arrivals(rows)),
                 f"rate steps {args.rate_steps}": to_requests(
                     stepped, arrivals=scaled_arrivals(stepped))}
    print(f"{profile.name}, store-aware routing; targets TTFT p90 <= {args.ttft:g}s, "
          f"ITL p90 <= {args.itl * 1000:g}ms; planner every {args.interval:g}s, instances "
          f"start in {profile.startup_s:g}s")
    for name, requests in workloads.items():
        runs = sweep(profile, requests, "store-aware", configs, targets)
        best = best_static(runs, targets)
        print(f"\n{name}: {len(requests):,} requests; {sum(r.meets(targets) for r in runs)} of "
              f"{len(runs)} static configurations meet both targets")
        print(HEADER)
        if best is None:
            print("no static configuration in the sweep meets the targets")
            continue
        print(line(best, targets, best) + "   <- best static (reference)")
        peak = sized_for_peak(runs)
        if peak is not None and peak is not best:
            print(line(peak, targets, best) + f"   <- sized for the peak ({PEAK_SLO:.0%} of "
                  "requests within both targets)")
        plan, decisions = planner_run(profile, requests, "store-aware", targets, bounds,
                                      args.interval, args.scale_down_window)
        raw, _ = planner_run(profile, requests, "store-aware", targets, bounds, args.interval,
                             args.scale_down_window, raw_prompt=True)
        print(line(plan, targets, best))
        print(line(raw, targets, best))
        quicker = []
        for startup in args.startup:
            quick = dataclasses.replace(profile, startup_s=startup)
            run, _ = planner_run(quick, requests, "store-aware", targets, bounds,
                                 args.startup_interval, args.scale_down_window)
            quicker.append(Run(f"planner, start {startup:g}s, every "
                               f"{args.startup_interval:g}s", run.summary, run.instances))
            print(line(quicker[-1], targets, best))
        if name == "recorded trace" and AIC.exists():
            for pick in yaml.safe_load(AIC.read_text())["picks"]:
                run = static_run(profile, requests, "store-aware", pick["prefill"],
                                 pick["decode"], targets)
                print(line(Run(f"AIConfigurator {pick['total_gpus']} GPUs "
                               f"{pick['prefill']}P{pick['decode']}D", run.summary,
                               run.instances), targets, best))
        if name != "recorded trace" and peak is not None:
            picks = known_steps(profile, requests, "store-aware", targets,
                                [step.second for step in steps],
                                Replicas(args.max_prefill, args.max_decode), PEAK_SLO)
            summary, _ = scheduled_run(profile, requests, "store-aware", picks, targets)
            known = Run("steps known, serving at once", summary,
                        summary.instance_hours / (summary.makespan / 3600))
            print(line(known, targets, best) + "   <- " + ", ".join(
                f"{r.prefill}P{r.decode}D from {at:g}s" for at, r in picks))
            for run in (plan, *quicker):
                share = run.summary.instance_hours / peak.summary.instance_hours
                within = run.summary.requests_within or 0
                met = share <= 0.7 and within >= PEAK_SLO
                print(f"{run.label} against the static sized for the peak: {share:.0%} of its "
                      f"instance-hours (target <= 70%), {within:.1%} of requests within both "
                      f"targets (target >= {PEAK_SLO:.0%}): {'met' if met else 'not met'}")
            print(f"(a schedule that knew the steps, for reference: "
                  f"{known.summary.instance_hours / peak.summary.instance_hours:.0%} of those "
                  f"instance-hours, {known.summary.requests_within or 0:.1%} within)")
        print("planner replicas every 10 minutes:", ", ".join(
            f"{t}s {r.prefill}P{r.decode}D" for t, r in in_effect(decisions, 600)))
    print(f"\n({time.perf_counter() - began:.0f}s)")


if __name__ == "__main__":
    main()
