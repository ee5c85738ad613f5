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


def proxy_args(**spec: Any) -> tuple[str, ...]:
    from disagg_operator.plan import ClusterAddressing, build_plan

    plan = build_plan("x", "ns", parse_spec({"model": MODEL, **spec}), ClusterAddressing("ns"))
    (proxy,) = [c for c in plan.components if c.role == "proxy"]
    return proxy.main.command


def test_store_routing_is_on_by_default_where_decode_can_recompute() -> None:
    import pytest
    from disagg_operator.spec import InvalidSpecError

    args = proxy_args()
    assert "--store-routing" in args
    assert args[args.index("--tokenizer") + 1] == MODEL["name"]  # the model's own tokenizer
    assert "--store-routing" not in proxy_args(proxy={"storeRouting": False})
    # A prompt evicted after the proxy looked would fail on decode: not by default, and an
    # explicit request for it names both fields.
    assert "--store-routing" not in proxy_args(kvTransfer={"loadFailurePolicy": "Fail"})
    with pytest.raises(InvalidSpecError, match=r"spec.proxy.storeRouting: .*loadFailurePolicy"):
        parse_spec({"model": MODEL, "proxy": {"storeRouting": True},
                    "kvTransfer": {"loadFailurePolicy": "Fail"}})
    assert "--store-routing" not in proxy_args(kvTransfer={"connector": "NixlConnector"})


def test_local_prefill_tokens_reach_the_proxy_only_with_store_routing() -> None:
    import pytest
    from disagg_operator.spec import InvalidSpecError

    args = proxy_args(proxy={"localPrefillTokens": 256})
    assert args[args.index("--local-prefill-tokens") + 1] == "256"
    assert "--local-prefill-tokens" not in proxy_args()  # 0: the proxy's own default
    with pytest.raises(InvalidSpecError, match=r"spec.proxy.localPrefillTokens: .*storeRouting"):
        parse_spec({"model": MODEL, "proxy": {"localPrefillTokens": 64,
                                              "storeRouting": False}})
    with pytest.raises(InvalidSpecError, match="spec.proxy.localPrefillTokens"):
        parse_spec({"model": MODEL, "proxy": {"localPrefillTokens": -1}})


def test_vllms_built_in_store_connector_is_one_field_away() -> None:
    import pytest
    from disagg_operator.plan import compatibility_fingerprint
    from disagg_operator.spec import InvalidSpecError

    built_in = {"implementation": "vllm", "saveDecodeCache": True}
    config = kv_transfer_config("decode", parse_spec({"model": MODEL, "kvTransfer": built_in}))
    assert config["kv_connector"] == "MooncakeStoreConnector"
    assert "kv_connector_module_path" not in config  # vLLM's own class of that name
    assert config["kv_connector_extra_config"] == {"save_decode_cache": True}
    assert "--store-routing" not in proxy_args(kvTransfer=built_in)
    with pytest.raises(InvalidSpecError, match="spec.proxy.storeRouting"):
        parse_spec({"model": MODEL, "kvTransfer": built_in, "proxy": {"storeRouting": True}})
    # The two store pages differently: never paired during a switch from one to the other.
    assert compatibility_fingerprint(parse_spec({"model": MODEL, "kvTransfer": built_in})) \
        != compatibility_fingerprint(parse_spec({"model": MODEL}))
