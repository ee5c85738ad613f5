"""Ask NVIDIA AIConfigurator for its disaggregated configuration of DeepSeek-V3 on H200 (vLLM)
for the conversation trace's mean prompt and output lengths, cached prefix and the latency
targets, at a few cluster sizes, and write its picks for benchmarks/sim_autoscaling.py.

    /tmp/aic/bin/python simulator/profiling/aiconfigurator_disagg.py \\
        > benchmarks/data/aiconfigurator-deepseek-v3-h200.yaml

(The same virtual environment as gpu_from_aiconfigurator.py.)
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import yaml
from disagg_sim.trace import CONVERSATION_TRACE

TRACE = CONVERSATION_TRACE
TTFT_MS, TPOT_MS = 4000, 50
TOTAL_GPUS = [32, 64]
REUSED_SHARE = 0.366  # the trace's repeated prompt blocks (simulator/src/disagg_sim/data/README.md)


def main() -> None:
    rows = [json.loads(line) for line in TRACE.open() if line.strip()]
    isl = round(sum(r["input_length"] for r in rows) / len(rows))
    osl = round(sum(r["output_length"] for r in rows) / len(rows))
    prefix = round(isl * REUSED_SHARE)
    aic = shutil.which("aiconfigurator") or str(Path(sys.prefix) / "bin" / "aiconfigurator")
    picks = []
    for gpus in TOTAL_GPUS:
        out = subprocess.run(
            [aic, "cli", "default", "--model-path", "deepseek-ai/DeepSeek-V3", "--total-gpus",
             str(gpus), "--system", "h200_sxm", "--backend", "vllm", "--backend-version",
             "0.24.0", "--isl", str(isl), "--osl", str(osl), "--prefix", str(prefix),
             "--ttft", str(TTFT_MS), "--tpot", str(TPOT_MS), "--top-n", "1", "--no-color"],
            capture_output=True, text=True, check=True).stdout
        table = out.split("disagg Top Configurations", 1)[1]
        row = next(line for line in table.splitlines() if re.match(r"\|\s+1\s+\|", line))
        cells = [c.strip() for c in row.strip("|").split("|")]
        replicas, p_workers, d_workers = int(cells[9]), int(cells[11]), int(cells[15])
        picks.append({"total_gpus": gpus, "prefill": replicas * p_workers,
                      "decode": replicas * d_workers, "prefill_parallel": cells[13],
                      "decode_parallel": cells[17], "ttft_ms": float(cells[5]),
                      "tokens_per_s_per_gpu": float(cells[2])})
    yaml.safe_dump({
        "source": f"NVIDIA AIConfigurator {version('aiconfigurator')} `cli default`, "
                  "h200_sxm, vllm 0.24.0, deepseek-ai/DeepSeek-V3, disagg rank 1",
        "workload": {"isl": isl, "osl": osl, "prefix": prefix, "ttft_ms": TTFT_MS,
                     "tpot_ms": TPOT_MS},
        "picks": picks}, sys.stdout, sort_keys=False, width=100)


if __name__ == "__main__":
    main()
