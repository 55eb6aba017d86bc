"""The OpenAI-compatible HTTP app: one thin route per endpoint over a :class:`~.slots.SlotPool`.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (server-sent events when
``stream`` is true), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.

A completion's life: the body is read (at most ``max_body_bytes``, else 413), then decoded, validated
(:mod:`.protocol`) and its prompt tokenized in a thread, so that a huge prompt does not hold up the
event loop and the other requests' streams; the request waits for a slot in FIFO order
(:meth:`.SlotPool.acquire`); the completion runs in a worker thread (:func:`.slots.run_job`) on
llama-cpp-python's own ``create_completion`` / ``create_chat_completion``, so responses have
llama-cpp-python's server's shapes; its evaluations run on the engine's one compute thread
(:mod:`.compute`). A request for structured output (``response_format: {"type": "json_object"}``, a
named ``tool_choice``) has its constraint compiled in a thread too, before it is queued
(:mod:`.constraints`; a schema it refuses is a 400), and runs with it as the completion's logits
processor, never with llama-cpp-python's grammar; its answer is shaped as OpenAI's (a named
function's call as ``tool_calls``, :mod:`.responses`). A client that disconnects (while queued, generating or streaming)
has its generation stopped at the next token. A stream ends with its last chunk, while the worker
thread goes on to save the completion's state into the prompt cache (see :meth:`.SlotPool.answered`).
The slot is released when its worker thread is done, never before, whatever happens to the request's
task.

Shutdown (the lifespan's end, after uvicorn has drained or cancelled the connections on SIGTERM):
remaining jobs are cancelled and awaited, the prompt cache's background writes are flushed and the
contexts closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from llama_cache._model import default_model_path
from llama_cache.caches.base import BaseLlamaCache
from llama_cache.caches.disk import LlamaDiskCache
from llama_cache.caches.ram import LlamaRAMCache
from llama_cache.caches.redis_tier import LlamaRedisCache
from llama_cache.caches.tiered import TieredCache
from llama_cache.server.compute import ComputeThread
from llama_cache.server.config import DEFAULT_MAX_BODY_BYTES, ServerConfig
from llama_cache.server.constraints import ConstraintCompiler, ConstraintError, SequenceConstraint
from llama_cache.server.metrics import ServerMetrics
from llama_cache.server.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    StructuredOutput,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from llama_cache.server.contexts import SlotLlama, TokenizationMemo, prompt_tokens_for_chat
from llama_cache.server.slots import Cancelled, Job, QueueFull, Slot, SlotPool, run_job
from llama_cache.server.responses import structured_chunks, structured_completion

__all__ = ["Engine", "create_app", "load_engine"]

logger = logging.getLogger(__name__)

_END = object()
RETRY_AFTER_SECONDS = 1
# What uvicorn logs for a request whose client went away; recorded in the metrics only.
CLIENT_CLOSED = 499


@dataclass
class Engine:
    """What the app serves: the slots, their shared prompt cache, their compute thread and the model's name.

    ``constraints`` compiles the structured outputs requests ask for, for the model's vocabulary.
    """

    pool: SlotPool
    compute: ComputeThread
    cache: BaseLlamaCache
    tiers: list[tuple[str, BaseLlamaCache]]  # (name, cache), fastest first
    model_name: str
    n_ctx: int
    n_vocab: int
    created: int
    constraints: ConstraintCompiler
    closed: bool = False

    def close(self) -> None:
        """Flush the cache's background writes and free every context, once. Call with no job running."""
        if self.closed:
            return
        self.closed = True
        close = getattr(self.cache, "close", None)
        if close is not None:
            close()  # flushes background writes to the slower tiers
        self.compute.close()
        for slot in self.pool.slots:
            slot.llama.close()


