"""`python -m kvhelper.proxy`: run the XpYd proxy.

Instances come from etcd (`--etcd` and `--prefix`, as the operator renders it) or from static
lists (`--prefill host:port --decode host:port ...`, as the older demo proxies took them).
Every flag can also be set by an environment variable: DISAGG_PROXY_<FLAG>, e.g.
DISAGG_PROXY_DECODE_TIMEOUT=900. API keys come only from the environment (a Secret in a pod):
DISAGG_PROXY_API_KEY, which clients must present as `Authorization: Bearer KEY`, and
DISAGG_PROXY_BACKEND_API_KEY, the key vLLM instances were started with (--api-key); without the
latter, a client's Authorization header is passed on to the instances.

`--store-routing` asks the Mooncake store (`--mooncake-config`, as the instances use it) how
much of each prompt it already holds, with the model's tokenizer (`--tokenizer`), and sends
prompts it holds in full straight to decode (kvhelper.proxy.store_routing). PYTHONHASHSEED must
be the instances' (the operator renders 0 everywhere).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from typing import Any

from kvhelper.discovery import EtcdDiscovery, StaticDiscovery
from kvhelper.etcd_client import EtcdTls
from kvhelper.instances import split_endpoints
from kvhelper.proxy.app import Proxy, ProxyConfig
from kvhelper.proxy.server import serve


def _env(flag: str, default: Any) -> Any:
    """The flag's environment variable, if set (argparse converts string defaults by `type`)."""
    value = os.environ.get("DISAGG_PROXY_" + flag.upper().replace("-", "_"))
    if value is None:
        return default
    return value.split(",") if isinstance(default, list) else value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvhelper.proxy", description=__doc__)
    add = parser.add_argument
    add("--host", default=_env("host", "0.0.0.0"))
    add("--port", type=int, default=_env("port", 8000))
    add("--routing", choices=["round-robin", "least-outstanding"],
        default=_env("routing", "round-robin"))
    add("--etcd", default=_env("etcd", None), help="host:port[,host:port] of etcd")
    add("--prefix", default=_env("prefix", None), help="the registrations' etcd prefix")
    add("--prefill", nargs="*", default=_env("prefill", []), help="static prefill host:port")
    add("--decode", nargs="*", default=_env("decode", []), help="static decode host:port")
    add("--connect-timeout", type=float, default=_env("connect-timeout", 5.0))
    add("--prefill-timeout", type=float, default=_env("prefill-timeout", 300.0))
    add("--decode-timeout", type=float, default=_env("decode-timeout", 600.0),
        help="longest silence while decode streams")
    add("--decode-first-byte-timeout", type=float,
        default=_env("decode-first-byte-timeout", 60.0),
        help="longest wait for a stream's first byte; then another decode instance is tried")
    add("--prefill-attempts", type=int, default=_env("prefill-attempts", 2),
        help="prefill instances tried per request when one fails before answering")
    add("--decode-attempts", type=int, default=_env("decode-attempts", 3),
        help="decode instances tried per request when one fails before its first byte")
    add("--max-body-bytes", type=int, default=_env("max-body-bytes", 4 * 2**20))
    add("--max-concurrency", type=int, default=_env("max-concurrency", 256),
        help="requests in progress at once; more get 429")
    add("--max-connections", type=int, default=_env("max-connections", 4096),
        help="open client connections; more get a 503 and are closed")
    add("--idle-timeout", type=float, default=_env("idle-timeout", 30.0),
        help="seconds a client connection may stay idle, or take to send its request headers")
    add("--health-interval", type=float, default=_env("health-interval", 5.0))
    add("--health-timeout", type=float, default=_env("health-timeout", 2.0),
        help="one health check's limit; shorter than --health-interval")
    add("--lapse-grace", type=float, default=_env("lapse-grace", 30.0),
        help="seconds an instance whose registration expired without a withdrawal (etcd "
             "stalled, or its registrar died) stays routed while it passes health checks")
    add("--eject-after", type=int, default=_env("eject-after", 2),
        help="failed health checks, or failed requests, in a row that eject an instance")
    add("--upstream-keepalive", type=float, default=_env("upstream-keepalive", 2.0),
        help="seconds an idle connection to an instance is kept for reuse; shorter than the "
             "instances' own keep-alive timeout (vLLM's: 5 s)")
    add("--continue-streams", action=argparse.BooleanOptionalAction,
        default=_env("continue-streams", "true").lower() == "true",
        help="continue a stream on another decode instance when its own fails after the "
             "client got tokens (from the tokens' ids); off: end it with an error event")
    add("--store-routing", action=argparse.BooleanOptionalAction,
        default=_env("store-routing", "false").lower() == "true",
        help="route on what the Mooncake store holds, skipping prefill for stored prompts")
    add("--tokenizer", default=_env("tokenizer", None),
        help="the model's tokenizer (Hugging Face id or directory), for --store-routing")
    add("--tokenizer-revision", default=_env("tokenizer-revision", None))
    add("--trust-remote-code", action="store_true",
        default=_env("trust-remote-code", "false").lower() == "true")
    add("--mooncake-config", default=_env("mooncake-config",
                                          os.environ.get("MOONCAKE_CONFIG_PATH")),
        help="the instances' mooncake.json, for --store-routing (default $MOONCAKE_CONFIG_PATH)")
    add("--store-lookup-timeout", type=float, default=_env("store-lookup-timeout", 0.25),
        help="longest wait for the store's answer; then the request is prefilled as usual")
    add("--local-prefill-tokens", type=int, default=_env("local-prefill-tokens", 0),
        help="with --store-routing, a prompt with at most this many tokens beyond its stored "
        "prefix goes straight to decode, which loads the prefix and computes the rest "
        "(0: only prompts the store holds in full)")
    args = parser.parse_args(argv)
    if args.local_prefill_tokens < 0:
        parser.error("--local-prefill-tokens must be 0 or more")
    if args.store_routing and not (args.tokenizer and args.mooncake_config):
        parser.error("--store-routing needs --tokenizer (the model's) and --mooncake-config "
                     "(or $MOONCAKE_CONFIG_PATH)")
    if bool(args.etcd) == bool(args.prefill or args.decode):
        parser.error("give either --etcd with --prefix, or --prefill and --decode lists")
    if args.etcd and not args.prefix:
        parser.error("--etcd needs --prefix (the DisaggServing's registration prefix)")
    if not args.etcd and not (args.prefill and args.decode):
        parser.error("static discovery needs at least one --prefill and one --decode")
    if args.max_connections < 1 or args.idle_timeout <= 0:
        parser.error("--max-connections and --idle-timeout must be positive")
    if args.etcd:
        try:
            args.etcd_endpoints = split_endpoints(args.etcd)
        except ValueError as err:
            parser.error(f"--etcd: {err}")
    try:
        args.config = config(args)
    except ValueError as err:
        parser.error(str(err).replace("_", "-"))
    return args


