"""The disk tier's byte budget as ``du`` sees it (issue #27): the index, the folders and whole blocks count,
and no shard folder is left behind empty.

``du`` here is :func:`du`: ``st_blocks * 512`` of the cache directory and of every file and folder in
it, what ``du -s`` reports. States are synthetic (no model): transformer states stored as chunks, and
opaque ones stored whole.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from llama_cache.caches.disk import DATA_DIR, LlamaDiskCache, payloads
from tests.test_disk_cache import make_state, pattern_ok
from tests.test_disk_chunks import REPO, kv_state, restores_exactly

BUDGET = 256 << 10  # a few dozen small files beside an empty cache's 76 KiB


def du(path: Path) -> int:
    """What ``du -s`` reports for ``path`` (bytes): ``st_blocks * 512`` of it and of everything below."""
    total = os.lstat(path).st_blocks * 512
    for root, folders, files in os.walk(path):
        total += sum(os.lstat(os.path.join(root, name)).st_blocks * 512 for name in folders + files)
    return total


def empty_folders(directory: Path) -> list[str]:
    data = directory / DATA_DIR
    return sorted(child.name for child in data.iterdir() if child.is_dir() and not any(child.iterdir()))


def random_key(rng: random.Random) -> list[int]:
    """Keys sharing a few prefixes (so chunks are shared and tails absorbed), of 1 to 40 tokens."""
    prefix = rng.choice([[], list(range(10, 18)), list(range(30, 43))])
    return prefix + [rng.randrange(1, 200) for _ in range(rng.randrange(1, 28))]


@pytest.mark.parametrize("chunk_tokens", [4, 0], ids=["chunked", "whole"])
def test_the_directory_stays_within_its_budget_as_du_counts_it(tmp_path: Path, chunk_tokens: int) -> None:
    directory = tmp_path / "cache"
    cache = LlamaDiskCache(directory, capacity_bytes=BUDGET, write_behind=False, chunk_tokens=chunk_tokens)
    rng = random.Random(27)
    stored: list[list[int]] = []
    for step in range(400):
        draw = rng.random()
        if draw < 0.7 or not stored:
            key = random_key(rng)
            cache[key] = kv_state(key, logits=rng.random() < 0.3) if rng.random() < 0.8 else make_state(key, 3000)
            stored.append(key)
        elif draw < 0.8:
            try:
                del cache[rng.choice(stored)]
            except KeyError:  # evicted already
                pass
        else:
            try:  # lookups log touches: the index grows under them too
                state = cache[rng.choice(stored)]
            except KeyError:
                continue
            assert restores_exactly(state) if state.layout is not None else pattern_ok(state)
        used = du(directory)
        assert used <= BUDGET, f"step {step}: the directory takes {used} bytes, the budget is {BUDGET}"
    assert cache.stats().evictions > 20  # the budget was reached again and again
    assert empty_folders(directory) == []
    # What the cache counts is what du counts.
    assert du(directory) <= cache.disk_usage <= BUDGET
    report = cache.check()
    assert report.ok and report.disk_usage == du(directory) and report.budgeted_bytes == cache.disk_usage
    cache.close()


def test_evicted_deleted_and_cleared_entries_leave_no_empty_shard_folder(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    cache = LlamaDiskCache(directory, capacity_bytes=64 << 20, write_behind=False, chunk_tokens=4)  # 256 folders
    rng = random.Random(7)
    keys = [random_key(rng) for _ in range(150)]
    for key in keys:
        cache[key] = kv_state(key)
    assert len(list((directory / DATA_DIR).iterdir())) > 100  # spread over many folders
    for key in rng.sample(keys, 100):
        try:
            del cache[key]
        except KeyError:  # stored under a shorter key that another one replaced
            pass
    assert empty_folders(directory) == []
    small = LlamaDiskCache(directory, capacity_bytes=BUDGET, write_behind=False, chunk_tokens=4)  # evicts
    for key in [random_key(rng) for _ in range(40)]:
        small[key] = kv_state(key)
    assert small.stats().evictions > 0 and empty_folders(directory) == []
    small.clear()
    assert list((directory / DATA_DIR).iterdir()) == []
    assert cache.check().ok and len(cache) == 0
    small.close()
    cache.close()


def test_a_budget_below_what_an_empty_cache_takes_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    floor = LlamaDiskCache.minimum_capacity(directory)
    assert 64 << 10 <= floor <= 128 << 10  # an empty index and three folders, in 4 KiB blocks here
    with pytest.raises(ValueError, match=f"at least {floor}"):
        LlamaDiskCache(directory, capacity_bytes=floor - 1)
    assert not directory.exists()  # refused before anything was made
    with LlamaDiskCache(directory, capacity_bytes=floor, write_behind=False) as cache:
        assert du(directory) <= cache.disk_usage <= floor
        cache[[1, 2]] = make_state([1, 2])  # no room for a single file: not stored
        assert len(cache) == 0 and cache.stats().rejected == 1
        assert du(directory) <= floor


def test_a_writer_makes_again_a_folder_removed_under_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process may remove an empty folder between a writer opening it and creating a file in
    it: the creation fails (the folder is gone) and the writer makes the folder again."""
    directory = tmp_path / "cache"
    cache = LlamaDiskCache(directory, write_behind=False, chunk_tokens=0)
    real_open_subdir = payloads.DataDir._open_subdir
    removed: list[str] = []

    def open_then_lose(self: Any, subdir: str, create: bool = False) -> int:
        fd = real_open_subdir(self, subdir, create)
        if create and len(removed) < 3:  # the folder is empty: a remover's rmdir succeeds
            os.rmdir(self.path / subdir)
            removed.append(subdir)
        return fd

    monkeypatch.setattr(payloads.DataDir, "_open_subdir", open_then_lose)
    cache[[1, 2, 3]] = make_state([1, 2, 3], 5000)
    assert len(removed) == 3  # three attempts lost the folder; the fourth wrote the file
    monkeypatch.undo()
    assert pattern_ok(cache[[1, 2, 3]]) and cache.check().ok
    cache.close()


