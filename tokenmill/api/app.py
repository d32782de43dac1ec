"""create_app(engines, config): the routes, bearer auth and the handlers that turn every failure into OpenAI's error body.

The engines (one per model served, keyed by model id: a request's `model` picks one) and the metrics live on
`app.state`, never in a module global, so tests build the app around a fake engine. Every request passes the access
log (outermost), CORS, the API-key check, then the envelope guard.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client.registry import Collector
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.api import errors, lora, protocol, web
from tokenmill.api.access_log import (
    CLIENT_CLOSED_REQUEST,
    REQUEST_ID_HEADER,
    AccessLog,
    note_completion,
    note_error,
    request_id,
)
from tokenmill.api.admission import RETRY_AFTER_S, Admission
from tokenmill.api.completions import Completion, prepare_guides
from tokenmill.api.cors import cors_options
from tokenmill.api.engine_protocol import Engine
from tokenmill.api.errors import APIError
from tokenmill.api.guard import RequestGuard
from tokenmill.api.limits import RequestLimits, TextBound, check_text_length
from tokenmill.api.metrics import Metrics
from tokenmill.api.protocol import CompletionRequest, DetokenizeRequest, TokenizeRequest, parse_request
from tokenmill.api.rate_limit import ANONYMOUS, LimitStore, Quota, UsageBook, UserUsage, local_limits
from tokenmill.api.record import pseudonym
from tokenmill.api.sse import SSEResponse
from tokenmill.config import Config
from tokenmill.engine.content_filter import ContentFilter
from tokenmill.engine.outputs import AdapterInfo

logger = logging.getLogger(__name__)

# reachable without the API key: liveness probes, and the playground page (whose API calls still need it)
PUBLIC_PATHS = frozenset({"/health", "/health/"}) | web.PAGE_PATHS
METRICS_PATH = "/metrics"  # public too with --metrics-public

T = TypeVar("T")
router = APIRouter()


@dataclasses.dataclass
class SharedBooks:
    """What several ingress processes of one deployment keep in common (cluster/ledger.py); one process keeps its
    own. `refresh` runs before /metrics answers; `run` for the app's lifetime (it sends what this process counted)."""

    limits: LimitStore | None
    usage: UsageBook
    counts: Collector  # every process's counters and histograms, shown in /metrics in place of this one's
    refresh: Callable[[], Awaitable[None]]
    run: Callable[[], Awaitable[None]]


def create_app(engines: Engine | Sequence[Engine], config: Config, books: SharedBooks | None = None) -> FastAPI:
    app = FastAPI(title="tokenmill", summary="OpenAI-compatible text completions", lifespan=_lifespan)
    served = list(engines) if isinstance(engines, Sequence) else [engines]
    app.state.engines = {engine.model_name: engine for engine in served}  # in the order given: the first is the default
    if len(app.state.engines) != len(served):
        raise ValueError(f"two models are served as the same id ({[e.model_name for e in served]}): name them apart")
    clashes = [a.name for e in served for a in e.adapters() if a.name in app.state.engines]
    if clashes:
        raise ValueError(f"LoRA adapter {clashes[0]!r} has the name of a model served: name them apart")
    app.state.config = config
    app.state.created = int(time.time())
    app.state.roots = dict(zip(app.state.engines, config.model_roots, strict=False))  # model cards' `root`
    app.state.admission = Admission.from_config(config)
    app.state.limits = RequestLimits.from_config(config)
    app.state.content_filter = ContentFilter.from_file(config.content_filter) if config.content_filter else None
    app.state.books = books
    # where the rate limits' buckets live (None: no limits); tests swap in one on a fake clock
    app.state.rate_limits = books.limits if books is not None else local_limits(config)
    app.state.user_usage = books.usage if books is not None else UserUsage()  # the per-user rows /metrics shows
    app.state.metrics = Metrics(app.state.engines, app.state.user_usage)
    if books is not None:
        app.state.metrics.show_counts(books.counts)
    for name, engine in app.state.engines.items():
        engine.add_step_observer(app.state.metrics.step_observer(name))
    app.include_router(router)
    if config.allow_runtime_lora:
        app.include_router(lora.router)
    app.include_router(web.router)
    # Starlette types every handler as taking any Exception; it calls each only with the class it is registered for
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected_error)
    app.add_middleware(RequestGuard, max_body_bytes=config.max_request_bytes)
    if config.api_key:
        public = PUBLIC_PATHS | {METRICS_PATH} if config.metrics_public else PUBLIC_PATHS
        app.add_middleware(BearerAuth, keys=config.api_key, public=public)
    app.add_middleware(CORSMiddleware, **cors_options(config))  # outside the key check: preflights carry no key
    # what the access log and /metrics name a request by
    routes = [*router.routes, *lora.router.routes, *web.router.routes]
    app.add_middleware(AccessLog, metrics=app.state.metrics, routes=routes)  # last added: the outermost
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start each engine's step loop with the server (unless it already runs) and stop what we started; the shared
    books' task runs meanwhile."""
    started = []
    books: SharedBooks | None = app.state.books
    keeping = asyncio.ensure_future(books.run()) if books is not None else None
    try:
        for engine in app.state.engines.values():
            if not engine.is_healthy():
                await engine.start()
                started.append(engine)
        yield
    finally:
        if keeping is not None:
            keeping.cancel()
            await asyncio.gather(keeping, return_exceptions=True)
        await _stop(started)


