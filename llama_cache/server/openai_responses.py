"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``) over the chat route.

A Responses request is checked (:func:`.responses_request.parse_responses_request`, 400s naming its own
fields), then translated into the chat completion request the server already serves
(:meth:`ResponsesFront.chat_body`):

- ``input`` (a string: one user message; or items) and ``instructions`` (a system message first) become
  ``messages``. Message items (roles ``user``, ``system``, ``developer``, ``assistant``; content a string
  or ``input_text`` / ``output_text`` parts) keep their role and text; a ``function_call`` item becomes an
  assistant turn holding the call as JSON (``{"name": ..., "arguments": ...}``: a template that knows no
  tool calls renders it as text), a ``function_call_output`` item a ``tool`` message. ``reasoning`` items
  are skipped (this server generates none).
- ``max_output_tokens``, ``temperature``, ``top_p`` are chat's ``max_tokens``, ``temperature``, ``top_p``;
  ``tools`` (function tools, ``{"type": "function", "name", "description", "parameters", "strict"}``)
  and ``tool_choice`` (``auto``, ``none``, ``required``, ``{"type": "function", "name"}``) are chat's
  tools; ``text.format`` (``json_schema`` or ``json_object``) is chat's ``response_format``: the same
  llguidance constraints (:mod:`.constraints`).
- Extensions kept from the chat route: ``seed``, ``top_k``, ``min_p``, ``cache_salt``.

Fields the API defines that this server cannot honour are refused (``background``, ``conversation``,
``prompt``, ``truncation: "auto"``, ``top_logprobs``, tools other than functions, image, file or audio
input), never ignored.