def config(args: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(routing=args.routing, connect_timeout=args.connect_timeout,
                       prefill_timeout=args.prefill_timeout, decode_timeout=args.decode_timeout,
                       decode_first_byte_timeout=args.decode_first_byte_timeout,
                       prefill_attempts=args.prefill_attempts,
                       decode_attempts=args.decode_attempts, max_body_bytes=args.max_body_bytes,
                       max_concurrency=args.max_concurrency,
                       health_interval=args.health_interval, health_timeout=args.health_timeout,
                       eject_after=args.eject_after, upstream_keepalive=args.upstream_keepalive,
                       continue_streams=args.continue_streams,
                       # Keys come only from the environment (a Secret), never from flags.
                       api_key=os.environ.get("DISAGG_PROXY_API_KEY") or None,
                       backend_api_key=os.environ.get("DISAGG_PROXY_BACKEND_API_KEY") or None)


def build(args: argparse.Namespace) -> Proxy:
    discovery: StaticDiscovery | EtcdDiscovery = (
        EtcdDiscovery(args.etcd_endpoints, args.prefix, tls=EtcdTls.from_env(),
                      lapse_grace=args.lapse_grace) if args.etcd
        else StaticDiscovery(args.prefill, args.decode))
    proxy = Proxy(args.config, discovery)
    if args.store_routing:
        # Imported here: the tokenizer and vLLM's hashing load only when routing is on.
        from kvhelper.proxy.prompt_blocks import TokenizerSource
        from kvhelper.proxy.store_routing import LOOKUP_THREADS, StoreRouter
        from kvhelper.store import MooncakeConfig
        from kvhelper.stored_prefix import StoredPrefixLookup

        config = MooncakeConfig.load({"mooncake_config_path": args.mooncake_config})
        proxy.router = StoreRouter(
            TokenizerSource(args.tokenizer, args.tokenizer_revision, args.trust_remote_code),
            lambda: StoredPrefixLookup(config, workers=LOOKUP_THREADS), args.store_lookup_timeout,
            proxy.metrics.lookup_seconds.observe, args.local_prefill_tokens)
    return proxy


async def run(args: argparse.Namespace) -> None:
    runner, listener = await serve(build(args).app(), args.host, args.port, args.idle_timeout,
                                   args.max_connections)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    logging.getLogger("kvhelper.proxy").info("serving on %s:%d", args.host, args.port)
    try:
        await stop.wait()
    finally:
        listener.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    try:  # vLLM's image ships uvloop; it roughly halves the proxy's per-request overhead
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    with contextlib.closing(loop):
        loop.run_until_complete(run(args))


if __name__ == "__main__":
    main()
