"""What a server serves: the engine with its cache tiers, the admission gate, and what every request is
checked against (:class:`Service`, built by :func:`load_service`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import time
from dataclasses import dataclass

import llama_cpp

from llama_cache.caches.base import BaseLlamaCache
from llama_cache.caches.disk import LlamaDiskCache
from llama_cache.caches.ram import LlamaRAMCache
from llama_cache.caches.redis_urls import redact_url
from llama_cache.caches.tiered import TieredCache
from llama_cache.engine.engine import Engine
from llama_cache.server.config import ServerConfig
from llama_cache.server.constraints import ConstraintCompiler
from llama_cache.server.gate import RequestGate
from llama_cache.server.limits import PromptTextBound, RequestLimits
from llama_cache.server.prompts import ServedTokenizer, TokenizationMemo
from llama_cache.state.fingerprint import namespaced_fingerprint

__all__ = ["Service", "load_service", "system_fingerprint"]

logger = logging.getLogger(__name__)


@dataclass
class Service:
    """What the app serves: the engine (its cache tiers in it), the gate, the tokenizer and the model's name.

    ``constraints`` compiles the structured outputs requests ask for, for the model's vocabulary;
    ``system_fingerprint`` names the model and the build answering (:func:`system_fingerprint`);
    ``penalty_last_n`` is how many sampled tokens the repetition penalties look back on;
    ``model_fingerprint`` is the engine's (:attr:`llama_cache.engine.Engine.model_fingerprint`);
    ``keys_share_cache``: API keys share the cache namespace (``--cache-shared-across-keys``);
    ``write_through``: a streamed answer's last chunk waits until its state is in every tier.
    """

    engine: Engine
    gate: RequestGate
    tokenizer: ServedTokenizer
    cache: BaseLlamaCache
    tiers: list[tuple[str, BaseLlamaCache]]  # (name, cache), fastest first
    model_name: str
    n_ctx: int
    n_vocab: int
    created: int
    limits: RequestLimits
    text_bound: PromptTextBound
    constraints: ConstraintCompiler
    system_fingerprint: str = ""
    penalty_last_n: int = 64
    model_fingerprint: str = ""
    keys_share_cache: bool = False
    write_through: bool = False
    closed: bool = False

    def cache_namespace(self, key_digest: bytes | None, cache_salt: str | None) -> str | None:
        """The prompt cache namespace of a request presenting this API key (its SHA-256 digest; None:
        no key) and ``cache_salt``: one per key unless keys share the cache, one per salt within it;
        None when neither applies (the model's own namespace). The same on every instance."""
        key = None if key_digest is None or self.keys_share_cache else key_digest.hex()
        if key is None and cache_salt is None:
            return None
        return json.dumps([key, cache_salt])

    def namespace_fingerprint(self, namespace: str | None) -> str:
        """The fingerprint the states of ``namespace`` carry (see :meth:`cache_namespace`)."""
        return namespaced_fingerprint(self.model_fingerprint, namespace)

    def close(self) -> None:
        """Stop the engine (idle sequences' states go to the tiers), flush the tiers, free the model; once.
        Call with no request running."""
        if self.closed:
            return
        self.closed = True
        self.engine.close()


def load_service(config: ServerConfig) -> Service:
    """Load the model into one engine around the configured cache tiers.

    ``config.n_ctx`` is the engine's pool of KV cells, shared by every sequence (one request may use
    all of it); ``config.parallel`` requests run at once.

    Raises:
        FileNotFoundError: the model file does not exist.
        ValueError: llama.cpp could not load it, or the chat template is not valid Jinja2.
    """
    tiers: list[tuple[str, BaseLlamaCache]] = [("ram", LlamaRAMCache(capacity_bytes=config.cache_ram))]
    if config.cache_dir is not None:
        tiers.append(("disk", LlamaDiskCache(config.cache_dir, capacity_bytes=config.cache_disk)))
    if config.redis_url is not None:
        from llama_cache.caches.redis_tier import LlamaRedisCache  # redis-py, only for a server that uses it

        tiers.append(("redis", LlamaRedisCache(config.redis_url, capacity_bytes=config.cache_redis)))
        logger.info("prompt cache: sharing states through Redis at %s", redact_url(config.redis_url))
    # With a Redis tier, other instances serve the same conversations: the state ending a completion is
    # stored there before its last chunk goes out (write-through), so the next turn finds it wherever
    # it lands.
    write_through = config.redis_url is not None and config.redis_write_through
    cache = tiers[0][1] if len(tiers) == 1 else TieredCache([tier for _, tier in tiers], write_through=write_through)
    template = config.chat_template_file.read_text(encoding="utf-8") if config.chat_template_file is not None else None
    threads = config.context_options()["n_threads"]
    engine = Engine(config.model_path, n_ctx=config.n_ctx, parallel=config.parallel, n_threads=threads,
                    n_batch=config.context_options()["n_batch"], flash_attn=config.flash_attn, cache=cache,
                    store_finished=len(tiers) > 1, chat_template=template, deterministic=config.deterministic)
    try:
        model = engine.model
        tokenizer = ServedTokenizer(model, TokenizationMemo(max_tokens=engine.n_ctx))
        constraints = ConstraintCompiler(model.vocab, model.n_vocab)
        text_bound = PromptTextBound.for_vocabulary(model.vocab, model.detokenizer, model.n_vocab, engine.n_ctx)
    except BaseException:
        engine.close()
        raise
    return Service(
        engine=engine,
        gate=RequestGate(config.parallel, config.max_queue),
        tokenizer=tokenizer,
        cache=cache,
        tiers=tiers,
        model_name=config.model_alias or model.path.stem,
        n_ctx=engine.n_ctx,
        n_vocab=model.n_vocab,
        created=int(time.time()),
        limits=RequestLimits(max_messages=config.max_messages, max_prompt_bytes=text_bound.max_bytes),
        text_bound=text_bound,
        constraints=constraints,
        system_fingerprint=system_fingerprint(engine.model_fingerprint),
        penalty_last_n=64,
        model_fingerprint=engine.model_fingerprint,
        keys_share_cache=config.cache_shared_across_keys,
        write_through=write_through,
    )


def system_fingerprint(model_fingerprint: str) -> str:
    """OpenAI's ``system_fingerprint``: ``fp_`` and a hash of the model's fingerprint (its bytes and KV
    settings) and of the versions of llama-cache and llama-cpp-python (hence llama.cpp) answering."""
    try:
        version = importlib.metadata.version("llama-cache")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout
        version = "checkout"
    build = f"{model_fingerprint}|llama-cache {version}|llama-cpp-python {llama_cpp.__version__}"
    return "fp_" + hashlib.sha256(build.encode("utf-8")).hexdigest()[:12]