async def stop_engines(app: FastAPI) -> None:
    """Stop every engine (the drain's last resort: in-flight requests end)."""
    await _stop(app.state.engines.values())


async def _stop(engines: Iterable[Engine]) -> None:
    for engine in engines:
        await engine.stop()


# --- routes ---------------------------------------------------------------------------------------------------------
def _engines(request: Request) -> dict[str, Engine]:
    engines: dict[str, Engine] = request.app.state.engines
    return engines


def _engine(request: Request, model: str | None = None) -> Engine:
    """The engine serving `model` (a LoRA adapter's: the model it is served beside); None: the first model
    (endpoints where the model is optional)."""
    return _target(request, model)[0]


def _target(request: Request, model: str | None) -> tuple[Engine, AdapterInfo | None]:
    """The engine serving `model`, and the adapter `model` names (None: the model itself)."""
    engines = _engines(request)
    if model is None:
        return next(iter(engines.values())), None
    if model in engines:
        return engines[model], None
    for engine in engines.values():
        for adapter in engine.adapters():
            if adapter.name == model:
                return engine, adapter
    raise errors.model_not_found(model)


def _chosen_by_list(
    engine: Engine, named: AdapterInfo | None, choices: list[protocol.LoraChoice]
) -> AdapterInfo | None:
    """llama-server's `lora` list: the one adapter it runs at scale 1 (None: every entry at scale 0); what the engine
    cannot run as asked (a mix of adapters, another scale, an id it does not serve) is a 400 naming the field."""
    served = engine.adapters()
    for choice in choices:
        if choice.id >= len(served):
            raise errors.invalid_request(f"no LoRA adapter has id {choice.id}: {len(served)} are served", "lora")
    running = [choice for choice in choices if choice.scale != 0]
    if len(running) > 1 or any(choice.scale != 1 for choice in running):
        raise errors.invalid_request(
            "'lora' may run one adapter, at scale 1 (the others at 0): mixed or scaled adapters are not served",
            "lora",
        )
    chosen = served[running[0].id] if running else None
    if named is not None and chosen is not None and chosen.name != named.name:
        raise errors.invalid_request(
            f"'model' names the adapter {named.name!r} and 'lora' chooses {chosen.name!r}: choose one", "lora"
        )
    return chosen or named


def _admission(request: Request) -> Admission:
    admission: Admission = request.app.state.admission
    return admission


def _user_usage(request: Request) -> UsageBook:
    usage: UsageBook = request.app.state.user_usage
    return usage


def _metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


@router.post("/v1/completions", openapi_extra=protocol.openapi_body(CompletionRequest))
async def create_completion(request: Request) -> Response:
    """With rate limits on, every answer carries their x-ratelimit-* headers, errors included (a stream's go out with
    its start)."""
    arrived = time.monotonic()
    quota = Quota(request.app.state.rate_limits, getattr(request.state, "api_key_hash", ANONYMOUS))
    try:
        response = await _complete(request, quota, arrived)
    except APIError as exc:
        exc.headers = {**(await quota.headers()), **(exc.headers or {})}
        raise
    response.headers.update(await quota.headers())
    return response