def load_engine(config: ServerConfig) -> Engine:
    """Load ``config.parallel`` contexts of the model around one shared prompt cache.

    The model file is memory-mapped by each context's load, so the weights' pages are shared by the
    operating system (CPU backend); each context has its own KV memory. Every context evaluates on
    one :class:`~.compute.ComputeThread`.

    Raises:
        FileNotFoundError: the model file does not exist.
        ValueError: llama.cpp could not load it.
    """
    path = Path(config.model_path) if config.model_path is not None else default_model_path()
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    tiers: list[tuple[str, BaseLlamaCache]] = [("ram", LlamaRAMCache(capacity_bytes=config.cache_ram))]
    if config.cache_dir is not None:
        tiers.append(("disk", LlamaDiskCache(config.cache_dir, capacity_bytes=config.cache_disk)))
    if config.redis_url is not None:
        tiers.append(("redis", LlamaRedisCache(config.redis_url, capacity_bytes=config.cache_redis)))
    cache = tiers[0][1] if len(tiers) == 1 else TieredCache([tier for _, tier in tiers])
    options = config.context_options()
    compute = ComputeThread()
    tokenized = TokenizationMemo()
    slots = []
    try:
        for index in range(config.parallel):
            llama = SlotLlama(model_path=str(path), verbose=False, **options)
            llama.set_cache(cache)  # binds unbound disk and Redis tiers to this model
            llama.use_compute(compute)
            llama.tokenized = tokenized
            slots.append(Slot(index=index, llama=llama))
        constraints = ConstraintCompiler.for_llama(slots[0].llama)
    except BaseException:
        compute.close()
        for slot in slots:
            slot.llama.close()
        raise
    for slot in slots:
        slot.llama.siblings = [other.llama for other in slots]
    first = slots[0].llama
    return Engine(
        pool=SlotPool(slots, config.max_queue, cached=tiers[0][1].match_length),
        compute=compute,
        cache=cache,
        tiers=tiers,
        model_name=config.model_alias or path.stem,
        n_ctx=first.n_ctx(),
        n_vocab=first.n_vocab(),
        created=int(time.time()),
        constraints=constraints,
    )


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused once it passes ``limit`` bytes.

    A body declared larger (``Content-Length``) is refused before any of it is read; one sent in chunks
    is read up to the first chunk past the limit. Memory held is at most ``limit`` plus one chunk.

    Raises:
        ApiError: 413 with code ``request_too_large``.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large")


class _Disconnect:
    """Watches a request's ``receive`` channel and cancels its job when the client goes away."""

    def __init__(self, request: Request, job: Job) -> None:
        self.gone = asyncio.Event()
        self._job = job
        self._task = asyncio.ensure_future(self._watch(request.receive))

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._job.cancel.set()
                self.gone.set()
                return

    def close(self) -> None:
        self._task.cancel()


