"""CRC-32 over large buffers, split between idle cores.

A fresh process restoring a large state from disk spends most of its time in the CRC-32 pass (about
4 GB/s on one core). ``zlib.crc32`` releases the GIL, so the pass is split between threads and the
partial CRCs combined: crc(A + B) = crc(A) * x^(8 len B) + crc(B) over GF(2), modulo the CRC-32
polynomial. (zlib has ``crc32_combine`` in C, but Python's zlib module does not expose it.)
Polynomials are 32-bit ints in CRC-32's reflected order (bit 31 is x^0).
"""

from __future__ import annotations

import os
import threading
import zlib

_POLY = 0xEDB88320
_PARALLEL_CRC_BYTES = 4 << 20  # below this a thread costs more than it saves
_CRC_THREADS = max(1, min(4, os.cpu_count() or 1))


def _mul_mod_p(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial (reflected representation)."""
    product = 0
    bit = 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _x_pow_2k_table() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_mul_mod_p(table[-1], table[-1]))
    return table


_X_POW_2K = _x_pow_2k_table()  # x^(2^k) mod P for k = 0..31


def _x_pow_8n(n: int) -> int:
    """x^(8 n) mod P: the factor that shifts a CRC past n bytes. O(log n)."""
    result = 1 << 31  # x^0
    k = 3  # 8 n = n * 2^3
    while n:
        if n & 1:
            result = _mul_mod_p(_X_POW_2K[k % 32], result)
        n >>= 1
        k += 1
    return result


def crc32_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """The CRC-32 of A + B from the CRC-32s of A and of B (``length_b`` bytes)."""
    return _mul_mod_p(_x_pow_8n(length_b), crc_a) ^ crc_b


def _idle_cores() -> int:
    """Cores the last minute left idle, roughly (a thread on a busy core only adds overhead)."""
    try:
        return int((os.cpu_count() or 1) - os.getloadavg()[0])
    except (AttributeError, OSError):  # pragma: no cover - no load average on this platform
        return 0


def crc32(view: memoryview) -> int:
    """zlib.crc32 of ``view``, split between threads when it is large and cores are idle."""
    size = view.nbytes
    parts = min(_CRC_THREADS, size // _PARALLEL_CRC_BYTES)
    if parts >= 2:
        parts = min(parts, 1 + _idle_cores())
    if parts < 2:
        return zlib.crc32(view)
    bounds = [size * i // parts for i in range(parts + 1)]
    results = [0] * parts

    def run(i: int) -> None:
        results[i] = zlib.crc32(view[bounds[i] : bounds[i + 1]])

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(1, parts)]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    crc = results[0]
    for i in range(1, parts):
        crc = crc32_combine(crc, results[i], bounds[i + 1] - bounds[i])
    return crc
