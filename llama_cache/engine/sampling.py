"""Sampling one sequence's next token from its logits row: llama.cpp's sampler chain, per sequence.

:class:`Sampler` builds the chain ``llama_cpp.Llama`` builds for the same options (penalties, then
greedy; or top-k, typical, top-p, min-p, temperature and a seeded draw; or mirostat), so a sequence
samples here what a ``Llama`` with that seed would. Python ``logits_processor`` callables (structured
output masks, logit biases, log probabilities) run first, on the row in llama.cpp's logits buffer, in
place; then ``llama_sampler_sample`` reads that row. No Python loop runs over the vocabulary.

Greedy sampling with the penalties off (llama.cpp's penalties sampler then changes nothing) takes the
row's first largest logit with one ``numpy.argmax``: the token llama.cpp's greedy sampler picks, without
building its n_vocab-entry candidate array (about 240 us a row with the default model, against 10-20
us; with 8 sequences, most of a decode step's Python time). A row where numpy finds a NaN first goes
through the chain, so that what llama.cpp makes of NaNs stays its own.

Thread-safety: a sampler is used by the scheduler's thread only; :meth:`Sampler.close` frees it.
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt

from llama_cache.engine.context import BatchContext

__all__ = ["LogitsProcessor", "Sampler", "SamplerSettings"]

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")], align=True)  # llama_token_data

LogitsProcessor = Callable[[npt.NDArray[np.intc], npt.NDArray[np.float32]], Any]
"""llama-cpp-python's ``logits_processor``: ``(tokens so far, row) -> row`` (may change the row in place)."""


@dataclass(frozen=True)
class SamplerSettings:
    """The options of llama-cpp-python's ``create_completion`` that shape sampling, with its defaults.

    ``seed`` None: a fresh random seed. ``penalty_last_n``: the sampled tokens the penalties look at.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    mirostat_mode: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    seed: int | None = None


class Sampler:
    """One sequence's sampler chain and its logits processors (see the module's docstring).

    Args:
        settings: the options.
        n_vocab: the model's vocabulary size.
        processors: run in order on each row before the chain.
    """

    def __init__(self, settings: SamplerSettings, n_vocab: int, processors: Sequence[LogitsProcessor] = ()) -> None:
        self.settings = settings
        self.processors = list(processors)
        seed = settings.seed if settings.seed is not None else random.SystemRandom().getrandbits(32)
        self.seed = seed & 0xFFFFFFFF
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        add = llama_cpp.llama_sampler_chain_add
        add(chain, llama_cpp.llama_sampler_init_penalties(n_vocab, settings.penalty_last_n, settings.repeat_penalty,
                                                            settings.frequency_penalty, settings.presence_penalty))
        temperature = settings.temperature
        if temperature < 0.0:
            add(chain, llama_cpp.llama_sampler_init_dist(self.seed))
        elif temperature == 0.0:
            add(chain, llama_cpp.llama_sampler_init_greedy())
        elif settings.mirostat_mode == 1:
            add(chain, llama_cpp.llama_sampler_init_mirostat(n_vocab, self.seed, settings.mirostat_tau,
                                                               settings.mirostat_eta, 100))
        elif settings.mirostat_mode == 2:
            add(chain, llama_cpp.llama_sampler_init_mirostat_v2(self.seed, settings.mirostat_tau, settings.mirostat_eta))
        else:
            add(chain, llama_cpp.llama_sampler_init_top_k(settings.top_k))
            add(chain, llama_cpp.llama_sampler_init_typical(settings.typical_p, 1))
            add(chain, llama_cpp.llama_sampler_init_top_p(settings.top_p, 1))
            add(chain, llama_cpp.llama_sampler_init_min_p(settings.min_p, 1))
            add(chain, llama_cpp.llama_sampler_init_temp(temperature))
            add(chain, llama_cpp.llama_sampler_init_dist(self.seed))
        self._chain: Any = chain
        penalties_off = settings.penalty_last_n <= 0 or (
            settings.repeat_penalty == 1.0 and settings.frequency_penalty == 0.0 and settings.presence_penalty == 0.0)
        self._argmax = temperature == 0.0 and penalties_off

    def sample(self, context: BatchContext, row: int, history: npt.NDArray[np.intc]) -> int:
        """The next token from batch row ``row`` of the last decode; ``history`` are the sequence's
        tokens so far (what the processors are given). O(n_vocab) in llama.cpp plus the processors."""
        if self._chain is None:
            raise RuntimeError("the sampler is closed")
        if self.processors or self._argmax:
            logits = context.logits_row(row)
            for processor in self.processors:
                result = processor(history, logits)
                if result is not None and result is not logits:
                    logits[:] = result
            if self._argmax:
                token = int(np.argmax(logits))
                if logits[token] == logits[token]:  # not NaN
                    return token
        return int(llama_cpp.llama_sampler_sample(self._chain, context.pointer, row))

    def sample_row(self, row: npt.NDArray[np.float32], history: npt.NDArray[np.intc]) -> int:
        """The next token from a logits row kept from an earlier decode (an exact repeat of a prompt),
        through the same processors and chain as :meth:`sample`; ``row`` is not changed."""
        if self._chain is None:
            raise RuntimeError("the sampler is closed")
        logits = row.copy()
        for processor in self.processors:
            result = processor(history, logits)
            if result is not None and result is not logits:
                logits[:] = result
        candidates = np.empty(len(logits), dtype=_TOKEN_DATA)
        candidates["id"] = np.arange(len(logits), dtype=np.int32)
        candidates["logit"] = logits
        candidates["p"] = 0.0
        array = llama_cpp.llama_token_data_array(
            data=candidates.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), size=len(logits),
            selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(array))
        token = int(array.data[array.selected].id)  # samplers may sort or replace the data they are given
        llama_cpp.llama_sampler_accept(self._chain, token)
        return token

    def close(self) -> None:
        """Free the chain (once)."""
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
