"""Write the DeepSeek-V3 on H200 profile from NVIDIA AIConfigurator's silicon-measured
performance database (vLLM backend), by asking its `estimate` command for prefill and decode
latencies over a grid and fitting the simulator's coefficients to them.

    python -m venv /tmp/aic && /tmp/aic/bin/pip install aiconfigurator==0.12.0 numpy pyyaml
    /tmp/aic/bin/python simulator/profiling/gpu_from_aiconfigurator.py \\
        > simulator/src/disagg_sim/profiles/deepseek-v3-h200.yaml

AIConfigurator is not a dependency of the project: only this script runs it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from importlib.metadata import version

import yaml
from fitting import fit  # beside this script

MODEL, SYSTEM, BACKEND, DB = "deepseek-ai/DeepSeek-V3", "h200_sxm", "vllm", "0.24.0"
PARALLEL = ["--tp-size", "8", "--moe-ep-size", "8", "--moe-tp-size", "1"]
PREFILL_ISL = [512, 1024, 2048, 4096, 8192]
DECODE_BATCH = [1, 8, 32, 64, 128, 256]
DECODE_CONTEXT = [1024, 4096, 8192, 16384]
# DeepSeek-V3's MLA cache per token: 61 layers x (512 latent + 64 rope) x 2 bytes (bf16).
BYTES_PER_TOKEN = 61 * 576 * 2
# A step attending to cached context expands each cached token's latent again (vLLM's MLA
# prefill, kv_b_proj per context chunk): 61 layers x 512 latent x 128 heads x (128 nope +
# 128 v) multiply-adds, against the 37B activated parameters of a token computed. The
# database has no prefix-hit figures, so this share of the per-token time stands in.
CONTEXT_SHARE = 61 * 512 * 128 * (128 + 128) / 37e9


def estimate(mode: str, isl: int, osl: int, batch: int) -> float:
    aic = shutil.which("aiconfigurator") or str(sys.prefix) + "/bin/aiconfigurator"
    out = subprocess.run(
        [aic, "cli", "estimate", "--model-path", MODEL, "--system", SYSTEM, "--backend",
         BACKEND, "--perf-db-version", DB, "--estimate-mode", mode, "--isl", str(isl),
         "--osl", str(osl), "--batch-size", str(batch), *PARALLEL, "--no-color"],
        capture_output=True, text=True, check=True).stdout
    label = "TTFT" if mode == "static_ctx" else "TPOT"
    found = re.search(rf"{label}:\s+([\d.,]+) ms", out)
    if found is None:
        raise RuntimeError(f"no {label} in aiconfigurator's output:\n{out}")
    return float(found.group(1).replace(",", "")) / 1000



def main() -> None:
    prefill = [(isl, estimate("static_ctx", isl, 1, 1)) for isl in PREFILL_ISL]
    (p_base, p_token, p_context), p_error = fit([[1, n, n * n / 2] for n, _ in prefill],
                                     [t for _, t in prefill])
    decode = [(b, c, estimate("static_gen", c, 2, b)) for b in DECODE_BATCH
              for c in DECODE_CONTEXT]
    (d_base, d_seq, d_ctx), d_error = fit([[1, b, b * c] for b, c, _ in decode],
                                          [t for *_, t in decode])
    source = (f"NVIDIA AIConfigurator {version('aiconfigurator')} `cli estimate`, database "
              f"{SYSTEM}/{BACKEND}/{DB} (SILICON mode), {MODEL}, TP8 with MoE EP8, "
              "fp8_block weights")
    profile = {
        "name": "deepseek-v3-h200",
        "description": "DeepSeek-V3 (MLA, 671B) on one 8x H200 SXM node per instance, vLLM",
        "prefill": {"base_s": p_base, "per_token_s": p_token, "per_token_context_s": p_context,
                    "max_batched_tokens": 8192, "gpus": 8,
                    "per_context_token_s": p_token * CONTEXT_SHARE},
        "decode": {"base_s": d_base, "per_sequence_s": d_seq, "per_context_token_s": d_ctx,
                   "max_sequences": 256, "kv_capacity_tokens": 500_000, "gpus": 8},
        "transfer": {"bytes_per_token": BYTES_PER_TOKEN, "bandwidth_bytes_per_s": 87e9,
                     "latency_s": 0.001},
        "store_capacity_bytes": 8 * 512 * 2**30,
        "engine_prefix_cache": True,
        "engine_cache_tokens": 500_000,
        "startup_s": 300.0,
        "store_lookup_s": 0.0005,
        "sources": {
            "prefill": f"{source}: TTFT at batch 1 for ISL {PREFILL_ISL} = "
                       f"{[round(t * 1000, 1) for _, t in prefill]} ms, fitted by "
                       f"relative least squares (largest error {p_error:.1%})",
            "decode": f"{source}: TPOT for batch {DECODE_BATCH} x context {DECODE_CONTEXT}, "
                      f"{len(decode)} points from {min(t for *_, t in decode) * 1000:.1f} to "
                      f"{max(t for *_, t in decode) * 1000:.1f} ms, fitted by "
                      f"relative least squares (largest error {d_error:.1%})",
            "prefill.max_batched_tokens": "vLLM's default max_num_batched_tokens for online "
                                          "serving on data-centre GPUs (8192)",
            "prefill.per_context_token_s": f"derived: per_token_s x {CONTEXT_SHARE:.4f}, the "
                                           "multiply-adds of expanding one cached latent "
                                           "(61 layers x 512 x 128 heads x 256, DeepSeek-V3's "
                                           "config.json) over the 37B activated parameters "
                                           "of a computed token (DeepSeek-V3 technical "
                                           "report); the database has no prefix-hit figures",
            "decode.max_sequences": "vLLM's default max_num_seqs on data-centre GPUs (256)",
            "decode.kv_capacity_tokens": "assumption: about 35 GB of KV per H200 left after "
                                         "fp8 weights (AIConfigurator reports 89 GB in use at "
                                         "batch 1), at 70,272 bytes per token (MLA is "
                                         "replicated on every TP rank)",
            "transfer.bytes_per_token": "61 layers x 576 (512 latent + 64 rope) x 2 bytes",
            "transfer.bandwidth_bytes_per_s": "Mooncake's README (kvcache-ai/Mooncake): the "
                                              "Transfer Engine reaches 87 GB/s over 4x200 Gbps "
                                              "RoCE (40 GB transferred)",
            "transfer.latency_s": "assumption: 1 ms per request (metadata and completion)",
            "store_capacity_bytes": "assumption (deployment choice): 512 GiB of DRAM from "
                                    "each of 8 nodes",
            "engine_cache_tokens": "assumption: the same KV space as decode",
            "startup_s": "assumption: a DeepSeek-V3 vLLM instance from a warm weight cache "
                         "takes about 5 minutes to serve",
        },
    }
    yaml.safe_dump(profile, sys.stdout, sort_keys=False, width=100)


if __name__ == "__main__":
    main()