def test_opening_and_fixing_remove_empty_folders_and_measure_the_rest(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    with LlamaDiskCache(directory, capacity_bytes=BUDGET, write_behind=False) as cache:
        cache[[1]] = make_state([1])
    for name in ("3c", "a7"):  # left by an older version, or by a killed process
        (directory / DATA_DIR / name).mkdir()
    with LlamaDiskCache(directory, capacity_bytes=BUDGET, write_behind=False) as cache:
        assert empty_folders(directory) == []
        (directory / DATA_DIR / "5e").mkdir()
        report = cache.check()
        assert report.empty_folders == ("5e",) and report.ok  # harmless: reported, not a problem
        unseen = os.lstat(directory / DATA_DIR / "5e").st_blocks * 512  # made behind the cache's back
        assert report.disk_usage == du(directory) == report.budgeted_bytes + unseen
        report = cache.check(fix=True)
        assert empty_folders(directory) == [] and cache.check().empty_folders == ()
        assert cache.check().disk_usage == du(directory) == cache.disk_usage <= BUDGET
        assert pattern_ok(cache[[1]])


def test_a_folder_grown_behind_the_index_is_fitted_when_opened(tmp_path: Path) -> None:
    """A killed writer's young files stay (they may be a store in progress) and leave their folder
    larger for good; a cache opening the directory measures it and evicts until the budget holds."""
    directory = tmp_path / "cache"
    with LlamaDiskCache(directory, capacity_bytes=BUDGET, write_behind=False, chunk_tokens=4) as cache:
        rng = random.Random(5)
        while cache.stats().evictions == 0:  # full: the next byte the budget sees evicts
            key = random_key(rng)
            cache[key] = kv_state(key)
        entries = len(cache)
    folder = next(child for child in (directory / DATA_DIR).iterdir() if child.is_dir())
    before = os.lstat(folder).st_blocks * 512
    for number in range(400):  # names as long as a payload's, each a folder entry
        (folder / f"{number:064x}.tmp").touch()
    assert os.lstat(folder).st_blocks * 512 > before
    with LlamaDiskCache(directory, capacity_bytes=BUDGET, write_behind=False, chunk_tokens=4) as cache:
        assert cache.disk_usage <= BUDGET and cache.stats().evictions > 0
        assert 0 < len(cache) < entries
        for key in cache.keys():
            assert restores_exactly(cache[key], key)


_WRITER = textwrap.dedent(
    """
    import random, sys
    from llama_cache.caches.disk import LlamaDiskCache
    from tests.test_disk_budget import random_key
    from tests.test_disk_chunks import kv_state

    cache = LlamaDiskCache(sys.argv[1], capacity_bytes=int(sys.argv[2]), chunk_tokens=4)
    rng = random.Random(int(sys.argv[3]))
    for _ in range(150):
        key = random_key(rng)
        cache[key] = kv_state(key)
        if rng.random() < 0.2:
            try:
                cache.lookup_prefix(random_key(rng))
            except KeyError:
                pass
    cache.close()
    """
)


def test_processes_sharing_a_directory_keep_its_budget(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    LlamaDiskCache(directory, capacity_bytes=BUDGET).close()
    writers = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(directory), str(BUDGET), str(seed)], cwd=REPO,
                         stderr=subprocess.PIPE, text=True)
        for seed in range(3)
    ]
    for writer in writers:
        _, err = writer.communicate(timeout=300)
        assert writer.returncode == 0, err[-2000:]
    assert du(directory) <= BUDGET and empty_folders(directory) == []
    with LlamaDiskCache(directory, capacity_bytes=BUDGET, write_behind=False, chunk_tokens=4) as cache:
        assert len(cache) > 0 and cache.check().ok
        for key in cache.keys():
            assert restores_exactly(cache[key], key)
        assert du(directory) <= cache.disk_usage <= BUDGET
