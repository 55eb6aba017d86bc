"""The KV pool's zero pages given back to the system: the buffer found exactly, answers unchanged."""

from __future__ import annotations

import ctypes
import sys

import llama_cpp
import numpy as np
import pytest

from llama_cache import Engine, Llama, default_model_path
from llama_cache.state import kv_pages
from llama_cache.engine.context import BatchContext, ContextSettings
from llama_cache.engine.model import Model
from llama_cache.state.kv_pages import new_ranges

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps and madvise are Linux's")


@pytest.mark.parametrize(("before", "after", "expected"), [
    ([], [(0, 100)], [(0, 100)]),
    ([(0, 100)], [(0, 100)], []),
    ([(10, 20)], [(0, 100)], [(0, 10), (20, 100)]),  # a mapping that grew on both sides
    ([(0, 50)], [(0, 100)], [(50, 100)]),
    ([(50, 100)], [(0, 100)], [(0, 50)]),
    ([(0, 10), (30, 40), (90, 200)], [(0, 100), (150, 300)], [(10, 30), (40, 90), (200, 300)]),
    ([(500, 600)], [(0, 100), (200, 300)], [(0, 100), (200, 300)]),
    ([(0, 100)], [], []),
])
def test_new_ranges_are_the_addresses_mapped_since(before: list[tuple[int, int]], after: list[tuple[int, int]],
                                                   expected: list[tuple[int, int]]) -> None:
    assert new_ranges(before, after) == expected


def test_new_ranges_agree_with_a_set_of_addresses_on_random_maps() -> None:
    rng = np.random.default_rng(7)
    for _ in range(200):
        def ranges() -> list[tuple[int, int]]:
            edges = sorted(set(rng.integers(0, 400, size=int(rng.integers(0, 12))).tolist()))
            return [(a, b) for a, b in zip(edges[::2], edges[1::2])]

        before, after = ranges(), ranges()
        addresses = {x for a, b in after for x in range(a, b)} - {x for a, b in before for x in range(a, b)}
        got = new_ranges(before, after)
        assert {x for a, b in got for x in range(a, b)} == addresses
        assert all(a < b for a, b in got) and got == sorted(got)


@linux
def test_the_mapped_ranges_are_private_and_writable() -> None:
    buffer = np.ones(8 << 20, dtype=np.uint8)  # large enough for a mapping of its own
    address = buffer.ctypes.data
    assert any(start <= address and address + buffer.nbytes <= end for start, end in kv_pages.mapped_ranges())


def _reference_answers(prompts: list[str], flash_attn: bool) -> list[str]:
    reference = llama_cpp.Llama(model_path=str(default_model_path()), verbose=False, n_ctx=1024, flash_attn=flash_attn)
    try:
        return [reference.create_completion(p, max_tokens=12, temperature=0)["choices"][0]["text"] for p in prompts]
    finally:
        reference.close()


def _resident_kib() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


@linux
@pytest.mark.model
def test_a_large_pool_costs_memory_as_its_cells_are_used() -> None:
    before = _resident_kib()
    with Engine(n_ctx=32768, parallel=2) as engine:
        pages = engine.context.kv_pages
        assert pages is not None
        # Every layer's K and V (f16) for every cell: the whole buffer, found exactly.
        model = engine.model.pointer
        head = llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model)
        per_cell = llama_cpp.llama_model_n_layer(model) * 2 * llama_cpp.llama_model_n_head_kv(model) * head * 2
        assert pages.size == engine.context.n_ctx * per_cell
        assert engine.context.kv_bytes_released >= 0.95 * pages.size
        assert (_resident_kib() - before) * 1024 < pages.size / 3
        # Answers are those of a context whose pages were never given back (llama-cpp-python's own).
        prompts = ["The three primary colours are", "A river runs to", "Name a mountain:"]
        answers = [engine.submit(p, max_tokens=12, temperature=0).result()["choices"][0]["text"] for p in prompts]
    assert answers == _reference_answers(prompts, flash_attn=True)