async def _complete(request: Request, quota: Quota, arrived: float) -> Response:
    """Parse → rate limits → admission: a request over its limits never takes a place in the waiting queue."""
    admission = _admission(request)
    body = parse_request(CompletionRequest, await request.body())
    quota.user = body.user
    engine, adapter = _target(request, body.model)
    if body.lora is not None:
        adapter = _chosen_by_list(engine, adapter, body.lora)
    admission.check_open(engine.is_healthy())
    await quota.check()  # out of requests: refused before its prompts are tokenised
    state = request.app.state
    limits: RequestLimits = state.limits
    least = limits.check_unprepared(body, await _text_bound(limits, engine), engine.max_model_len)
    await quota.prepay(least)  # tokenising is paid for, even when what it finds refuses the request
    await prepare_guides(body, engine)
    bos = state.config.add_bos_to_token_prompts

    def prepared() -> Completion:
        return Completion(
            body,
            engine,
            limits,
            state.content_filter,
            arrived_at=arrived,
            bos_before_ids=bos,
            tenant=quota.key,
            adapter=adapter,
        )

    completion = await asyncio.to_thread(prepared)  # tokenising and the grammar's check, off the event loop
    await quota.acquire(completion.token_budget)
    try:
        ticket = admission.admit([len(p.token_ids) for p in completion.prompts])
    except APIError:
        await quota.cancel()  # refused for the server's load, not for anything the client did: it costs nothing
        raise
    completion.admitted_at = time.monotonic()
    completion.on_started = ticket.started
    completion.start()
    attempts = [completion]  # a non-streamed completion whose engine was lost under it runs once more

    async def again() -> Completion:
        retry = await asyncio.to_thread(prepared)
        retry.admitted_at, retry.on_started = completion.admitted_at, ticket.started
        attempts.append(retry)
        return retry

    async def finish() -> None:
        """However it ended: free its admission and refund its unused tokens, then tell the metrics, the access log
        and the per-user usage what it did (the last attempt's: a lost attempt costs the client nothing)."""
        for attempt in attempts:
            attempt.close()
        completion = attempts[-1]
        ticket.close()
        used = completion.usage()["total_tokens"]
        if body.user is not None:
            _user_usage(request).record(body.user, used)
        record = completion.record(with_text=state.config.log_prompts)
        note_completion(request.scope, record)
        _metrics(request).completion(record)
        # last: a response's headers are what it leaves; shielded, so a cancelled request still gets its refund
        await asyncio.shield(quota.finish(used))

    if body.stream:
        return SSEResponse(completion.frames(), on_close=finish)
    try:
        result = await _cancel_on_disconnect(request, _response(completion, again))
    finally:
        await finish()
    if result is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if attempts[-1].echoes_prompt:  # up to --max-response-bytes: written a choice at a time, on a worker thread
        return Response(await asyncio.to_thread(_json_in_pieces, result), media_type="application/json")
    return JSONResponse(result)


async def _response(completion: Completion, again: Callable[[], Awaitable[Completion]]) -> dict[str, Any]:
    """The response; if the engine replica serving it died (cluster/), nothing has reached the client yet, so it is
    run once more, on another replica, before a 503 goes out. (A stream that has started ends with the error frame.)"""
    try:
        return await completion.response()
    except APIError as exc:
        if exc.reason != errors.ENGINE_LOST:
            raise
    logger.warning("completion %s lost its engine replica; running it again", completion.meta.id)
    return await (await again()).response()


def _json_in_pieces(result: dict[str, Any]) -> bytes:
    """JSONResponse's bytes, written a choice at a time: one call for a whole large response would hold the
    interpreter, and with it the event loop, until it returned."""

    def dumps(value: Any) -> bytes:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()

    def field(key: str, value: Any) -> bytes:
        written = b"[" + b",".join(map(dumps, value)) + b"]" if key == "choices" else dumps(value)
        return dumps(key) + b":" + written

    return b"{" + b",".join(field(key, value) for key, value in result.items()) + b"}"


