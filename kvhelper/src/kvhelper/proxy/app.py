"""The proxy's HTTP application: prefill on one instance, decode on another, stream back.

Errors always reach the client as an HTTP status with an OpenAI-style JSON body: the upstream's
own status and body when an instance answered, 502 when it could not be reached, 504 on a
timeout, 503 when no healthy (or compatible) instance exists, 4xx for a bad request. A client
that disconnects cancels the handler, which closes the upstream connections, so vLLM aborts the
request on both instances.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvhelper.discovery import EtcdDiscovery, StaticDiscovery
from kvhelper.instances import Role
from kvhelper.proxy.continuation import StreamRecord, split_events, why_not_continued
from kvhelper.proxy.pool import Backend, Pool, Routing
from kvhelper.proxy.store_routing import Prompt, Route, StoreRouter
from kvhelper.transfer_params import REMOTE_DECODE, STORED_HINT_KEY

log = logging.getLogger("kvhelper.proxy")
REQUEST_ID = "X-Request-Id"
REQUEST_ID_KEY = web.RequestKey("request_id", str)
STARTED_KEY = web.RequestKey("started", float)  # perf_counter() when the request arrived
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
T = TypeVar("T")
# msgspec rather than the json module: the proxy parses and writes JSON three times a request.
_decode_json = msgspec.json.Decoder().decode
_encode_json = msgspec.json.Encoder().encode
JSON_HEADERS = {"Content-Type": "application/json"}


# An instance answering these may be down or overloaded: another instance is tried.
RETRIED_STATUSES = frozenset({500, 502, 503, 504})
# What a prompt token loaded from the store costs a prefill instance, in tokens computed: the
# copy into its KV cache (what it then reads again costs the same as a block it held): a few
# hundredths on a GPU (tens of KB a token at tens of GB/s, against thousands of tokens a
# second computed). Enough that, of instances equally busy, the one holding the prefix wins.
STORE_LOAD_COST = 0.1


@dataclass(frozen=True)
class ProxyConfig:
    routing: Routing = "round-robin"
    connect_timeout: float = 5.0
    prefill_timeout: float = 300.0  # the whole prefill request
    decode_timeout: float = 600.0  # longest silence while decode streams
    # A stream's wait for decode's first byte (loading KV, queueing, the first token); then
    # the request goes to another decode instance.
    decode_first_byte_timeout: float = 60.0
    prefill_attempts: int = 2  # instances tried per request, when one fails before answering
    decode_attempts: int = 3
    max_body_bytes: int = 4 * 2**20
    max_concurrency: int = 256
    health_interval: float = 5.0
    health_timeout: float = 2.0  # one health check; shorter than the interval
    eject_after: int = 2
    # An idle connection to an instance is given up after this long, before the instance's own
    # keep-alive timeout closes it (vLLM's: 5 s), so a request never goes out on one it closed.
    upstream_keepalive: float = 2.0
    # A stream whose decode instance fails after the client got tokens goes on on another
    # instance from the tokens' ids (kvhelper.proxy.continuation); off: it ends with an error.
    continue_streams: bool = True
    # Clients must present this key (Authorization: Bearer ...); from a Secret, never a flag.
    api_key: str | None = field(default=None, repr=False)
    # The key the vLLM instances were started with (--api-key); without one, the client's own
    # Authorization header is passed on.
    backend_api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.health_timeout < self.health_interval:
            raise ValueError(f"health_timeout ({self.health_timeout:g}s) must be shorter than "
                             f"health_interval ({self.health_interval:g}s)")
        if self.upstream_keepalive <= 0:
            raise ValueError(f"upstream_keepalive ({self.upstream_keepalive:g}s) must be "
                             "positive")
        for name in ("prefill_attempts", "decode_attempts", "eject_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


class ProxyError(Exception):
    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind

    def response(self, request_id: str) -> web.Response:
        return error_response(self.status, self.message, self.kind, request_id)


class AttemptFailed(Exception):
    """An instance failed before anything reached the client: another one may serve it."""

    def __init__(self, error: ProxyError) -> None:
        super().__init__(error.message)
        self.error = error


def error_response(status: int, message: str, kind: str, request_id: str = "") -> web.Response:
    headers = {REQUEST_ID: request_id} if request_id else None
    return web.json_response({"error": {"message": message, "type": kind, "code": status}},
                             status=status, headers=headers)


def prefill_request(body: dict[str, Any], stored_hint: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    """The copy of a request that prefill runs: one token, no streaming, KV kept for decode
    (and what the proxy's store lookup found, when it looked)."""
    prefill = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill["stream"] = False
    prefill["kv_transfer_params"] = dict(REMOTE_DECODE)
    if stored_hint is not None:
        prefill["kv_transfer_params"][STORED_HINT_KEY] = stored_hint
    return prefill


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("disagg_proxy_requests_total", "Client requests by outcome.",
                                ["endpoint", "code"], registry=self.registry)
        # The planner's arrival rate (disagg_operator.load): counted as requests arrive, where
        # the outcomes above come a whole generation later.
        self.arrived = Counter("disagg_proxy_requests_arrived_total",
                               "Valid completion requests received, whatever became of them.",
                               registry=self.registry)
        self.latency = Histogram("disagg_proxy_request_seconds", "Client request time.",
                                 ["endpoint"], registry=self.registry)
        self.phase = Histogram("disagg_proxy_phase_seconds",
                               "Prefill time, and decode time to the first byte.",
                               ["phase"], registry=self.registry)
        # What a client waits for its first streamed token, prefill included: the planner's
        # TTFT (vLLM's own histogram on decode starts when decode gets the request).
        self.time_to_first_token = Histogram(
            "disagg_proxy_time_to_first_token_seconds",
            "From a streamed request's arrival to its first byte sent to the client.",
            registry=self.registry, buckets=(.025, .05, .1, .25, .5, .75, 1, 1.5, 2, 3, 4, 6,
                                             8, 10, 15, 20, 30, 60, 120))
        self.upstream_errors = Counter("disagg_proxy_upstream_errors_total",
                                       "Failed calls to instances.", ["phase", "reason"],
                                       registry=self.registry)
        self.retries = Counter("disagg_proxy_retries_total",
                               "Requests sent to another instance after one failed.",
                               ["phase"], registry=self.registry)
        self.reconnects = Counter("disagg_proxy_reconnects_total",
                                  "Requests sent again on a new connection to the same "
                                  "instance, which had closed the kept-alive one they went out "
                                  "on.", ["phase"], registry=self.registry)
        # Store-aware routing (kvhelper.proxy.store_routing).
        self.routes = Counter("disagg_proxy_route_decisions_total",
                              "Requests by route: skip_prefill (the store held the prompt), "
                              "prefill, fallback (the store could not be asked).", ["kind"],
                              registry=self.registry)
        self.fallbacks = Counter("disagg_proxy_route_fallbacks_total",
                                 "Requests routed without the store, by reason.", ["reason"],
                                 registry=self.registry)
        self.prompt_tokens = Counter("disagg_proxy_prompt_tokens_total",
                                     "Prompt tokens of requests routed on the store.",
                                     registry=self.registry)
        self.prefix_hit_tokens = Counter("disagg_proxy_prefix_hit_tokens_total",
                                         "Leading prompt tokens the store held.",
                                         registry=self.registry)
        self.skip_prefill_computed = Counter(
            "disagg_proxy_skip_prefill_computed_tokens_total",
            "Prompt tokens decode computes itself for requests that skipped prefill (after "
            "the stored blocks): the prefill work those requests still cost.",
            registry=self.registry)
        self.lookup_seconds = Histogram("disagg_proxy_store_lookup_seconds",
                                        "Time to ask the store for a prompt's blocks.",
                                        registry=self.registry,
                                        buckets=(.0005, .001, .002, .005, .01, .025, .05, .1,
                                                 .25, .5, 1))
        self.hash_checks = Counter("disagg_proxy_prompt_hash_checks_total",
                                   "The proxy's prompt hash against prefill's: agree or "
                                   "disagree (then skip_prefill never matches).", ["result"],
                                   registry=self.registry)
        self.decode_alone = Counter(
            "disagg_proxy_decode_alone_total",
            "Requests a decode instance computed whole, by reason: no healthy prefill could "
            "pair with a healthy decode (no_compatible_prefill), or the KV's decode instances "
            "were gone after prefill (no_compatible_decode), e.g. during a rollout.",
            ["reason"], registry=self.registry)
        self.continuations = Counter(
            "disagg_proxy_stream_continuations_total",
            "Streams whose decode instance failed after the client got tokens, by result: "
            "continued (on another instance, to the end), failed (no instance could), "
            "not_continuable (see kvhelper.proxy.continuation).", ["result"],
            registry=self.registry)
        self._finished: dict[tuple[str, int], tuple[Any, Any]] = {}

    def routed(self, route: Route) -> None:
        self.routes.labels(route.kind).inc()
        if route.kind == "fallback":
            self.fallbacks.labels(route.reason).inc()
        if route.prompt_tokens:
            self.prompt_tokens.inc(route.prompt_tokens)
            self.prefix_hit_tokens.inc(route.stored_tokens)
        if route.kind == "skip_prefill":
            self.skip_prefill_computed.inc(route.uncached_tokens)

    def finished(self, endpoint: str, code: int, seconds: float) -> None:
        """Count a client request; the labelled children are looked up once per label set."""
        children = self._finished.get((endpoint, code))
        if children is None:
            children = (self.requests.labels(endpoint, str(code)), self.latency.labels(endpoint))
            self._finished[(endpoint, code)] = children
        children[0].inc()
        children[1].observe(seconds)


class InstancesCollector(Collector):
    """`disagg_proxy_instances{role,state}`: the instances the proxy knows, healthy or ejected,
    read from the pool at scrape time (an alert fires on no healthy decode)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("disagg_proxy_instances",
                                   "Instances the proxy routes to (healthy) or has ejected.",
                                   labels=["role", "state"])
        for role in ("prefill", "decode"):
            members = self.pool.members(role)
            healthy = sum(b.healthy for b in members)
            family.add_metric([role, "healthy"], healthy)
            family.add_metric([role, "ejected"], len(members) - healthy)
        yield family


class Proxy:
    def __init__(self, config: ProxyConfig, discovery: StaticDiscovery | EtcdDiscovery,
                 router: StoreRouter | None = None) -> None:
        self.config = config
        self.discovery = discovery
        self.pool = Pool(routing=config.routing, eject_after=config.eject_after)
        self.metrics = Metrics()
        self.metrics.registry.register(InstancesCollector(self.pool))
        self.router = router
        self._hash_disagreement_logged: set[str] = set()
        self._slots = asyncio.Semaphore(config.max_concurrency)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._fresh_session: aiohttp.ClientSession | None = None
        # Built once: these are per-request costs on the proxy's hot path.
        self._prefill_timeout = aiohttp.ClientTimeout(total=config.prefill_timeout,
                                                      sock_connect=config.connect_timeout)
        self._decode_timeout = aiohttp.ClientTimeout(total=None,
                                                     sock_connect=config.connect_timeout,
                                                     sock_read=config.decode_timeout)
        self._prefill_seconds = self.metrics.phase.labels("prefill")
        self._decode_seconds = self.metrics.phase.labels("decode")

    # -- lifecycle -------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[self._errors_as_json])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/instances", self.instances)
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _start(self, _: web.Application) -> None:
        # One pooled client: aiohttp keeps a connection pool per backend host.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=self.config.max_concurrency,
                                         keepalive_timeout=self.config.upstream_keepalive)
        reuse = aiohttp.TraceConfig()
        reuse.on_connection_reuseconn.append(_mark_reused)
        # No cookie jar: one backend's cookies must never reach another client's request.
        self._session = aiohttp.ClientSession(connector=connector, trace_configs=[reuse],
                                              cookie_jar=aiohttp.DummyCookieJar())
        # For a request sent again after its kept-alive connection was closed: never pooled.
        self._fresh_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            cookie_jar=aiohttp.DummyCookieJar())
        self._tasks = [asyncio.create_task(self.discovery.run(self.pool.update, self._stop)),
                       asyncio.create_task(self._health_loop())]
        if self.router is not None:
            self._tasks.append(asyncio.create_task(self.router.start()))

    async def _cleanup(self, _: web.Application) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for session in (self._session, self._fresh_session):
            if session is not None:
                await session.close()
        if self.router is not None:
            self.router.close()

    async def _health_loop(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
        # A new connection per check: a kept-alive one would idle as long as the instance's
        # keep-alive timeout (both 5 s by default) and could be closed as a check goes out.
        async with aiohttp.ClientSession(timeout=timeout,
                                         connector=aiohttp.TCPConnector(force_close=True)
                                         ) as session:
            while not self._stop.is_set():
                await self.pool.check_health(session)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.config.health_interval)

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the proxy app has not started"
        return self._session

    async def _post(self, phase: Role, url: str, body: bytes, headers: dict[str, str],
                    timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        """POST to an instance on a pooled connection, until its answer's headers. An instance
        that closed a kept-alive connection as the request went out on it (a race with its
        keep-alive timeout) is not down: the request goes once more, on a new connection."""
        assert self._fresh_session is not None, "the proxy app has not started"
        sent = _Reuse()
        try:
            return await self.session.post(url, data=body, headers=headers, timeout=timeout,
                                            trace_request_ctx=sent)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as err:
            if not sent.reused or isinstance(err, aiohttp.ClientConnectorError):
                raise
        self.metrics.reconnects.labels(phase).inc()
        return await self._fresh_session.post(url, data=body, headers=headers, timeout=timeout)

    # -- middleware ------------------------------------------------------------------------

    @web.middleware
    async def _errors_as_json(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        request_id = request.headers.get(REQUEST_ID) or f"disagg-{secrets.token_hex(16)}"
        request[REQUEST_ID_KEY] = request_id
        started = request[STARTED_KEY] = time.perf_counter()
        # The route, not the path: a client's made-up paths must not each become a series.
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        code = 500
        try:
            response = await handler(request)
            code = response.status
            return response
        except ProxyError as err:
            code = err.status
            return err.response(request_id)
        except web.HTTPException as err:
            code = err.status
            response = error_response(err.status, err.reason, "invalid_request_error"
                                      if err.status < 500 else "server_error", request_id)
            if "Allow" in err.headers:  # a 405 says which methods the path takes (RFC 9110)
                response.headers["Allow"] = err.headers["Allow"]
            return response
        finally:
            self.metrics.finished(endpoint, code, time.perf_counter() - started)

    # -- endpoints -------------------------------------------------------------------------

    def _authorize(self, request: web.Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("Authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise ProxyError(401, "a valid API key is required (Authorization: Bearer ...)",
                             "authentication_error")

    def _upstream_headers(self, request: web.Request, request_id: str) -> dict[str, str]:
        headers = {**JSON_HEADERS, REQUEST_ID: request_id}
        if self.config.backend_api_key is not None:
            headers["Authorization"] = f"Bearer {self.config.backend_api_key}"
        elif self.config.api_key is None and "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        return headers

    async def completions(self, request: web.Request) -> web.StreamResponse:
        request_id = request[REQUEST_ID_KEY]
        self._authorize(request)
        body = await _json_object(request)
        _check_completion(request.path, body)
        self.metrics.arrived.inc()
        if self._slots.locked():
            raise ProxyError(429, "the proxy is at its concurrency limit; retry later",
                             "rate_limit_error")
        async with self._slots:
            headers = self._upstream_headers(request, request_id)
            decodable = self.pool.fingerprints("decode")
            if not decodable:
                raise ProxyError(503, "no healthy decode instance", "service_unavailable")
            route, prompt = await self._route(request.path, body, decodable)
            decode_body = dict(body)
            if route is not None and route.kind == "skip_prefill":
                assert route.fingerprint is not None
                if route.params is not None:
                    decode_body["kv_transfer_params"] = route.params
                return await self._decode(request, route.fingerprint, "in the store",
                                          decode_body, headers)
            prefilled = await self._prefill(request.path, body, headers, decodable, route)
            if prefilled is None:
                return await self._decode_alone(request, body, headers, "no_compatible_prefill")
            prefill_backend, kv_params = prefilled
            if self.router is not None:
                self._learn(prefill_backend, prompt, kv_params)
            if kv_params is not None:
                decode_body["kv_transfer_params"] = kv_params
            return await self._decode(request, prefill_backend.instance.fingerprint,
                                      f"of prefill instance {prefill_backend.url}",
                                      decode_body, headers)

    async def _route(self, path: str, body: dict[str, Any], decodable: set[str]
                     ) -> tuple[Route | None, Prompt | None]:
        """Store-aware routing's decision, when it is on (None, None otherwise)."""
        if self.router is None:
            return None, None
        models = {b.instance.model for b in self.pool.backends.values()}
        route, prompt = await self.router.decide(path.endswith("/chat/completions"), body,
                                                 models, decodable)
        self.metrics.routed(route)
        return route, prompt

    def _learn(self, prefill: Backend, prompt: Prompt | None, kv_params: Any) -> None:
        """What prefill's answer teaches store-aware routing, and whether the proxy hashed the
        prompt as the instances do."""
        assert self.router is not None
        fingerprint = prefill.instance.fingerprint
        self.router.learn(fingerprint, kv_params)
        agrees = self.router.hash_agrees(prompt, fingerprint, kv_params)
        if agrees is None:
            return
        self.metrics.hash_checks.labels("agree" if agrees else "disagree").inc()
        if not agrees and fingerprint not in self._hash_disagreement_logged:
            self._hash_disagreement_logged.add(fingerprint)
            log.warning("the proxy hashes prompts differently from the instances of "
                        "fingerprint %s (tokenizer, chat template or PYTHONHASHSEED differ), "
                        "so no prompt of theirs can skip prefill", fingerprint)

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str],
                       decodable: set[str], route: Route | None
                       ) -> tuple[Backend, Any] | None:
        """Prefill on an instance that some healthy decode instance can pair with (no prefill
        is spent on a request no decode instance could take); an instance that fails before
        answering is given up for another, up to `prefill_attempts` in all. With store-aware
        routing, the instance with the least prompt tokens still to compute is picked. None
        when no prefill instance can pair with a decode instance at all (none is healthy, or,
        in the middle of a rollout, none has a healthy decode of its fingerprint)."""
        started = time.perf_counter()
        load = functools.partial(_expected_work, route) if self.router is not None else None
        done = await self._on_instances(
            "prefill", self.config.prefill_attempts, headers[REQUEST_ID],
            lambda tried: self.pool.pick("prefill", exclude=tried, fingerprints=decodable,
                                         load=load),
            lambda backend: self._prefill_on(backend, path, body, headers, route))
        if done is not None:
            self._prefill_seconds.observe(time.perf_counter() - started)
        return done

    async def _on_instances(self, phase: Role, attempts: int, request_id: str,
                            pick: Callable[[list[Backend]], Backend | None],
                            attempt: Callable[[Backend], Awaitable[T]]
                            ) -> tuple[Backend, T] | None:
        """Run `attempt` on an instance `pick` chooses, and on another after each failure
        that left the client untouched (AttemptFailed), `attempts` at most; the last such
        failure is raised. None when no instance could be picked at all."""
        tried: list[Backend] = []
        last: ProxyError | None = None
        for _attempt in range(attempts):
            backend = pick(tried)
            if backend is None:
                break
            if tried:
                self.metrics.retries.labels(phase).inc()
            tried.append(backend)
            try:
                return backend, await attempt(backend)
            except AttemptFailed as failed:
                log.warning("[%s] %s; trying another %s instance", request_id,
                            failed.error.message, phase)
                last = failed.error
        if last is not None:
            raise last
        return None

    async def _prefill_on(self, backend: Backend, path: str, body: dict[str, Any],
                          headers: dict[str, str], route: Route | None) -> Any:
        """One prefill attempt: decode's kv_transfer_params, or AttemptFailed when another
        instance could still serve the request, or the ProxyError to give the client."""
        uncached_tokens = route.uncached_tokens if route is not None else 0
        backend.outstanding += 1
        backend.queued_tokens += uncached_tokens
        hint = route.hint if route is not None else None
        try:
            async with await self._post("prefill", f"{backend.url}{path}",
                                        _encode_json(prefill_request(body, hint)), headers,
                                        self._prefill_timeout) as response:
                raw = await response.read()
                if response.status != 200:
                    self.metrics.upstream_errors.labels("prefill", str(response.status)).inc()
                    error = _upstream_error(response.status, raw, "prefill")
                    if response.status in RETRIED_STATUSES:
                        self.pool.request_failed(backend, f"prefill answered {response.status}")
                        raise AttemptFailed(error)
                    raise error
                self.pool.request_succeeded(backend)
                if route is not None:
                    backend.held.add(route.block_hashes)
                return _parse(raw).get("kv_transfer_params")
        except TimeoutError:  # not retried: another instance would take as long again
            self.metrics.upstream_errors.labels("prefill", "timeout").inc()
            self.pool.request_failed(backend, "prefill timed out")
            raise ProxyError(504, f"prefill instance {backend.url} did not answer within "
                             f"{self.config.prefill_timeout:g}s", "timeout") from None
        except aiohttp.ClientConnectorError as err:
            raise self._unreachable(backend, "prefill", "connect",
                                    f"refused the connection: {err}") from None
        except aiohttp.ClientError as err:
            raise self._unreachable(backend, "prefill", "transport", f"failed: {err}") from None
        finally:
            backend.outstanding -= 1
            backend.queued_tokens -= uncached_tokens

    def _unreachable(self, backend: Backend, phase: str, reason: str,
                     what: str) -> AttemptFailed:
        """An instance that refused or dropped the connection: out of the pool at once."""
        self.metrics.upstream_errors.labels(phase, reason).inc()
        self.pool.request_failed(backend, f"{phase} {what}", eject_now=True)
        return AttemptFailed(ProxyError(502, f"{phase} instance {backend.url} {what}",
                                        "bad_gateway"))

    async def _decode(self, request: web.Request, fingerprint: str, kv_source: str,
                      body: dict[str, Any], headers: dict[str, str]) -> web.StreamResponse:
        """Decode on an instance of `fingerprint` (the KV's, which is `kv_source`). An attempt
        that fails before any byte reached the client is retried on another compatible
        instance with the same kv_transfer_params (the pages stay in the store), up to
        `decode_attempts` in all. With store-aware routing, the least loaded is picked."""
        load = _outstanding if self.router is not None else None
        done = await self._on_instances(
            "decode", self.config.decode_attempts, headers[REQUEST_ID],
            lambda tried: self.pool.pick("decode", fingerprint, exclude=tried, load=load),
            lambda backend: self._decode_on(request, backend, body, headers))
        if done is not None:
            return done[1]
        # The KV's instances are gone (an old revision draining away during a rollout): any
        # decode instance computes the prompt itself rather than the request failing.
        log.info("[%s] no healthy decode instance can load the KV %s", headers[REQUEST_ID],
                 kv_source)
        plain = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        return await self._decode_alone(request, plain, headers, "no_compatible_decode")

    async def _decode_alone(self, request: web.Request, body: dict[str, Any],
                            headers: dict[str, str], reason: str) -> web.StreamResponse:
        """The whole request on one decode instance, which computes the prompt itself: no KV
        crosses instances, so no two fingerprints are ever paired."""
        log.info("[%s] decode computes the prompt itself: %s", headers[REQUEST_ID], reason)
        self.metrics.decode_alone.labels(reason).inc()
        load = _outstanding if self.router is not None else None
        done = await self._on_instances(
            "decode", self.config.decode_attempts, headers[REQUEST_ID],
            lambda tried: self.pool.pick("decode", exclude=tried, load=load),
            lambda backend: self._decode_on(request, backend, body, headers))
        if done is not None:
            return done[1]
        raise ProxyError(503, "no healthy decode instance", "service_unavailable")

    async def _decode_on(self, request: web.Request, backend: Backend, body: dict[str, Any],
                         upstream_headers: dict[str, str]) -> web.StreamResponse:
        """One decode attempt. Until its first byte, a stream waits at most
        `decode_first_byte_timeout`, and any request is given up when its instance is ejected:
        both are AttemptFailed, since nothing reached the client yet."""
        started = time.perf_counter()
        streaming = bool(body.get("stream"))
        record = self._stream_record(request.path, body)
        if record is not None:  # the tokens' ids, to continue the stream elsewhere if need be
            body = {**body, "return_token_ids": True}
        backend.outstanding += 1
        upstream: aiohttp.ClientResponse | None = None
        finished = False
        try:
            try:
                async with backend.deadline(self.config.decode_first_byte_timeout
                                            if streaming else None):
                    upstream = await self._post("decode", f"{backend.url}{request.path}",
                                                _encode_json(body), upstream_headers,
                                                self._decode_timeout)
                    if upstream.status != 200:
                        raise self._decode_refused(backend, upstream.status,
                                                   await upstream.read())
                    first = (await upstream.content.readany() if streaming
                             else await upstream.read())
            except TimeoutError:
                self.metrics.upstream_errors.labels("decode", "first_byte").inc()
                waited = time.perf_counter() - started
                why = ("was ejected" if not backend.healthy
                       else f"sent nothing within {waited:.3g}s")
                self.pool.request_failed(backend, f"decode {why}")
                raise AttemptFailed(ProxyError(504, f"decode instance {backend.url} {why}",
                                               "timeout")) from None
            except aiohttp.ClientConnectorError as err:
                raise self._unreachable(backend, "decode", "connect",
                                        f"refused the connection: {err}") from None
            except aiohttp.ClientError as err:
                raise self._unreachable(backend, "decode", "transport",
                                        f"failed: {err}") from None
            self._decode_seconds.observe(time.perf_counter() - started)
            self.pool.request_succeeded(backend)
            headers = {REQUEST_ID: upstream_headers[REQUEST_ID],
                       "Content-Type": upstream.headers.get("Content-Type", "application/json")}
            if not streaming:
                finished = True
                return web.Response(body=first, status=200, headers=headers)
            response = web.StreamResponse(status=200, headers=headers)
            await response.prepare(request)
            try:
                async with backend.deadline(None):  # ends early if the instance is ejected
                    chunk = first
                    if chunk:
                        self.metrics.time_to_first_token.observe(
                            time.perf_counter() - request[STARTED_KEY])
                    pending = bytearray()
                    while chunk:
                        if record is None:
                            await response.write(chunk)
                        else:  # whole events only: a broken one is never half sent
                            pending += chunk
                            for event in split_events(pending):
                                await response.write(record.relay(event))
                        chunk = await upstream.content.readany()
                finished = True
            except (TimeoutError, aiohttp.ClientError) as err:
                # Bytes reached the client: no retry of the request. The stream goes on on
                # another instance where its tokens allow; else it ends with an error event
                # of the status the same failure gets before the headers.
                error = self._decode_broke(backend, err)
                if record is None or not await self._continue(response, record, backend,
                                                              upstream_headers):
                    failure = {"error": {"message": error.message, "type": error.kind,
                                         "code": error.status}}
                    with contextlib.suppress(ConnectionError):
                        await response.write(b"data: " + _encode_json(failure) + b"\n\n")
            with contextlib.suppress(ConnectionError):
                await response.write_eof()
            return response
        finally:
            backend.outstanding -= 1
            if upstream is not None:  # an unfinished answer closes the connection: vLLM aborts
                upstream.release() if finished else upstream.close()

    def _stream_record(self, path: str, body: dict[str, Any]) -> StreamRecord | None:
        """A record of the stream, where it could be continued after a failure."""
        chat = path.endswith("/chat/completions")
        if not self.config.continue_streams or why_not_continued(chat, body) is not None:
            return None
        return StreamRecord(chat, body, client_wants_ids=bool(body.get("return_token_ids")))

    async def _continue(self, response: web.StreamResponse, record: StreamRecord,
                        failed: Backend, upstream_headers: dict[str, str]) -> bool:
        """Go on with a broken stream on other decode instances (of its fingerprint first),
        `decode_attempts` at most; False when none could take it to its end."""
        request_id = upstream_headers[REQUEST_ID]
        if record.finished:  # it broke after its last token: only the [DONE] was missing
            await response.write(b"data: [DONE]\n\n")
            return True
        tried, fingerprint = [failed], failed.instance.fingerprint
        for _attempt in range(self.config.decode_attempts):
            backend = (self.pool.pick("decode", fingerprint, exclude=tried)
                       or self.pool.pick("decode", exclude=tried))
            if backend is None:
                break
            tried.append(backend)
            body = record.continuation(await self._max_model_len(backend, upstream_headers)
                                       if record.chat else None)
            if isinstance(body, str):
                log.info("[%s] the stream is not continued: %s", request_id, body)
                self.metrics.continuations.labels("not_continuable").inc()
                return False
            log.warning("[%s] continuing the stream on %s after %d tokens", request_id,
                        backend.url, len(record.generated))
            if await self._continue_on(response, record, backend, body, upstream_headers):
                self.metrics.continuations.labels("continued").inc()
                return True
        self.metrics.continuations.labels("failed").inc()
        return False

    async def _continue_on(self, response: web.StreamResponse, record: StreamRecord,
                           backend: Backend, body: dict[str, Any],
                           upstream_headers: dict[str, str]) -> bool:
        """One continuation attempt: True once the stream reached its end."""
        backend.outstanding += 1
        upstream: aiohttp.ClientResponse | None = None
        try:
            async with backend.deadline(self.config.decode_first_byte_timeout):
                upstream = await self._post("decode", f"{backend.url}/v1/completions",
                                            _encode_json(body), upstream_headers,
                                            self._decode_timeout)
                if upstream.status != 200:
                    self._decode_refused(backend, upstream.status, await upstream.read())
                    return False
                chunk = await upstream.content.readany()
            pending = bytearray()
            async with backend.deadline(None):
                while chunk:
                    pending += chunk
                    for event in split_events(pending):
                        if (out := record.relay_continuation(event)) is not None:
                            await response.write(out)
                    chunk = await upstream.content.readany()
            self.pool.request_succeeded(backend)
            return record.finished
        except (TimeoutError, aiohttp.ClientError) as err:
            self._decode_broke(backend, err)
            return False
        finally:
            backend.outstanding -= 1
            if upstream is not None:
                upstream.close()

    async def _max_model_len(self, backend: Backend, headers: dict[str, str]) -> int | None:
        """The instance's context length (vLLM's /v1/models), for a chat stream asked to run
        until the context ends."""
        try:
            async with self.session.get(f"{backend.url}/v1/models", headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=5)) as answer:
                models = (await answer.json()).get("data") or []
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None
        lengths = [m.get("max_model_len") for m in models if isinstance(m, dict)]
        return next((int(n) for n in lengths if isinstance(n, int)), None)

    def _decode_refused(self, backend: Backend, status: int, raw: bytes) -> Exception:
        self.metrics.upstream_errors.labels("decode", str(status)).inc()
        error = _upstream_error(status, raw, "decode")
        if status in RETRIED_STATUSES:
            self.pool.request_failed(backend, f"decode answered {status}")
            return AttemptFailed(error)
        return error

    def _decode_broke(self, backend: Backend, err: Exception) -> ProxyError:
        """A stream that broke after its first byte."""
        if isinstance(err, TimeoutError) and not backend.healthy:
            self.metrics.upstream_errors.labels("decode", "ejected").inc()
            return ProxyError(502, f"decode instance {backend.url} was ejected while this "
                              "stream was under way", "bad_gateway")
        if isinstance(err, TimeoutError):
            self.metrics.upstream_errors.labels("decode", "timeout").inc()
            self.pool.request_failed(backend, "decode went silent")
            return ProxyError(504, f"decode instance {backend.url} went silent for "
                              f"{self.config.decode_timeout:g}s", "timeout")
        self.metrics.upstream_errors.labels("decode", "transport").inc()
        self.pool.request_failed(backend, "decode dropped a stream", eject_now=True)
        return ProxyError(502, f"decode instance {backend.url} failed: {err}", "bad_gateway")

    async def models(self, request: web.Request) -> web.StreamResponse:
        self._authorize(request)
        backend = self.pool.pick("decode") or self.pool.pick("prefill")
        if backend is None:
            raise ProxyError(503, "no healthy instance", "service_unavailable")
        headers = self._upstream_headers(request, request[REQUEST_ID_KEY])
        try:
            async with self.session.get(f"{backend.url}/v1/models", headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=10)) as upstream:
                return web.Response(body=await upstream.read(), status=upstream.status,
                                    content_type="application/json")
        except (TimeoutError, aiohttp.ClientError) as err:
            raise ProxyError(502, f"{backend.url}: {err}", "bad_gateway") from None

    async def health(self, request: web.Request) -> web.StreamResponse:
        counts = {role: sum(1 for b in self.pool.members(role) if b.healthy)
                  for role in ("prefill", "decode")}
        ok = all(counts.values())
        return web.json_response({"status": "ok" if ok else "unavailable", "healthy": counts},
                                 status=200 if ok else 503)

    async def instances(self, request: web.Request) -> web.StreamResponse:
        return web.json_response([
            {"role": b.instance.role, "id": b.instance.id, "url": b.url,
             "model": b.instance.model, "fingerprint": b.instance.fingerprint,
             "healthy": b.healthy, "outstanding": b.outstanding}
            for b in self.pool.backends.values()])

    async def metrics_endpoint(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})