**Server-side conversations.** With ``store`` (default true, as OpenAI) the response is stored
(:mod:`.response_store`) with the conversation it ends and the tokens its context held: the prompt and
the generated tokens. A request naming it as ``previous_response_id`` renders the whole conversation
(the previous ones' messages, its own input, under its own ``instructions``: they are not inherited) with
the chat template. When the stored tokens are a prefix of that rendering, or their text a prefix of its
text (the model may have written a text token by token that tokenizes otherwise once rendered: JSON's
spacing, say), the prompt is the stored tokens and the rest of the rendering tokenized (counted in
``llama_cache_responses_continued_total``): the prompt cache holds their state (saved when the
previous answer ended, in every tier: any instance restores it), so only the new tokens are evaluated.
A template that renders earlier turns differently later is not prefix-stable: such renders are counted
in ``llama_cache_responses_rerendered_total``, evaluated as rendered, and served from the cache's
longest prefix. A request that sends its whole history back instead names, through the ids of the
output items it sends back (:func:`.responses_shapes.item_id`), the stored response it goes on from:
those items are rendered as the model wrote them, and the prompt continues from its tokens the same way. A stored
response is bound to the API key that made it (:func:`.response_store.owner_of`): for another key, an
unknown id and an expired one alike, it is a 404 in OpenAI's error shape.

Streamed (``stream: true``) the answer is the event sequence of :class:`.responses_shapes.ResponseEvents`,
as server-sent events with their ``event:`` names and no ``[DONE]``; the response is stored before
its ``response.completed`` event is sent, so a follow-up finds it wherever it lands.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from llama_cache.server.errors import ApiError
from llama_cache.server.limits import RequestLimits
from llama_cache.server.response_store import ResponseStore, StoredResponse, is_response_id, new_response_id, owner_of
from llama_cache.server.responses_request import ResponsesRequest, call_text, parse_responses_request, text_content
from llama_cache.server.responses_shapes import ResponseEvents, output_of, usage_of

__all__ = ["ResponsesFront", "ResponsesService", "not_found"]

logger = logging.getLogger(__name__)

# Stored responses one request may look up for the items it sends back (each a store read).
_MAX_ORIGINS = 8

class ResponsesMetrics:
    """The Responses API's own counters, in the app's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.continued = Counter("llama_cache_responses_continued", "Follow-ups (previous_response_id, or a "
                                 "history sending back this server's output items) whose "
                                 "prompt continues from the previous response's tokens", registry=registry)
        self.rerendered = Counter("llama_cache_responses_rerendered", "Follow-ups (previous_response_id) whose "
                                  "rendering does not start with the previous response's text (served from "
                                  "the prompt cache's longest prefix)", registry=registry)


class ResponsesService:
    """What the Responses routes share: the store, the counters, the request limits.

    Args:
        store: where stored responses live (closed by :meth:`close`).
        registry: the app's metrics registry (the counters are added to it).
        limits: the chat route's request limits.
        model_name: the model's name, for a request that names none.
        n_ctx: the context size (bounds ``max_output_tokens``).
        tokenizer: a context of the model, whose ``tokenize`` and ``detokenize`` (thread-safe: they read
            the shared vocabulary only) join a rendering's text to stored tokens.
    """

    def __init__(self, store: ResponseStore, registry: CollectorRegistry, limits: RequestLimits,
                 model_name: str, n_ctx: int, tokenizer: Any = None) -> None:
        self.store = store
        self.tokenizer = tokenizer
        self.metrics = ResponsesMetrics(registry)
        self.limits = limits
        self.model_name = model_name
        self.n_ctx = n_ctx

    def front(self, key_digest: bytes | None) -> ResponsesFront:
        """The front of one ``POST /v1/responses`` request presenting this key (its digest; None: none)."""
        return ResponsesFront(self, owner_of(key_digest))

    def retrieve(self, response_id: str, key_digest: bytes | None) -> dict[str, Any] | None:
        """The stored response object, or None (unknown, expired, another key's). Blocks on the store."""
        record = self.store.get(response_id, owner_of(key_digest))
        return None if record is None else record.response

    def delete(self, response_id: str, key_digest: bytes | None) -> bool:
        """Delete a stored response; False when there is none for this key. Blocks on the store."""
        return self.store.delete(response_id, owner_of(key_digest))

    def close(self) -> None:
        self.store.close()


def not_found(response_id: str, param: str | None = None) -> ApiError:
    """OpenAI's 404 for a response id it does not know (or not for this key: the same answer)."""
    what = "Previous response" if param == "previous_response_id" else "Response"
    shown = response_id if is_response_id(response_id) else json.dumps(response_id[:40])[1:-1]
    return ApiError(404, f"{what} with id '{shown}' not found.", param=param,
                    code="previous_response_not_found" if param else None)


class ResponsesFront:
    """One ``POST /v1/responses`` request as a chat request (a :class:`.fronts.ChatFront`).

    Made per request by :meth:`ResponsesService.front`; used by one request only.
    """

    def __init__(self, service: ResponsesService, owner: str) -> None:
        self._service = service
        self._owner = owner
        self.id = new_response_id()
        self.created_at = int(time.time())
        self.request: ResponsesRequest | None = None
        self._previous: StoredResponse | None = None
        self._continues: StoredResponse | None = None  # the stored response this prompt may continue
        self._conversation: list[dict[str, Any]] = []
        self._rendered: list[int] = []
        self._prompt: list[int] = []
        self._events: ResponseEvents | None = None  # a stream's, once it starts

    # -- the request -----------------------------------------------------------------------------

    def chat_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat body for ``body``, the previous response's conversation before its input.

        Raises:
            ApiError: 400 for bad input; 404 for a ``previous_response_id`` unknown (expired, another key's).
        """
        request = parse_responses_request(body, self._service.limits, self._service.n_ctx)
        self.request = request
        conversation: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            previous = self._service.store.get(request.previous_response_id, self._owner)
            if previous is None:
                raise not_found(request.previous_response_id, "previous_response_id")
            self._previous = previous
            conversation = list(previous.conversation)
        last = self._restore_turns(request)
        self._continues = self._previous or last
        self._conversation = conversation + request.messages
        system = [{"role": "system", "content": request.instructions}] if request.instructions is not None else []
        chat = {"messages": system + self._conversation, "stream": request.stream, **request.chat}
        if request.model is not None:
            chat["model"] = request.model
        if request.stream:
            chat["stream_options"] = {"include_usage": True}
        if not chat["messages"]:
            raise ApiError(400, "'input' holds no message", param="input", code="invalid_value")
        return chat

    def _restore_turns(self, request: ResponsesRequest) -> StoredResponse | None:
        """Give the assistant items sent back that this server made the text the model wrote for them
        (a call's own spacing: what its stored response's tokens hold), when they are as it made them;
        the stored response of the last of them (None: not found, or not this key's)."""
        found: dict[str, StoredResponse | None] = {}
        last = None
        for position, response_id, index, item in request.origins:
            if response_id not in found:
                if len(found) >= _MAX_ORIGINS:
                    continue
                found[response_id] = self._service.store.get(response_id, self._owner)
            record = found[response_id]
            turn = _stored_turn(record, index, item) if record is not None else None
            if turn is not None:
                request.messages[position]["content"] = turn
            last = record
        return last

    def rendered(self, tokens: list[int]) -> list[int]:
        """The prompt: the tokens of the stored response it goes on from (its ``previous_response_id``,
        or the response that made the last assistant item it sends back) and the rest of ``tokens``'
        text, when that text starts with theirs; else ``tokens`` (a follow-up of ``previous_response_id``
        is then counted as re-rendered)."""
        self._rendered = list(tokens)
        self._prompt = self._rendered
        previous = self._continues
        if previous is None:
            return self._prompt
        stored = previous.tokens
        if len(stored) <= len(tokens) and tokens[: len(stored)] == stored:
            self._service.metrics.continued.inc()
            return self._prompt
        joined = self._joined(stored, tokens)
        if joined is None:
            if self._previous is not None:
                self._service.metrics.rerendered.inc()
            return self._prompt
        self._service.metrics.continued.inc()
        self._prompt = joined
        return joined

    def _joined(self, stored: list[int], tokens: list[int]) -> list[int] | None:
        """``stored`` and the tokens of the rest of ``tokens``' text, if that text starts with ``stored``'s."""
        tokenizer = self._service.tokenizer
        if tokenizer is None or not stored:
            return None
        try:
            head = tokenizer.detokenize(stored, special=True)
            whole = tokenizer.detokenize(tokens, special=True)
        except ValueError:  # a stored token outside this vocabulary
            return None
        if len(whole) <= len(head) or not whole.startswith(head):
            return None
        return list(stored) + tokenizer.tokenize(whole[len(head):], add_bos=False, special=True)

    def substitute(self, prompt: list[int]) -> list[int]:
        return self._prompt if self._prompt is not self._rendered and list(prompt) == self._rendered else prompt

    # -- the answer ------------------------------------------------------------------------------

    def whole(self, completion: dict[str, Any], llama: Any) -> dict[str, Any]:
        output = output_of(completion, self.id)
        response = self._response(output.status, output.items, usage_of(completion.get("usage")),
                                  output.incomplete_details, completion)
        self._store(response, output.items, llama)
        return response

    def stream(self, chunks: Iterator[Any], llama: Any) -> Iterator[Any]:
        events = ResponseEvents(lambda status, items, usage, details: self._response(status, items, usage, details),
                                self.id)
        self._events = events
        yield from events.start()
        finished = False
        for chunk in chunks:
            if not isinstance(chunk, dict):
                yield chunk
                continue
            if finished:
                continue
            if chunk.get("usage") is not None and not chunk.get("choices"):
                finished = True
                last = events.finish(usage_of(chunk["usage"]))
                self._store(last[-1]["response"], events.output, llama)
                yield from last
                continue
            yield from events.chunk(chunk)

    def encode(self, item: Any) -> bytes:
        if isinstance(item, ApiError):
            events = self._events
            item = (events.error(item.code, item.message, item.param) if events is not None else
                    {"type": "error", "sequence_number": 0, "code": item.code, "message": item.message,
                     "param": item.param})
        return f"event: {item['type']}\ndata: {json.dumps(item, ensure_ascii=False)}\n\n".encode()

    @property
    def ending(self) -> bytes:
        return b""

    # -- shapes and storage ----------------------------------------------------------------------

    def _response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                  incomplete: dict[str, Any] | None, completion: dict[str, Any] | None = None) -> dict[str, Any]:
        request = self.request
        assert request is not None
        model = (completion or {}).get("model") or request.model or self._service.model_name
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
                "error": None, "incomplete_details": incomplete, "model": model, "output": list(output),
                **request.echo, "usage": usage}

    def _store(self, response: dict[str, Any], output: list[dict[str, Any]], llama: Any) -> None:
        """Store the response with its conversation and its context's tokens (``store`` true only)."""
        request = self.request
        assert request is not None
        if not request.store:
            return
        tokens = llama.live_tokens().tolist()
        turns = []
        for item in output:
            if item["type"] == "message":
                turns.append({"role": "assistant", "content": item["content"][0]["text"] if item["content"] else ""})
            else:
                turns.append({"role": "assistant", "content": self._generated(llama, tokens, item)})
        record = StoredResponse(id=self.id, owner=self._owner, expires_at=0.0, response=response,
                                conversation=self._conversation + turns, tokens=tokens)
        self._service.store.put(record)

    def _generated(self, llama: Any, tokens: list[int], item: dict[str, Any]) -> str:
        """The text the model generated for a call, as the context holds it (so that a follow-up's
        rendering starts with the stored tokens); the call's JSON when the context does not hold it."""
        prompt = self._prompt
        if len(tokens) > len(prompt) and tokens[: len(prompt)] == prompt:
            text = llama.detokenize(tokens[len(prompt):]).decode("utf-8", "replace")
            if item["arguments"] in text or item["name"] in text:
                return text
        return call_text(item["name"], item["arguments"])


def _stored_turn(record: StoredResponse, index: int, item: dict[str, Any]) -> str | None:
    """The conversation turn ``record`` keeps for its output item ``index``, if ``item`` (sent back by a
    client) is that item as it was made; None otherwise (the client changed it, or the record does not
    hold it)."""
    output = record.response.get("output")
    turns = record.conversation
    if not isinstance(output, list) or not 0 <= index < len(output) or len(output) > len(turns):
        return None
    made = output[index]
    if not isinstance(made, dict) or made.get("type") != item.get("type", "message"):
        return None
    if made.get("type") == "function_call":
        if (made.get("name"), made.get("arguments")) != (item.get("name"), item.get("arguments")):
            return None
    else:
        try:
            sent = text_content("input", item.get("content"))
        except ApiError:
            return None
        parts = made.get("content")
        text = parts[0].get("text") if isinstance(parts, list) and parts and isinstance(parts[0], dict) else None
        if sent != text:
            return None
    return turns[len(turns) - len(output) + index]["content"]