async def _text_bound(limits: RequestLimits, engine: Engine) -> TextBound:
    """Found once per tokenizer by a pass over its vocabulary, on a worker thread."""
    bound = limits.known_bound(engine.tokenizer)
    return bound if bound is not None else await asyncio.to_thread(limits.text_bound, engine.tokenizer)


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    """Every model served, then the LoRA adapters served beside each (`parent`: that model)."""
    engines = _engines(request).values()
    cards = [_model_card(request, engine) for engine in engines]
    cards += [_model_card(request, engine, adapter) for engine in engines for adapter in engine.adapters()]
    return protocol.model_list(cards)


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
    return _model_card(request, *_target(request, model_id))


def _model_card(request: Request, engine: Engine, adapter: AdapterInfo | None = None) -> dict[str, Any]:
    state = request.app.state
    fim, model_len = engine.tokenizer.supports_fim, engine.max_model_len
    if adapter is None:
        root = state.roots.get(engine.model_name, engine.model_name)
        return protocol.model_card(engine.model_name, state.created, model_len, fim, root)
    return protocol.model_card(adapter.name, state.created, model_len, fim, adapter.path, parent=engine.model_name)


@router.get("/health")
@router.get("/health/", include_in_schema=False)
async def health(request: Request) -> dict[str, Any]:
    """200 while every model can serve; behind replicas (cluster/) also each model's replica count, and "degraded"
    while one has fewer replicas running than it should (it still serves)."""
    if _admission(request).draining:
        raise errors.service_unavailable("The server is shutting down.", RETRY_AFTER_S)
    engines = _engines(request)
    await _refresh(engines.values())
    sick = [name for name, engine in engines.items() if not engine.is_healthy()]
    if sick:
        raise errors.service_unavailable(f"The engine of {', '.join(sick)} is not healthy.", RETRY_AFTER_S)
    replicas = {name: report for name, engine in engines.items() if (report := engine.health()) is not None}
    if not replicas:
        return {"status": "ok"}
    degraded = any(r["replicas"] < r["target_replicas"] for r in replicas.values())
    return {"status": "degraded" if degraded else "ok", "models": replicas}


async def _refresh(engines: Iterable[Engine]) -> None:
    """Engines whose state lives elsewhere (replicas, cluster/) fetch it before a route reports it."""
    for engine in engines:
        await engine.refresh()