@dataclass
class _Reuse:
    """Whether a request went out on a kept-alive connection (aiohttp's trace hook says)."""

    reused: bool = False


async def _mark_reused(_session: aiohttp.ClientSession, context: Any,
                       _params: aiohttp.TraceConnectionReuseconnParams) -> None:
    if isinstance(context.trace_request_ctx, _Reuse):
        context.trace_request_ctx.reused = True


def _expected_work(route: Route | None, backend: Backend) -> tuple[float, int]:
    """A prefill instance's queue (prompt tokens it has still to compute) plus what this
    request's prompt would cost there: the tokens neither its own cache holds nor the store
    (the same on every instance but for what the instance holds beyond the store), and
    STORE_LOAD_COST a token it must load from the store; then requests in progress."""
    if route is None or not route.block_hashes:
        return backend.queued_tokens, backend.outstanding
    held = backend.held.leading(route.block_hashes) * route.block_tokens
    computed = route.prompt_tokens - max(held, route.stored_tokens)
    loaded = max(0, route.stored_tokens - held)
    return backend.queued_tokens + computed + STORE_LOAD_COST * loaded, backend.outstanding


def _outstanding(backend: Backend) -> int:
    return backend.outstanding


async def _json_object(request: web.Request) -> dict[str, Any]:
    raw = await request.read()  # beyond client_max_size aiohttp raises 413
    try:
        body = _decode_json(raw)
    except msgspec.DecodeError as err:
        raise ProxyError(400, f"the request body is not valid JSON: {err}",
                         "invalid_request_error") from None
    if not isinstance(body, dict):
        raise ProxyError(400, "the request body must be a JSON object", "invalid_request_error")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise ProxyError(400, "`stream` must be true or false", "invalid_request_error")
    return body


