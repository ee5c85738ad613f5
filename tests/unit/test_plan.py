"""The --kv-transfer-config the operator gives each vLLM role."""

from __future__ import annotations

from typing import Any

from disagg_operator.plan import kv_transfer_config
from disagg_operator.spec import parse_spec

MODEL = {"name": "/models/tiny", "servedModelName": "tiny"}


def extra_config(role: str, **spec: Any) -> dict[str, Any]:
    config = kv_transfer_config(role, parse_spec({"model": MODEL, **spec}))  # type: ignore[arg-type]
    return config["kv_connector_extra_config"]  # type: ignore[return-value]


def test_equal_tp_sizes_leave_the_shard_count_to_the_connector() -> None:
    assert "store_tp_size" not in extra_config("prefill", prefill={"tensorParallelSize": 2},
                                               decode={"tensorParallelSize": 2})


def test_different_tp_sizes_share_a_shard_count_both_divide() -> None:
    roles = {"prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 3}}
    assert [extra_config(role, **roles)["store_tp_size"] for role in ("prefill", "decode")] \
        == [6, 6]


def test_a_shard_count_in_extra_config_is_kept() -> None:
    found = extra_config("decode", prefill={"tensorParallelSize": 4},
                         decode={"tensorParallelSize": 1},
                         kvTransfer={"extraConfig": {"store_tp_size": 8}})
    assert found["store_tp_size"] == 8