@linux
@pytest.mark.model
@pytest.mark.parametrize("settings", [{"deterministic": True}, {"flash_attn": False}], ids=["streams", "v-transposed"])
def test_the_buffer_is_found_with_a_stream_per_sequence_and_with_transposed_values(settings: dict[str, bool]) -> None:
    with Engine(n_ctx=4096, parallel=2, **settings) as engine:  # type: ignore[arg-type]
        pages = engine.context.kv_pages
        assert pages is not None and engine.context.kv_bytes_released > 0
        prompt = "The three primary colours are"
        text = engine.submit(prompt, max_tokens=12, temperature=0).result()["choices"][0]["text"]
    assert [text] == _reference_answers([prompt], flash_attn=settings.get("flash_attn", True))


def test_nothing_is_found_without_candidates_or_a_state() -> None:
    def refuse(data: np.ndarray) -> bool:
        return False

    assert kv_pages.locate([], lambda: None, refuse, 1024) is None
    assert kv_pages.locate([(0, 1 << 30)], lambda: None, refuse, 1024) is None
    assert kv_pages.locate([(0, 1 << 30)], lambda: np.zeros(64, dtype=np.uint8), refuse, 1024) is None  # not a state


@linux
@pytest.mark.model
def test_the_buffer_is_found_only_where_it_is() -> None:
    model = Model(default_model_path())
    # A buffer over glibc's largest mmap threshold (32 MiB) is always mapped anew, never taken from
    # memory the allocator already holds (4,096 cells: 90 MiB).
    context = BatchContext(model, ContextSettings(n_ctx=4096, n_seq_max=1, n_batch=8))
    try:
        pages = context.kv_pages
        assert pages is not None
        context.tokens[0], context.positions[0], context.sequences[0], context.wants_logits[0] = model.bos, 0, 0, 1
        context.decode(1)
        state = context.read_sequence(0)

        def rewrite(data: np.ndarray) -> bool:
            context.cut(0)
            return context.write_sequence(0, data)

        def find(ranges: list[tuple[int, int]], n_cells: int) -> kv_pages.KVPages | None:
            assert rewrite(state)  # the probe's token back in cell 0 (a search leaves its random row there)
            return kv_pages.locate(ranges, lambda: state, rewrite, n_cells)

        real = (pages.start, pages.start + pages.size)
        assert find([real], context.n_ctx) == pages
        # One cell short of the pool: the layout puts every layer but the first elsewhere.
        assert find([real], context.n_ctx - 1) is None
        # The same bytes elsewhere (another context of the same model would hold them) match the
        # layout but not the random row written through this context.
        assert rewrite(state)
        twin = np.ctypeslib.as_array((ctypes.c_uint8 * pages.size).from_address(pages.start)).copy()
        copy = (twin.ctypes.data, twin.ctypes.data + twin.nbytes)
        assert find([copy], context.n_ctx) is None
        assert find(sorted([copy, real]), context.n_ctx) == pages
        zeros = np.zeros(pages.size + (1 << 20), dtype=np.uint8)
        assert find([(zeros.ctypes.data, zeros.ctypes.data + zeros.nbytes)], context.n_ctx) is None
    finally:
        context.close()
        model.close()


@linux
@pytest.mark.model
def test_a_context_without_memory_is_left_alone() -> None:
    vocabulary = Llama(model_path=str(default_model_path()), vocab_only=True, verbose=False)
    try:
        assert vocabulary.tokenize(b"Hello")
    finally:
        vocabulary.close()


@linux
@pytest.mark.model
def test_llama_gives_back_its_pool_and_answers_the_same() -> None:
    before = _resident_kib()
    llama = Llama(model_path=str(default_model_path()), verbose=False, n_ctx=16384, flash_attn=True)
    try:
        # 16,384 cells: 360 MiB of KV, all but the cells in use given back.
        assert (_resident_kib() - before) * 1024 < 200 << 20
        first = llama.create_completion("The three primary colours are", max_tokens=12, temperature=0)
        llama.set_cache_namespace("another tenant")  # empties the context: llama.cpp zero-fills it again
        assert (_resident_kib() - before) * 1024 < 200 << 20
        again = llama.create_completion("The three primary colours are", max_tokens=12, temperature=0)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
    finally:
        llama.close()