class _EventStream(Response):
    """A ``text/event-stream`` response fed by a worker thread through an asyncio queue."""

    def __init__(self, queue: asyncio.Queue[Any], finish: Callable[[], None]) -> None:
        # Not Response.__init__: it would declare a Content-Length of 0.
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        self._queue = queue
        self._finish = finish

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            while True:
                item = await self._queue.get()
                if item is _END:
                    break
                if isinstance(item, ApiError):
                    payload = json.dumps(item.body())
                else:
                    payload = json.dumps(item, ensure_ascii=False)
                await send({"type": "http.response.body", "body": f"data: {payload}\n\n".encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        except OSError:  # the client went away while we wrote (ASGI 2.4 servers raise)
            pass
        finally:
            self._finish()


class _Server:
    """The routes' shared state: the engine, its executor and the metrics."""

    def __init__(self, engine: Engine, max_body_bytes: int) -> None:
        self.engine = engine
        self.max_body_bytes = max_body_bytes
        self.executor = ThreadPoolExecutor(max_workers=len(engine.pool.slots), thread_name_prefix="llama-cache-slot")
        self.metrics = ServerMetrics(
            caches=lambda: engine.tiers,
            queue_depth=lambda: engine.pool.queue_depth,
            running=lambda: engine.pool.running,
            slots=lambda: len(engine.pool.slots),
            compute=lambda: (engine.compute.waiting, engine.compute.tokens),
        )
        self.jobs: set[Job] = set()
        self.worker_futures: set[asyncio.Future[Any]] = set()
        self.stopping = False

    # -- routes ---------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, "/v1/chat/completions")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "/v1/completions")

    async def models(self, request: Request) -> Response:
        engine = self.engine
        body = {"object": "list", "data": [
            {"id": engine.model_name, "object": "model", "created": engine.created, "owned_by": "llama-cache"},
        ]}
        return self._answer("/v1/models", JSONResponse(body))

    async def health(self, request: Request) -> Response:
        pool = self.engine.pool
        status = "stopping" if self.stopping else "ok"
        body = {"status": status, "slots": len(pool.slots), "slots_running": pool.running,
                "queue_depth": pool.queue_depth}
        return self._answer("/health", JSONResponse(body, status_code=503 if self.stopping else 200))

    async def metrics_route(self, request: Request) -> Response:
        content = await asyncio.to_thread(self.metrics.render)  # disk-tier stats may touch SQLite
        return self._answer("/metrics", Response(content, media_type="text/plain; version=0.0.4; charset=utf-8"))

    def _answer(self, endpoint: str, response: Response) -> Response:
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    # -- completions ------------------------------------------------------------------------------

    def _parse(self, endpoint: str, raw: bytes) -> tuple[CompletionRequest | ChatRequest, list[int]]:
        """The validated request and its prompt's tokens. Runs in a thread, beside running completions.

        Raises:
            ApiError: 400 for bad input or a prompt that does not fit the context.
        """
        engine = self.engine
        body = parse_json_body(raw)
        tokenizer = engine.pool.slots[0].llama  # tokenizing reads the shared vocabulary only
        parsed: CompletionRequest | ChatRequest
        if endpoint == "/v1/completions":
            parsed = parse_completion_request(body, engine.n_ctx, engine.n_vocab)
            if isinstance(parsed.prompt, list):
                tokens = parsed.prompt
            elif parsed.prompt:
                tokens = tokenizer.tokenize(parsed.prompt.encode("utf-8"), special=True)
            else:
                tokens = [tokenizer.token_bos()]
            param = "prompt"
        else:
            parsed = parse_chat_request(body, engine.n_ctx)
            try:
                tokens = prompt_tokens_for_chat(tokenizer, parsed.messages, **parsed.template_options)
            except ValueError as error:
                raise ApiError(400, str(error), param="messages", code="invalid_value") from None
            param = "messages"
        if len(tokens) >= engine.n_ctx:
            raise ApiError(400, f"the prompt is {len(tokens)} tokens long; this server's context holds "
                           f"{engine.n_ctx} tokens, prompt and completion together",
                           param=param, code="context_length_exceeded")
        return parsed, tokens

    def _constraint(self, structured: StructuredOutput) -> SequenceConstraint:
        """The compiled constraint of a request for structured output. Runs in a thread, before queueing.

        Raises:
            ApiError: 400 naming the field whose schema is refused.
        """
        try:
            return self.engine.constraints.compile(structured.schema)
        except ConstraintError as error:
            raise ApiError(400, f"'{structured.param}': {error}", param=structured.param, code=error.code) from None

    def _call(self, parsed: CompletionRequest | ChatRequest, tokens: list[int],
              constraint: SequenceConstraint | None = None) -> Callable[[SlotLlama], Any]:
        model = parsed.model or self.engine.model_name
        if isinstance(parsed, CompletionRequest):
            # The tokens routed on are the tokens evaluated: the string is not tokenized twice.
            return lambda llama: llama.create_completion(
                prompt=tokens, max_tokens=parsed.max_tokens, stream=parsed.stream, model=model, **parsed.options)
        if constraint is None:
            return lambda llama: llama.create_chat_completion(
                messages=parsed.messages, max_tokens=parsed.max_tokens, stream=parsed.stream, model=model,
                **parsed.template_options, **parsed.options)
        structured = parsed.structured
        assert structured is not None

        def constrained(llama: SlotLlama) -> Any:
            # No response_format and no named tool_choice reach the chat handler: it would build a GBNF
            # grammar from them. The constraint is the logits processor instead.
            result = llama.create_chat_completion(
                messages=parsed.messages, max_tokens=parsed.max_tokens, stream=parsed.stream, model=model,
                logits_processor=llama_cpp.LogitsProcessorList([constraint]),
                **parsed.template_options, **parsed.options)
            if parsed.stream:
                return structured_chunks(result, function=structured.function, legacy=structured.legacy,
                                         cut_short=lambda: constraint.error is not None)
            return structured_completion(result, function=structured.function, legacy=structured.legacy,
                                         cut_short=constraint.error is not None)

        return constrained

    async def _complete(self, request: Request, endpoint: str) -> Response:
        started = time.monotonic()
        try:
            if self.stopping:
                raise ApiError(503, "the server is shutting down", type="server_error", code="unavailable")
            raw = await read_body(request, self.max_body_bytes)
            parsed, tokens = await asyncio.to_thread(self._parse, endpoint, raw)
            constraint = None
            if isinstance(parsed, ChatRequest) and parsed.structured is not None:
                constraint = await asyncio.to_thread(self._constraint, parsed.structured)
        except ApiError as error:
            return self._answer(endpoint, _error_response(error))
        job = Job(started_at=started)
        watcher = _Disconnect(request, job)
        handed_over = False
        try:
            slot = await self._acquire(endpoint, tokens, watcher)
            if slot is None:
                self.metrics.requests.labels(endpoint, str(CLIENT_CLOSED)).inc()
                return Response(status_code=CLIENT_CLOSED)
            loop = asyncio.get_running_loop()
            call = self._call(parsed, tokens, constraint)
            if parsed.stream:
                queue: asyncio.Queue[Any] = asyncio.Queue()

                def answered(live: npt.NDArray[np.intc]) -> None:
                    # The client has every chunk: end its stream now, not after the cache save.
                    self.engine.pool.answered(slot, live)
                    queue.put_nowait(_END)

                future = self._start(slot, job, call,
                                     emit=lambda chunk: loop.call_soon_threadsafe(queue.put_nowait, chunk),
                                     answered=lambda live: loop.call_soon_threadsafe(answered, live))
                future.add_done_callback(lambda f: self._stream_done(endpoint, job, f, queue))
                handed_over = True

                def finish() -> None:  # also when writing failed: the generation must not outlive its client
                    job.cancel.set()
                    watcher.close()

                return _EventStream(queue, finish=finish)
            future = self._start(slot, job, call, None)
            try:
                result = await asyncio.shield(future)
            except Cancelled:
                self._record(endpoint, job, CLIENT_CLOSED)
                return Response(status_code=CLIENT_CLOSED)
            except ValueError as error:
                self._record(endpoint, job, 400)
                return _error_response(ApiError(400, str(error)))
            except asyncio.CancelledError:
                job.cancel.set()
                raise
            except Exception as error:  # noqa: BLE001 - answered as OpenAI's server_error
                logger.exception("completion failed")
                self._record(endpoint, job, 500)
                return _error_response(ApiError(500, f"the completion failed: {error}", type="server_error"))
            self._record(endpoint, job, 200)
            return JSONResponse(result)
        finally:
            if not handed_over:
                watcher.close()

    async def _acquire(self, endpoint: str, tokens: list[int], watcher: _Disconnect) -> Slot | None:
        """A slot, or None when the client left while queued.

        Raises:
            _Refused: the queue is full (carries the 503 response with ``Retry-After``).
        """
        acquiring = asyncio.ensure_future(self.engine.pool.acquire(tokens))
        gone = asyncio.ensure_future(watcher.gone.wait())
        try:
            await asyncio.wait({acquiring, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            acquiring.cancel()
            raise
        finally:
            gone.cancel()
        if acquiring.done():
            try:
                return acquiring.result()
            except QueueFull:
                error = ApiError(503, "every context is busy and the queue is full; retry later",
                                 type="server_error", code="queue_full",
                                 headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
                raise _Refused(_error_response(error)) from None
        acquiring.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await acquiring
        return None

    def _start(self, slot: Slot, job: Job, call: Callable[[SlotLlama], Any], emit: Callable[[Any], None] | None,
               answered: Callable[[npt.NDArray[np.intc]], None] | None = None) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        try:
            future = loop.run_in_executor(self.executor, run_job, slot, job, call, emit, answered)
        except BaseException:
            self.engine.pool.release(slot)
            raise
        self.jobs.add(job)
        self.worker_futures.add(future)

        def done(_: asyncio.Future[Any]) -> None:
            self.jobs.discard(job)
            self.worker_futures.discard(future)
            self.engine.pool.release(slot)

        future.add_done_callback(done)
        return future

    def _stream_done(self, endpoint: str, job: Job, future: asyncio.Future[Any], queue: asyncio.Queue[Any]) -> None:
        error = future.exception()
        if error is None:
            self._record(endpoint, job, 200)
        elif job.answered:  # failed after the client had its whole answer, in the cache save
            logger.error("saving a streamed completion's state failed: %s: %s", type(error).__name__, error)
            self._record(endpoint, job, 200)
        elif isinstance(error, Cancelled):
            self._record(endpoint, job, CLIENT_CLOSED)
        else:
            if not isinstance(error, ValueError):
                logger.error("streamed completion failed: %s: %s", type(error).__name__, error)
            self._record(endpoint, job, 400 if isinstance(error, ValueError) else 500)
            queue.put_nowait(ApiError(400 if isinstance(error, ValueError) else 500, str(error),
                                      type="invalid_request_error" if isinstance(error, ValueError) else "server_error"))
        queue.put_nowait(_END)

    def _record(self, endpoint: str, job: Job, status: int) -> None:
        metrics = self.metrics
        metrics.requests.labels(endpoint, str(status)).inc()
        if job.first_token_at is not None:
            metrics.time_to_first_token.labels(endpoint).observe(job.first_token_at - job.started_at)
        if job.prompt_tokens:
            metrics.prompt_tokens.inc(job.prompt_tokens)
            metrics.prompt_tokens_cached.inc(max(job.prompt_tokens - job.prompt_tokens_evaluated, 0))
        if job.sampled:
            metrics.generation_tokens.inc(job.sampled)

    # -- shutdown ---------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Cancel what still runs, wait for the worker threads, flush the cache, free the contexts."""
        self.stopping = True
        for job in list(self.jobs):
            job.cancel.set()
        if self.worker_futures:
            await asyncio.wait(set(self.worker_futures))
        self.executor.shutdown(wait=True)
        await asyncio.to_thread(self.engine.close)


class _Refused(Exception):
    def __init__(self, response: Response) -> None:
        super().__init__("refused")
        self.response = response


def create_app(engine: Engine, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    """The Starlette app serving ``engine``; its lifespan's end closes the engine.

    Args:
        engine: what to serve (see :func:`load_engine`).
        max_body_bytes: completion requests with a larger body are answered 413.

    The app owns its :class:`~.metrics.ServerMetrics` registry (``app.state.metrics``).
    """
    server = _Server(engine, max_body_bytes)

    async def refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, _Refused)
        endpoint = request.url.path
        server.metrics.requests.labels(endpoint, str(exc.response.status_code)).inc()
        return exc.response

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await server.shutdown()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", server.chat, methods=["POST"]),
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/health", server.health, methods=["GET"]),
            Route("/metrics", server.metrics_route, methods=["GET"]),
        ],
        exception_handlers={_Refused: refused},
        lifespan=lifespan,
    )
    app.state.metrics = server.metrics
    app.state.server = server
    return app
