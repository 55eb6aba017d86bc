"""What a server serves: the model's contexts around one shared prompt cache, their compute thread, and
what every request is checked against (:class:`Engine`, built by :func:`load_engine`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

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

__all__ = ["Engine", "load_engine"]

logger = logging.getLogger(__name__)


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
    limits: RequestLimits
    text_bound: PromptTextBound
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
        logger.info("prompt cache: sharing states through Redis at %s", redact_url(config.redis_url))
    cache = tiers[0][1] if len(tiers) == 1 else TieredCache([tier for _, tier in tiers])
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
    text_bound = PromptTextBound.for_model(first, first.n_ctx())
    return Engine(
        pool=SlotPool(slots, config.max_queue, cached=tiers[0][1].match_length),
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
    )
