"""disagg-operator: a kopf operator that runs disaggregated (prefill/decode) vLLM serving."""

__version__ = "0.1.0"