@router.get(METRICS_PATH, include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus metrics (api/metrics.py): text format, or OpenMetrics when the scraper asks for it."""
    await _refresh(_engines(request).values())
    books: SharedBooks | None = request.app.state.books
    if books is not None:
        await books.refresh()
    body, content_type = _metrics(request).exposition(request.headers.get("accept"))
    return Response(body, media_type=content_type)


@router.get("/stats")
async def stats(request: Request, model: str | None = None) -> dict[str, Any]:
    """The engine's counters (steps, batching, KV blocks): what the load tests assert on. `?model=`: whose (default:
    the first model's)."""
    engine = _engine(request, model)
    await _refresh([engine])
    counters = engine.stats()
    if counters is None:
        raise errors.not_found("This engine keeps no stats.")
    return dataclasses.asdict(counters)


@router.post("/tokenize", openapi_extra=protocol.openapi_body(TokenizeRequest))
async def tokenize(request: Request) -> dict[str, Any]:
    """A text is refused unread past what any prompt could be, and its tokens past what one request may send; the
    tokenising runs on a worker thread."""
    body = parse_request(TokenizeRequest, await request.body())
    engine = _engine(request, body.model)
    limits: RequestLimits = request.app.state.limits
    if isinstance(body.prompt, str):
        check_text_length(len(body.prompt), await _text_bound(limits, engine), engine.max_model_len)
    else:
        limits.check_token_count(len(body.prompt), "prompt")
    return await asyncio.to_thread(_tokenized, body, engine, limits)


def _tokenized(body: TokenizeRequest, engine: Engine, limits: RequestLimits) -> dict[str, Any]:
    tokenizer = engine.tokenizer
    if isinstance(body.prompt, str):
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        limits.check_token_count(len(tokens), "prompt")
    else:
        tokens = _checked_ids(body.prompt, tokenizer.vocab_size, "prompt")
    result: dict[str, Any] = {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        result["token_strs"] = [tokenizer.id_to_token(t) for t in tokens]
    return result


@router.post("/detokenize", openapi_extra=protocol.openapi_body(DetokenizeRequest))
async def detokenize(request: Request) -> dict[str, str]:
    body = parse_request(DetokenizeRequest, await request.body())
    engine = _engine(request, body.model)
    request.app.state.limits.check_token_count(len(body.tokens), "tokens")
    tokens = _checked_ids(body.tokens, engine.tokenizer.vocab_size, "tokens")
    return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, model: str | None = None) -> dict[str, Any]:
    """The fields lm-evaluation-harness's remote tokenizer (and vLLM's endpoint) expose; `?model=` picks whose."""
    engine = _engine(request, model)
    tok = engine.tokenizer
    return {
        "tokenizer_class": type(tok).__name__,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "eos_token_ids": list(tok.eos_ids),
        "pad_token_id": tok.pad_id,
        "add_bos_token": tok.add_bos,
        "vocab_size": tok.vocab_size,
        "model_max_length": engine.max_model_len,
        "max_model_len": engine.max_model_len,
        "chat_template": tok.chat_template,
    }


def _checked_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise errors.invalid_request(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param)
    return ids


async def _cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; if the client disconnects first, cancel it (which aborts its engine requests) and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        logger.info("client disconnected; cancelling %s", request.url.path)
        return None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# --- auth -----------------------------------------------------------------------------------------------------------
class BearerAuth:
    """Every path but the public ones needs `Authorization: Bearer <one of keys>`; compared in constant time. The
    routes learn which key matched as `request.state.api_key_hash`, never the key itself."""

    def __init__(self, app: ASGIApp, keys: Iterable[str], public: frozenset[str] = PUBLIC_PATHS) -> None:
        self.app = app
        keys = list(keys)
        self.keys = [key.encode() for key in keys]
        self.hashes = [pseudonym(key) for key in keys]
        self.public = public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public:
            await self.app(scope, receive, send)
            return
        matched = self._check(Headers(scope=scope).get("authorization"))
        if isinstance(matched, APIError):
            note_error(scope, matched)
            await _error_response(matched)(scope, receive, send)
            return
        scope.setdefault("state", {})["api_key_hash"] = self.hashes[matched]
        await self.app(scope, receive, send)

    def _check(self, header: str | None) -> int | APIError:
        """The index of the key given, or the 401."""
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return errors.authentication(
                "You didn't provide an API key. Provide it in an Authorization header using Bearer auth "
                "(i.e. Authorization: Bearer YOUR_KEY)."
            )
        given = token.strip().encode()
        matches = [hmac.compare_digest(given, key) for key in self.keys]  # every key, so timing reveals nothing
        if any(matches):
            return matches.index(True)
        return errors.authentication("Incorrect API key provided.")


# --- exception handlers ---------------------------------------------------------------------------------------------
def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    note_error(request.scope, exc)
    return _error_response(exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errs = list(exc.errors())
    body_error = bool(errs) and tuple(errs[0].get("loc", ()))[:1] == ("body",)
    return await _api_error(request, protocol.api_error_from_validation(errs, loc_prefix=1 if body_error else 0))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        error = errors.not_found(f"Invalid URL ({where})")
    elif exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow")
        error = errors.method_not_allowed(f"Method not allowed ({where})", allow)
    else:
        error = APIError(exc.status_code, str(exc.detail), headers=exc.headers)
    return await _api_error(request, error)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """Answered outside the access log's middleware (Starlette's outermost one calls it), so it adds the id itself."""
    rid = request_id(request.scope)
    logger.error("unhandled error on %s %s (request %s)", request.method, request.url.path, rid, exc_info=exc)
    response = _error_response(errors.server_error())
    if rid is not None:
        response.headers[REQUEST_ID_HEADER] = rid
    return response
