"""A profile: the coefficients of one model on one kind of hardware, read from a YAML file.

    prefill and decode steps: disagg_operator.performance (the planner sizes replicas with them)
    KV transfer = latency + tokens * bytes_per_token / bandwidth: prefill to decode, with the
        hand-over through the proxy in its latency
    store load = the same form: a prefill instance reading its own store hits (no hand-over);
        the transfer's when a profile has no figure of its own

Every file says where each figure comes from (`sources`): measured here by a script, or taken
from a named database or publication.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from disagg_operator.performance import DecodeModel, PrefillModel

PROFILES = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class TransferModel:
    bytes_per_token: float
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def seconds(self, tokens: int) -> float:
        return self.latency_s + tokens * self.bytes_per_token / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Profile:
    name: str
    prefill: PrefillModel
    decode: DecodeModel
    transfer: TransferModel
    store_capacity_bytes: float
    store_load: TransferModel | None = None
    engine_prefix_cache: bool = True  # vLLM's own prefix cache on each instance
    engine_cache_tokens: int = 1_000_000  # what one prefill instance's cache holds
    startup_s: float = 60.0  # from scale-out to serving
    store_lookup_s: float = 0.0005  # the proxy's existence check
    # A prefill instance reads its store hits inside the step that computes the rest of the
    # prompt (kvhelper's default, lookup_load_async: false), so the read lengthens that step
    # for every prompt in it; false: before the prompt joins the queue, beside the compute.
    store_load_in_step: bool = True
    # Every instance shares one machine's cores and would use all of them alone (vLLM's CPU
    # build on one machine): k instances busy at once each run k times slower.
    shared_cores: bool = False
    description: str = ""
    sources: dict[str, str] = field(default_factory=dict)

    def store_load_seconds(self, tokens: int) -> float:
        """A prefill instance loading `tokens` of its prompt from the store."""
        return (self.store_load or self.transfer).seconds(tokens)

    def store_blocks(self, block_tokens: int) -> int:
        return int(self.store_capacity_bytes // (self.transfer.bytes_per_token * block_tokens))


def _build(cls: type[Any], data: dict[str, Any], where: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(names)}")
    return cls(**data)


def parse_profile(data: dict[str, Any], where: str = "profile") -> Profile:
    data = dict(data)
    try:
        parts = {key: _build(cls, dict(data.pop(key)), f"{where}: {key}")
                 for key, cls in (("prefill", PrefillModel), ("decode", DecodeModel),
                                  ("transfer", TransferModel))}
    except KeyError as err:
        raise ValueError(f"{where}: missing section {err}") from None
    if (store_load := data.pop("store_load", None)) is not None:
        parts["store_load"] = _build(TransferModel, dict(store_load), f"{where}: store_load")
    profile: Profile = _build(Profile, {**data, **parts}, where)
    return profile


def load_profile(name_or_path: str) -> Profile:
    """A shipped profile by name (`tiny-mla-cpu`, `deepseek-v3-h200`) or a YAML file."""
    path = Path(name_or_path)
    if not path.exists():
        path = PROFILES / f"{name_or_path}.yaml"
    if not path.exists():
        shipped = sorted(p.stem for p in PROFILES.glob("*.yaml"))
        raise FileNotFoundError(f"no profile {name_or_path!r}: give a YAML file or one of "
                                f"{shipped}")
    return parse_profile(yaml.safe_load(path.read_text()), str(path))
