"""kvhelper: moves the right KV bytes between disaggregated vLLM instances.

`layout` describes a KV cache (MLA or K/V, tensor-parallel sharding) from the tensors vLLM
registers; `pages` gathers and scatters whole pages; `tp` maps pages between TP sizes.
"""

__version__ = "0.1.0"
# Bumped whenever the byte format of stored pages changes; part of the compatibility fingerprint.
FORMAT_VERSION = 1
