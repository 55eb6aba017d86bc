"""What a server serves: the model's contexts around one shared prompt cache, their compute thread, and
what every request is checked against (:class:`Engine`, built by :func:`load_engine`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import llama_cpp
import llama_cpp.llama_chat_format

from llama_cache._model import default_model_path
from llama_cache.caches.base import BaseLlamaCache
from llama_cache.caches.disk import LlamaDiskCache
from llama_cache.caches.ram import LlamaRAMCache
from llama_cache.caches.redis_tier import LlamaRedisCache, redact_url
from llama_cache.caches.tiered import TieredCache
from llama_cache.server.compute import ComputeThread
from llama_cache.server.config import ServerConfig
from llama_cache.server.constraints import ConstraintCompiler
from llama_cache.server.contexts import SlotLlama, TokenizationMemo
from llama_cache.server.limits import PromptTextBound, RequestLimits
from llama_cache.server.slots import Slot, SlotPool
from llama_cache.state.fingerprint import namespaced_fingerprint

__all__ = ["Engine", "load_engine"]

logger = logging.getLogger(__name__)


@dataclass
class Engine:
    """What the app serves: the slots, their shared prompt cache, their compute thread and the model's name.

    ``constraints`` compiles the structured outputs requests ask for, for the model's vocabulary;
    ``system_fingerprint`` names the model and the build answering (:func:`system_fingerprint`);
    ``penalty_last_n`` is how many sampled tokens the repetition penalties look back on;
    ``model_fingerprint`` is the model's (:attr:`llama_cache.Llama.model_fingerprint`);
    ``keys_share_cache``: API keys share the cache namespace (``--cache-shared-across-keys``).
    """

    pool: SlotPool
    compute: ComputeThread
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
        logger.info("prompt cache: sharing states through Redis at %s", redact_url(config.redis_url))
    # With a Redis tier, other instances serve the same conversations: the state ending a completion is
    # stored there before its last chunk goes out (write-through), so the next turn finds it wherever
    # it lands.
    cache = tiers[0][1] if len(tiers) == 1 else TieredCache(
        [tier for _, tier in tiers], write_through=config.redis_url is not None and config.redis_write_through)
    options = config.context_options()
    compute = ComputeThread()
    tokenized = TokenizationMemo(max_tokens=config.n_ctx)
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
    if config.chat_template_file is not None:
        handler = chat_template_handler(first, config.chat_template_file.read_text(encoding="utf-8"))
        for slot in slots:
            slot.llama.chat_handler = handler
    text_bound = PromptTextBound.for_model(first, first.n_ctx())
    return Engine(
        pool=SlotPool(slots, config.max_queue,
                      cached=lambda tokens, fingerprint: tiers[0][1].match_length(tokens, namespace=fingerprint)),
        compute=compute,
        cache=cache,
        tiers=tiers,
        model_name=config.model_alias or path.stem,
        n_ctx=first.n_ctx(),
        n_vocab=first.n_vocab(),
        created=int(time.time()),
        limits=RequestLimits(max_messages=config.max_messages, max_prompt_bytes=text_bound.max_bytes),
        text_bound=text_bound,
        constraints=constraints,
        system_fingerprint=system_fingerprint(first.model_fingerprint),
        penalty_last_n=first.last_n_tokens_size,
        model_fingerprint=first.model_fingerprint,
        keys_share_cache=config.cache_shared_across_keys,
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


def chat_template_handler(llama: SlotLlama, template: str) -> Any:
    """A chat handler rendering ``template`` (Jinja2, as in a GGUF's ``tokenizer.chat_template``) for ``llama``'s model.

    llama-cpp-python renders it in a sandboxed Jinja2 environment, with the model's BOS and EOS tokens
    as ``bos_token`` / ``eos_token``, and stops at the EOS token, as it does for a GGUF's own template.

    Raises:
        ValueError: the template is not valid Jinja2.
    """
    try:
        jinja2.sandbox.ImmutableSandboxedEnvironment().parse(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"the chat template is not valid Jinja2: {error}") from None
    eos, bos = llama.token_eos(), llama.token_bos()
    text = llama._model.token_get_text  # noqa: SLF001 - as llama-cpp-python reads them for a GGUF's template
    formatter = llama_cpp.llama_chat_format.Jinja2ChatFormatter(
        template=template, eos_token=text(eos) if eos != -1 else "", bos_token=text(bos) if bos != -1 else "",
        stop_token_ids=[eos] if eos != -1 else None)
    return formatter.to_chat_handler()
