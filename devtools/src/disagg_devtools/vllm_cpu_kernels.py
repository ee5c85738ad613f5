"""A vLLM general plugin (entry point `vllm.general_plugins`, which every vLLM process loads,
its spawned workers included): with DISAGG_VLLM_CPU_KERNELS=vector in the environment, vLLM's
CPU build runs its vector kernels even on a CPU with AMX tiles. Without it, nothing changes.

Why the tests set it: on a CPU with AMX, vLLM 0.32's CPU build switches to other kernels (AMX
attention; for MLA the AMX_MLA backend, which needs blocks of a multiple of 32 where the
reference CPU MLA backend forces 16). Their bfloat16 sums are ordered by the shape of the
batch, so two runs that batch the same prompt differently give a random tiny model's greedy
tokens that drift apart after tens of tokens (seen: the 86th of 100), and the tests' criterion,
tokens equal to one instance's, would measure that drift instead of the KV's transfer. And its
AMX attention kernel does not ask Linux for the AMX tile state first: an engine in a process
forked before any AMX use stops on an illegal instruction.
"""

from __future__ import annotations

import os

ENV = "DISAGG_VLLM_CPU_KERNELS"


def register() -> None:
    """Idempotent: vLLM may load its plugins more than once in a process."""
    if os.environ.get(ENV) != "vector":
        return
    import torch

    # vLLM asks torch, at each choice of kernels, whether the CPU has AMX tiles.
    torch.cpu._is_amx_tile_supported = lambda: False
