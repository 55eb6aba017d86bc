"""The OpenAI-compatible HTTP app: one thin route per endpoint over the engine (:mod:`llama_cache.engine`).

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (server-sent events when
``stream`` is true), ``POST /v1/responses`` with ``GET`` / ``DELETE /v1/responses/{id}`` (OpenAI's
Responses API, translated to and from a chat request: :mod:`.openai_responses`), ``GET /v1/models`` (each
also without ``/v1``), ``POST /tokenize`` and ``POST /detokenize`` (llama-server's shapes), ``GET /health``,
``GET /metrics``; ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, Anthropic's Messages API,
served as the chat requests they ask for (:mod:`.dialects`, :mod:`.anthropic`).

Before any route, :mod:`.access` answers CORS preflights and refuses requests without a valid API key
(when keys are configured).

A completion's life: the body is read (at most ``max_body_bytes``, else 413, within ``body_timeout``
seconds, else 408), then decoded, validated (:mod:`.protocol`) and its prompt tokenized in a thread, so
that a huge prompt does not hold up the event loop and the other requests' streams; the request waits
for a place in FIFO order (:class:`.gate.RequestGate`: ``--parallel`` run at once, ``--max-queue``
wait); its ``n`` choices run in a worker thread (:func:`.jobs.run_job`), each a sequence of the
engine's one context (:class:`~llama_cache.engine.completions.Completions`), batched with every other
request's sequences, with OpenAI's additions (usage with cached tokens, log probabilities, the system
fingerprint: :mod:`.choices`). Each choice samples with its own :class:`~.sequences.SequenceSampling`.
A request for structured output (``response_format`` ``json_object`` or ``json_schema``, a
``tool_choice`` that forces a call) has one constraint per choice compiled in a thread too, before it
is queued (:mod:`.constraints`; a schema it refuses is a 400), each the logits processor of its
choice, never llama-cpp-python's grammar; its answer is shaped as OpenAI's (a call as ``tool_calls``,
:mod:`.responses`). A client that disconnects (while queued, generating or streaming) has its
generation stopped at the next step. A stream ends with its last chunk, while the worker thread goes
on to store the completion's state in the cache tiers (with write-through, before that chunk). The
place in the gate is given back when the worker thread is done.

Shutdown (the lifespan's end, after uvicorn has drained or cancelled the connections on SIGTERM):
remaining jobs are cancelled and awaited, the engine stops (its idle sequences' states go to the cache
tiers), the tiers' background writes are flushed and the model freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import llama_cpp
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llama_cache.server.access import access_middleware, key_id, request_key_digest
from llama_cache.server.anthropic import AnthropicDialect, error_body, is_messages_path
from llama_cache.server.config import ServerConfig
from llama_cache.server.constraints import ConstraintError, SequenceConstraint
from llama_cache.server.dialects import OPENAI, Dialect
from llama_cache.server.metrics import ServerMetrics
from llama_cache.server.errors import RETRY_AFTER_SECONDS, ApiError
from llama_cache.server.limits import check_json_values
from llama_cache.server.protocol import (
    ChatRequest,
    CompletionRequest,
    StructuredOutput,
    parse_chat_request,
    parse_completion_request,
    context_length_error,
    parse_json_body,
)
from llama_cache.server.service import Service
from llama_cache.server.fronts import ChatFront
from llama_cache.server.openai_responses import ResponsesService, not_found
from llama_cache.server.response_store import open_store
from llama_cache.server.transport import END, Disconnect, EventStream, read_body
from llama_cache.engine.completions import Completions
from llama_cache.server.gate import QueueFull
from llama_cache.server.jobs import Cancelled, Job, run_job
from llama_cache.server.prompts import PromptTooLong, RenderingCancelled, prompt_tokens_for_chat
from llama_cache.server.responses import (
    ANY_FUNCTION,
    cut_short_chunks,
    cut_short_completion,
    structured_chunks,
    structured_completion,
)
from llama_cache.server.choices import ChoiceRun
from llama_cache.server.utilities import UtilityBusy, UtilityLane
from llama_cache.engine.sequences import LogitBias, Penalties, SequenceSampling, TokenLogprobs

__all__ = ["DrainingServer", "create_app"]

logger = logging.getLogger(__name__)

DRAIN_MARGIN = 2.0
"""Seconds before uvicorn's shutdown timeout at which a drain answers what is left (see ``_Server.drain``)."""
# What uvicorn logs for a request whose client went away; recorded in the metrics only.
CLIENT_CLOSED = 499


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class _Server:
    """The routes' shared state: the service, its executor and the metrics."""

    def __init__(self, service: Service, max_body_bytes: int, body_timeout: float, keyed: bool = False) -> None:
        self.service = service
        self.keyed = keyed  # API keys are configured: the metrics count tokens per key too
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.executor = ThreadPoolExecutor(max_workers=service.gate.permits, thread_name_prefix="llama-cache-request")
        self.metrics = ServerMetrics(
            caches=lambda: service.tiers,
            queue_depth=lambda: service.gate.queue_depth,
            running=lambda: service.gate.running,
            slots=lambda: service.gate.permits,
            engine=service.engine.figures,
            per_key=keyed,
        )
        self.utilities = UtilityLane(threads=1, max_waiting=service.gate.max_queue)
        self.jobs: set[Job] = set()
        self.worker_futures: set[asyncio.Future[Any]] = set()
        self.streams: set[asyncio.Queue[Any]] = set()
        self.stopping = False
        self._cut: asyncio.Event | None = None
        detokenize = service.tokenizer.detokenizer.detokenize  # reads the shared vocabulary only
        self.anthropic = AnthropicDialect(detokenize)
        self.anthropic_counting = AnthropicDialect(detokenize, counting=True)
        self.responses: ResponsesService | None = None  # set by create_app

    @property
    def cut(self) -> asyncio.Event:
        """Set when a drain's time is up: what still waits or runs is answered 503 (see :meth:`drain`)."""
        if self._cut is None:
            self._cut = asyncio.Event()
        return self._cut

    # -- routes ---------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, "/v1/chat/completions")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "/v1/completions")

    async def messages(self, request: Request) -> Response:
        """``POST /v1/messages``: Anthropic's Messages API, served as the chat request it asks for (:mod:`.anthropic`)."""
        return await self._complete(request, "/v1/messages", self.anthropic)

    async def messages_elsewhere(self, request: Request) -> Response:
        """Any other path under ``/v1/messages/`` (the Message Batches API, say): a 404 in Anthropic's shape,
        counted under ``other`` (a path a client chooses is not a label)."""
        error = ApiError(404, "this server serves POST /v1/messages and POST /v1/messages/count_tokens of the "
                         "Messages API, no other", code="not_found")
        return self._answer("other", self.anthropic.error(error))

    async def count_tokens(self, request: Request) -> Response:
        """``POST /v1/messages/count_tokens``: ``{"input_tokens"}``, the prompt a ``/v1/messages`` request
        with the same conversation and tools would evaluate (rendered and tokenized as it would be, in
        its cache namespace, on the utility lane as ``/tokenize``)."""
        endpoint, dialect = "/v1/messages/count_tokens", self.anthropic_counting
        try:
            raw = await read_body(request, self.max_body_bytes, self.body_timeout)
        except ApiError as error:
            return self._answer(endpoint, dialect.error(error))
        key_digest = request_key_digest(request.scope)
        job = Job(started_at=time.monotonic())
        try:
            _, tokens, _ = await self.utilities.run(lambda: self._parse(endpoint, raw, job, key_digest, dialect))
        except ApiError as error:
            return self._answer(endpoint, dialect.error(error))
        except UtilityBusy:
            return self._answer(endpoint, dialect.error(_utilities_busy()))
        return self._answer(endpoint, JSONResponse({"input_tokens": len(tokens)}))

    async def create_response(self, request: Request) -> Response:
        assert self.responses is not None
        return await self._complete(request, "/v1/responses",
                                    front=self.responses.front(request_key_digest(request.scope)))

    async def stored_response(self, request: Request) -> Response:
        """``GET`` / ``DELETE /v1/responses/{id}``: a stored response of the request's key, or a 404."""
        assert self.responses is not None
        endpoint = "/v1/responses/{response_id}"
        response_id = request.path_params["response_id"]
        digest = request_key_digest(request.scope)
        if request.method == "DELETE":
            deleted = await asyncio.to_thread(self.responses.delete, response_id, digest)
            body = {"id": response_id, "object": "response.deleted", "deleted": True} if deleted else None
        else:
            body = await asyncio.to_thread(self.responses.retrieve, response_id, digest)
        if body is None:
            return self._answer(endpoint, _error_response(not_found(response_id)))
        return self._answer(endpoint, JSONResponse(body))

    async def models(self, request: Request) -> Response:
        service = self.service
        body = {"object": "list", "data": [
            {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "llama-cache"},
        ]}
        return self._answer("/v1/models", JSONResponse(body))

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize`` as llama-server: ``{"content", "add_special"?, "with_pieces"?}`` -> ``{"tokens"}``.

        ``add_special`` (default false) adds the BOS token; special tokens' texts are parsed as such.
        With ``with_pieces`` each token is ``{"id", "piece"}`` (the piece a string, or its bytes as a
        list when they are not UTF-8). A text that cannot fit the context is a 400, as a prompt is.
        """
        try:
            body = parse_json_body(await read_body(request, self.max_body_bytes, self.body_timeout))
            content = body.get("content")
            if not isinstance(content, str):
                raise ApiError(400, "'content' must be a string", param="content", code="invalid_type")
            flags = {name: body.get(name, False) for name in ("add_special", "with_pieces")}
            for name, value in flags.items():
                if not isinstance(value, bool):
                    raise ApiError(400, f"'{name}' must be a boolean", param=name, code="invalid_type")
            service = self.service
            text = content.encode("utf-8")
            overflow = service.text_bound.overflow(text, special=True)
            if overflow is not None:
                raise context_length_error("content", overflow, service.n_ctx)
        except ApiError as error:
            return self._answer("/tokenize", _error_response(error))
        tokenizer = service.tokenizer  # reads the shared vocabulary only
        pieces_of = tokenizer.detokenizer
        # Its tokenizations are remembered in the key's namespace, as a completion's are.
        fingerprint = service.namespace_fingerprint(service.cache_namespace(request_key_digest(request.scope), None))

        def work() -> list[Any]:
            add_bos = flags["add_special"]
            tokens = tokenizer.tokenize_for(fingerprint, text, add_bos=add_bos, special=True) if text else []
            if not flags["with_pieces"]:
                return tokens
            pieces = []
            for token in tokens:
                piece = pieces_of.piece(token, special=True)
                try:
                    shown: Any = piece.decode("utf-8")
                except UnicodeDecodeError:
                    shown = list(piece)
                pieces.append({"id": token, "piece": shown})
            return pieces

        try:
            tokens = await self.utilities.run(work)
        except UtilityBusy:
            return self._answer("/tokenize", _error_response(_utilities_busy()))
        return self._answer("/tokenize", JSONResponse({"tokens": tokens}))

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize`` as llama-server: ``{"tokens": [ids]}`` -> ``{"content"}`` (special tokens' texts included)."""
        service = self.service
        try:
            body = parse_json_body(await read_body(request, self.max_body_bytes, self.body_timeout))
            tokens = body.get("tokens")
            if not isinstance(tokens, list):
                raise ApiError(400, "'tokens' must be a list of token ids", param="tokens", code="invalid_type")
            if len(tokens) > service.n_ctx:  # no more than a context holds, as for a prompt
                raise context_length_error("tokens", f"{len(tokens)} tokens long", service.n_ctx)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise ApiError(400, "'tokens' must be a list of token ids", param="tokens", code="invalid_type")
            bad = next((t for t in tokens if not 0 <= t < service.n_vocab), None)
            if bad is not None:
                raise ApiError(400, f"'tokens' holds {bad}, outside the vocabulary (0..{service.n_vocab - 1})",
                               param="tokens", code="invalid_value")
        except ApiError as error:
            return self._answer("/detokenize", _error_response(error))
        detokenizer = service.tokenizer.detokenizer
        try:
            text = await self.utilities.run(
                lambda: detokenizer.detokenize(tokens, special=True).decode("utf-8", "replace"))
        except UtilityBusy:
            return self._answer("/detokenize", _error_response(_utilities_busy()))
        return self._answer("/detokenize", JSONResponse({"content": text}))

    async def health(self, request: Request) -> Response:
        gate = self.service.gate
        status = "stopping" if self.stopping else "ok"
        body = {"status": status, "slots": gate.permits, "slots_running": gate.running,
                "queue_depth": gate.queue_depth}
        return self._answer("/health", JSONResponse(body, status_code=503 if self.stopping else 200))

    async def metrics_route(self, request: Request) -> Response:
        content = await asyncio.to_thread(self.metrics.render)  # disk-tier stats may touch SQLite
        return self._answer("/metrics", Response(content, media_type="text/plain; version=0.0.4; charset=utf-8"))

    def _answer(self, endpoint: str, response: Response) -> Response:
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    # -- completions ------------------------------------------------------------------------------

    def _parse(self, endpoint: str, raw: bytes, job: Job, key_digest: bytes | None, dialect: Dialect = OPENAI,
               front: ChatFront | None = None) -> tuple[CompletionRequest | ChatRequest, list[int], str | None]:
        """The validated request, its prompt's tokens, how many of them the prompt cache would restore
        (0 when ``counting``: not asked) and its cache namespace (its API key's, as ``key_digest`` names
        it, and its ``cache_salt``: see :meth:`.Service.cache_namespace`). Runs in a thread, beside
        running completions. Any endpoint but ``/v1/completions`` is a chat request, its body first
        translated by ``dialect`` (:meth:`.Dialect.chat_body`).

        Everything a request may cost is checked before the work it bounds (:mod:`.limits`): the body's
        values, then the fields, the schemas and the text's size, then the template is rendered and the
        rendered prompt's size checked, then it is tokenized. A cancelled ``job`` (its client left) stops
        before tokenizing. With a ``front`` (another API), the body is that API's request, which it
        translates into a chat request's body first (:mod:`.fronts`).

        Raises:
            ApiError: 400 for bad input, a request past a limit or a prompt that does not fit the context.
            RenderingCancelled: the client left.
        """
        service = self.service
        limits = service.limits
        body = parse_json_body(raw)
        check_json_values(raw, body)
        if front is not None:
            body = front.chat_body(body)
        elif endpoint != "/v1/completions":
            body = dialect.chat_body(body)
        tokenizer = service.tokenizer  # tokenizing reads the shared vocabulary only
        parsed: CompletionRequest | ChatRequest
        if endpoint == "/v1/completions":
            parsed = parse_completion_request(body, service.n_ctx, service.n_vocab, limits)
            namespace = service.cache_namespace(key_digest, parsed.cache_salt)
            fingerprint = service.namespace_fingerprint(namespace)
            if isinstance(parsed.prompt, list):
                tokens = parsed.prompt
            elif parsed.prompt:
                text = parsed.prompt.encode("utf-8")
                overflow = service.text_bound.overflow(text, special=True)
                if overflow is not None:
                    raise context_length_error("prompt", overflow, service.n_ctx)
                tokens = tokenizer.tokenize_for(fingerprint, text, special=True)
            else:
                tokens = [tokenizer.token_bos()]
            param = "prompt"
        else:
            parsed = parse_chat_request(body, service.n_ctx, service.n_vocab, limits)
            namespace = service.cache_namespace(key_digest, parsed.cache_salt)
            fingerprint = service.namespace_fingerprint(namespace)
            try:
                tokens = prompt_tokens_for_chat(tokenizer, parsed.messages, bound=service.text_bound,
                                                cancelled=job.cancel.is_set, fingerprint=fingerprint,
                                                **parsed.template_options)
            except PromptTooLong as error:
                raise context_length_error("messages", f"{error.size} once rendered", service.n_ctx) from None
            except ValueError as error:
                raise ApiError(400, str(error), param="messages", code="invalid_value") from None
            param = "messages"
        if front is not None:
            tokens = front.rendered(tokens)
        if len(tokens) >= service.n_ctx:
            raise context_length_error(param, f"{len(tokens)} tokens long", service.n_ctx)
        return parsed, tokens, namespace

    def _constraints(self, structured: StructuredOutput, n: int) -> list[SequenceConstraint]:
        """One compiled constraint per choice of a request for structured output. Runs in a thread,
        before queueing.

        Raises:
            ApiError: 400 naming the field whose schema is refused (``param``: the request's field; the
                message names the function's parameters when the refusal lies in one).
        """
        compiler = self.service.constraints
        try:
            if structured.gbnf is not None:
                return [compiler.compile_gbnf(structured.gbnf) for _ in range(n)]
            return [compiler.compile(structured.schema, structured.parts) for _ in range(n)]
        except ConstraintError as error:
            raise ApiError(400, f"'{error.field or structured.param}': {error}", param=structured.param,
                           code=error.code) from None

    def _run(self, parsed: CompletionRequest | ChatRequest, tokens: list[int], job: Job,
             constraints: list[SequenceConstraint] | None = None, namespace: str | None = None,
             front: ChatFront | None = None) -> Callable[[], Any]:
        """What the request's worker thread runs: its choices (:class:`.ChoiceRun`), whole or streamed,
        in its cache namespace; their answer translated by ``front``, if given."""
        model = parsed.model or self.service.model_name
        sampling = parsed.sampling
        bias = LogitBias(sampling.logit_bias) if sampling.logit_bias else None
        options = parsed.options
        penalties = Penalties(repeat=options.get("repeat_penalty", 1.0),
                              frequency=options.get("frequency_penalty", 0.0),
                              presence=options.get("presence_penalty", 0.0),
                              last_n=self.service.penalty_last_n)
        samplings = [
            SequenceSampling(
                seed=None if sampling.seed is None else (sampling.seed + index) & 0xFFFFFFFF,
                constraint=constraints[index] if constraints else None,
                bias=bias,
                logprobs=None if sampling.logprobs is None else TokenLogprobs(sampling.logprobs, penalties),
            )
            for index in range(sampling.n)
        ]

        def processors(sequence: SequenceSampling) -> dict[str, Any]:
            chain = sequence.processors()
            return {"logits_processor": llama_cpp.LogitsProcessorList(chain)} if chain else {}

        def seed(sequence: SequenceSampling) -> dict[str, Any]:
            return {} if sequence.seed is None else {"seed": sequence.seed}

        structured = parsed.structured
        if isinstance(parsed, CompletionRequest):
            # The tokens routed on are the tokens evaluated: the string is not tokenized twice.
            def start(llama: Completions, sequence: SequenceSampling) -> Any:
                return llama.create_completion(prompt=tokens, max_tokens=parsed.max_tokens, stream=parsed.stream,
                                               model=model, **options, **seed(sequence), **processors(sequence))
        else:
            # No response_format and no tool_choice that forces a call reach the chat handler: it would
            # build a GBNF grammar from them. The constraint is a logits processor instead.
            def start(llama: Completions, sequence: SequenceSampling) -> Any:
                return llama.create_chat_completion(
                    messages=parsed.messages, max_tokens=parsed.max_tokens, stream=parsed.stream, model=model,
                    **parsed.template_options, **options, **seed(sequence), **processors(sequence))

        echo = None
        if isinstance(parsed, CompletionRequest) and parsed.echo:
            # The prompt as sent, or its tokens' text (llama-cpp-python's own echo joins a list of ids to
            # a string, and streams without it).
            detokenizer = self.service.tokenizer.detokenizer
            echo = parsed.prompt if isinstance(parsed.prompt, str) else detokenizer.detokenize(
                tokens).decode("utf-8", "replace")
        run = ChoiceRun(llama=None, samplings=samplings, start=start, chat=isinstance(parsed, ChatRequest),
                        fingerprint=self.service.system_fingerprint, cancelled=job.cancel.is_set,
                        # A cache taking announcements is told before the last chunk, and stores behind.
                        saved_before_last_chunk=self.service.write_through
                        and not callable(getattr(self.service.cache, "announce", None)), echo=echo)
        def cut_short(sequence: SequenceSampling) -> bool:
            return sequence.constraint is not None and sequence.constraint.error is not None

        if isinstance(parsed, CompletionRequest) and structured is not None:
            run.shape = lambda result, sequence: cut_short_completion(result, cut_short(sequence))
            run.shape_chunks = lambda chunks, sequence: cut_short_chunks(chunks, lambda: cut_short(sequence))
        elif structured is not None:
            function = ANY_FUNCTION if structured.any_function else structured.function

            run.shape = lambda result, sequence: structured_completion(
                result, function=function, legacy=structured.legacy, cut_short=cut_short(sequence))
            run.shape_chunks = lambda chunks, sequence: structured_chunks(
                chunks, function=function, legacy=structured.legacy, cut_short=lambda: cut_short(sequence))
        job.run = run

        service = self.service
        fingerprint = service.namespace_fingerprint(namespace)

        def call() -> Any:
            llama = Completions(
                service.engine, fingerprint, cancelled=job.cancel.is_set, stop_check=job.stop_check,
                prompt_substitute=front.substitute if front is not None else None,
                tokenize=lambda text, add_bos, special: service.tokenizer.tokenize_for(fingerprint, text, add_bos,
                                                                                       special),
                penalty_last_n=service.penalty_last_n)
            run.llama = llama
            if parsed.stream:
                chunks = run.stream(sampling.include_usage)
                return chunks if front is None else front.stream(chunks, llama)
            result = run.complete()
            return result if front is None else front.whole(result, llama)

        return call

    async def _complete(self, request: Request, endpoint: str, dialect: Dialect = OPENAI,
                        front: ChatFront | None = None) -> Response:
        started = time.monotonic()
        try:
            if self.stopping:
                raise ApiError(503, "the server is shutting down", type="server_error", code="unavailable")
            raw = await read_body(request, self.max_body_bytes, self.body_timeout)
        except ApiError as error:
            return self._answer(endpoint, dialect.error(error))
        job = Job(started_at=started)
        watcher = Disconnect(request, job)
        handed_over = False
        try:
            try:
                key_digest = request_key_digest(request.scope)
                parsed, tokens, namespace = await asyncio.to_thread(self._parse, endpoint, raw, job, key_digest,
                                                                    dialect, front)
                constraints = None
                if parsed.structured is not None:
                    constraints = await asyncio.to_thread(self._constraints, parsed.structured, parsed.sampling.n)
            except ApiError as error:
                return self._answer(endpoint, dialect.error(error))
            except RenderingCancelled:
                return self._answer(endpoint, Response(status_code=CLIENT_CLOSED))
            del raw  # the body's bytes are not kept while the request waits and runs
            if not await self._acquire(watcher, dialect):
                self.metrics.requests.labels(endpoint, str(CLIENT_CLOSED)).inc()
                return Response(status_code=CLIENT_CLOSED)
            loop = asyncio.get_running_loop()
            job.key = key_id(key_digest) if self.keyed else None
            answers = dialect.answers(parsed, job)
            call = self._run(parsed, tokens, job, constraints, namespace, front)
            if parsed.stream:
                queue: asyncio.Queue[Any] = asyncio.Queue()
                self.streams.add(queue)

                # The client has every chunk: its stream ends now, not after the cache save.
                future = self._start(job, call, emit=lambda chunk: loop.call_soon_threadsafe(queue.put_nowait, chunk),
                                     answered=lambda: loop.call_soon_threadsafe(queue.put_nowait, END))
                future.add_done_callback(lambda f: self._stream_done(endpoint, job, f, queue))
                handed_over = True

                def finish() -> None:  # also when writing failed: the generation must not outlive its client
                    job.cancel.set()
                    watcher.close()
                    self.streams.discard(queue)

                if front is not None:
                    return EventStream(queue, finish=finish, encode=front.encode, ending=front.ending)
                return answers.stream(queue, finish)
            future = self._start(job, call, None)
            cut = asyncio.ensure_future(self.cut.wait())
            try:
                await asyncio.wait({future, cut}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                cut.cancel()
            if not future.done():  # the drain's time is up: the worker stops at its next token
                job.cancel.set()
                self._record(endpoint, job, 503)
                return dialect.error(_shutting_down())
            try:
                result = future.result()
            except Cancelled:
                self._record(endpoint, job, CLIENT_CLOSED)
                return Response(status_code=CLIENT_CLOSED)
            except ValueError as error:
                self._record(endpoint, job, 400)
                return dialect.error(ApiError(400, str(error)))
            except asyncio.CancelledError:
                job.cancel.set()
                raise
            except Exception as error:  # noqa: BLE001 - answered as OpenAI's server_error
                logger.exception("completion failed")
                self._record(endpoint, job, 500)
                return dialect.error(ApiError(500, f"the completion failed: {error}", type="server_error"))
            self._record(endpoint, job, 200)
            return answers.whole(result)
        finally:
            if not handed_over:
                watcher.close()

    async def _acquire(self, watcher: Disconnect, dialect: Dialect = OPENAI) -> bool:
        """A place in the gate (True), or False when the client left while queued.

        Raises:
            _Refused: the queue is full or the drain's time is up (carries the 503 response, in
                ``dialect``'s shape, with ``Retry-After``).
        """
        acquiring = asyncio.ensure_future(self.service.gate.acquire())
        gone = asyncio.ensure_future(watcher.gone.wait())
        cut = asyncio.ensure_future(self.cut.wait())
        try:
            await asyncio.wait({acquiring, gone, cut}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            acquiring.cancel()
            raise
        finally:
            gone.cancel()
            cut.cancel()
        if not acquiring.done() and self.cut.is_set():
            acquiring.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acquiring
            raise _Refused(dialect.error(_shutting_down()))
        if acquiring.done():
            try:
                acquiring.result()
                return True
            except QueueFull:
                error = ApiError(503, "the server is busy and its queue is full; retry later",
                                 type="server_error", code="queue_full",
                                 headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
                raise _Refused(dialect.error(error)) from None
        acquiring.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await acquiring
        return False

    def _start(self, job: Job, call: Callable[[], Any], emit: Callable[[Any], None] | None,
               answered: Callable[[], None] | None = None) -> asyncio.Future[Any]:
        """Run the request (holding a place in the gate) on a worker thread; the place is given back
        when the thread is done, never before, whatever happens to the request's task."""
        loop = asyncio.get_running_loop()
        try:
            future = loop.run_in_executor(self.executor, run_job, job, call, emit, answered)
        except BaseException:
            self.service.gate.release()
            raise
        self.jobs.add(job)
        self.worker_futures.add(future)

        def done(_: asyncio.Future[Any]) -> None:
            self.jobs.discard(job)
            self.worker_futures.discard(future)
            self.service.gate.release()

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
        queue.put_nowait(END)

    def _record(self, endpoint: str, job: Job, status: int) -> None:
        metrics = self.metrics
        metrics.requests.labels(endpoint, str(status)).inc()
        if job.first_token_at is not None:
            metrics.time_to_first_token.labels(endpoint).observe(job.first_token_at - job.started_at)
        usage = job.usage
        if usage is not None and usage.prompt_tokens:
            metrics.prompt_tokens.inc(usage.prompt_tokens)
            metrics.prompt_tokens_cached.inc(usage.cached_tokens)
            if job.key is not None:
                metrics.count_key_tokens(job.key, usage.prompt_tokens, usage.cached_tokens)
        if job.sampled:
            metrics.generation_tokens.inc(job.sampled)

    # -- shutdown ---------------------------------------------------------------------------------

    async def drain(self, timeout: float) -> None:
        """Refuse new completions now; ``timeout`` seconds on, answer what still waits or runs with 503.

        Run beside uvicorn's graceful shutdown (see :class:`DrainingServer`), which waits ``timeout``
        seconds for the connections to close, then cancels their tasks. This ends them first, with
        answers a client can read, :data:`DRAIN_MARGIN` seconds (at most half the timeout) before that:
        a queued request gets a 503 JSON error body, a running non-streamed one too (its generation
        stops at the next token), and a running stream gets an error event and ``[DONE]``.
        """
        self.stopping = True
        await asyncio.sleep(max(timeout - min(DRAIN_MARGIN, timeout / 2), 0))
        self.cut.set()
        for job in list(self.jobs):
            if not job.answered:
                job.cancel.set()
        for queue in list(self.streams):
            queue.put_nowait(_shutting_down())
            queue.put_nowait(END)

    async def shutdown(self) -> None:
        """Cancel what still runs, wait for the worker threads, flush the cache, free the contexts."""
        self.stopping = True
        for job in list(self.jobs):
            job.cancel.set()
        if self.worker_futures:
            await asyncio.wait(set(self.worker_futures))
        self.executor.shutdown(wait=True)
        await asyncio.to_thread(self.utilities.close)
        await asyncio.to_thread(self.service.close)
        if self.responses is not None:
            await asyncio.to_thread(self.responses.close)


def _utilities_busy() -> ApiError:
    return ApiError(503, "too many tokenize and detokenize requests are waiting; retry later", type="server_error",
                    code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry on another instance or later", type="server_error",
                    code="unavailable", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which on shutdown lets the app answer what it still holds before the timeout.

    uvicorn's graceful shutdown waits ``timeout_graceful_shutdown`` seconds, then cancels the
    connections' tasks, which answers a request that has not started its response with a plain-text
    500 and cuts a stream without an end. Beside that wait this runs the app's drain
    (:meth:`_Server.drain`): every request gets a 503 JSON error body or a stream's error event first.
    """

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        server = _find_server(self.config.loaded_app)
        drain = (asyncio.ensure_future(server.drain(self.config.timeout_graceful_shutdown or 0.0))
                 if server is not None else None)
        try:
            await super().shutdown(sockets)
        finally:
            if drain is not None:
                drain.cancel()


def _find_server(app: Any) -> _Server | None:
    """The :class:`_Server` of a :func:`create_app` app, through uvicorn's and any middleware's wrappers."""
    seen = 0
    while app is not None and seen < 16:
        state = getattr(app, "state", None)
        server = getattr(state, "server", None)
        if isinstance(server, _Server):
            return server
        app = getattr(app, "app", None)
        seen += 1
    return None


class _Refused(Exception):
    def __init__(self, response: Response) -> None:
        super().__init__("refused")
        self.response = response


def create_app(service: Service, config: ServerConfig | None = None, *, max_body_bytes: int | None = None
               ) -> Starlette:
    """The Starlette app serving ``service``; its lifespan's end closes the service.

    Args:
        service: what to serve (see :func:`load_service`).
        config: the request settings it reads: ``api_keys``, ``metrics_public``, ``cors_origins``
            (:mod:`.access`), ``max_body_bytes`` and ``body_timeout``; None: the defaults (no key, no
            CORS).
        max_body_bytes: completion requests with a larger body are answered 413 (default:
            ``config.max_body_bytes``).

    The app owns its :class:`~.metrics.ServerMetrics` registry (``app.state.metrics``); requests refused
    for their key are counted there with status 401, under their route's path, or ``other`` for a path
    the app does not serve (any path a client sends would otherwise become a label).
    """
    settings = config if config is not None else ServerConfig()
    server = _Server(service, settings.max_body_bytes if max_body_bytes is None else max_body_bytes,
                     settings.body_timeout, keyed=bool(settings.api_keys))
    store = open_store(redis_url=settings.redis_url, cache_dir=settings.cache_dir, ttl=settings.responses_ttl,
                       capacity_bytes=settings.responses_store_bytes, max_record_bytes=settings.responses_max_bytes)
    server.responses = ResponsesService(store, server.metrics.registry, service.limits, service.model_name,
                                        service.n_ctx, tokenizer=service.tokenizer)

    async def refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, _Refused)
        endpoint = request.url.path
        server.metrics.requests.labels(endpoint, str(exc.response.status_code)).inc()
        return exc.response

    async def failed(request: Request, exc: Exception) -> Response:
        # Whatever a route did not answer itself: a JSON body, counted, never a plain-text 500.
        logger.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        path = request.url.path
        server.metrics.requests.labels(path if path in endpoints else "other", "500").inc()
        error = ApiError(500, "the server failed to answer this request", type="server_error")
        return JSONResponse(error_body(error) if is_messages_path(path) else error.body(), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await server.shutdown()

    routes = [
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/messages", server.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", server.count_tokens, methods=["POST"]),
        Route("/v1/messages/{rest:path}", server.messages_elsewhere, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
        Route("/v1/responses", server.create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", server.stored_response, methods=["GET", "DELETE"]),
        # The same without /v1, as llama-server and many client configurations use them (counted in the
        # metrics under the /v1 path).
        Route("/chat/completions", server.chat, methods=["POST"]),
        Route("/completions", server.completions, methods=["POST"]),
        Route("/models", server.models, methods=["GET"]),
        Route("/responses", server.create_response, methods=["POST"]),
        Route("/responses/{response_id}", server.stored_response, methods=["GET", "DELETE"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_route, methods=["GET"]),
    ]
    endpoints = {route.path for route in routes}

    def unauthorized(path: str) -> None:
        server.metrics.requests.labels(path if path in endpoints else "other", "401").inc()

    app = Starlette(
        routes=routes,
        middleware=access_middleware(
            api_keys=settings.api_keys, cors_origins=settings.cors_origins, on_refused=unauthorized,
            refusal_body=lambda path, error: error_body(error) if is_messages_path(path) else error.body(),
            public_paths=("/health", "/metrics") if settings.metrics_public else ("/health",)),
        exception_handlers={_Refused: refused, Exception: failed},
        lifespan=lifespan,
    )
    app.state.metrics = server.metrics
    app.state.server = server
    return app