def _check_completion(path: str, body: dict[str, Any]) -> None:
    """Refuse, before any instance spends work on it, what vLLM would refuse anyway."""
    def bad(message: str) -> ProxyError:
        return ProxyError(400, message, "invalid_request_error")

    if path.endswith("/chat/completions"):
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise bad("`messages` must be a non-empty list of chat messages")
    elif not isinstance(body.get("prompt"), str | list):
        raise bad("`prompt` is required: a string, or a list of strings or token ids")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise bad(f"`{name}` must be a whole number of at least 1, not {value!r}")


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        data = _decode_json(raw)
    except msgspec.DecodeError:
        raise ProxyError(502, "prefill answered with a body that is not JSON",
                         "bad_gateway") from None
    if not isinstance(data, dict):
        raise ProxyError(502, "prefill answered with a JSON body that is not an object",
                         "bad_gateway")
    return data


def _upstream_error(status: int, raw: bytes, phase: str) -> ProxyError:
    """The instance's own error, passed on with its status (a 200 never carries an error)."""
    try:
        data = _decode_json(raw)
        message = (data.get("error", {}).get("message") if isinstance(data.get("error"), dict)
                   else data.get("message") or data.get("detail")) or raw.decode()[:500]
    except (ValueError, AttributeError, UnicodeDecodeError):
        message = raw[:500].decode(errors="replace")
    return ProxyError(status, f"{phase}: {message}", "upstream_error")
