"""What identifying a model by all of its bytes costs, for a large file.

The fingerprint hashes the whole GGUF (XXH3-128) once per (device, inode, size, mtime) and remembers the
result in the process and in ``$LLAMA_CACHE_HOME/file-identities.json``. This writes a file of the given
size (default 4 GiB, the size of a 7B model at 4 bits), then times:

- the first hash, with the file just written (in the page cache, as right after a download or a load);
- the same after asking the kernel to drop the file's pages (``posix_fadvise(DONTNEED)``), which reads
  it from the disk;
- a second call in the same process (in-process memo) and a call from a fresh process (the memo file);
- for scale, the old identity (size plus first and last MiB).

    tools/run python benchmarks/fingerprint.py [--gib 4] [--out benchmarks/results/fingerprint.json]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.disk import drop_from_page_cache
from benchmarks.machine import finish, machine, write
from llama_cache.state import fingerprint


def _edges_identity(path: Path) -> str:
    """The identity used before: size plus the first and last MiB."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    digest.update(size.to_bytes(8, "little"))
    with open(path, "rb") as file:
        digest.update(file.read(1 << 20))
        file.seek(max(size - (1 << 20), 0))
        digest.update(file.read(1 << 20))
    return digest.hexdigest()


def _timed(function, *args):  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4.0, help="file size in GiB (default 4)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fingerprint.json"))
    args = parser.parse_args()
    size = int(args.gib * (1 << 30))
    described = machine()
    with tempfile.TemporaryDirectory(dir=".") as workdir:
        os.environ["LLAMA_CACHE_HOME"] = str(Path(workdir) / "home")
        path = Path(workdir) / "model.gguf"
        block = os.urandom(8 << 20)
        with open(path, "wb") as file:
            for _ in range(size // len(block)):
                file.write(block)
            file.write(block[: size % len(block)])
        rows: list[tuple[str, float]] = []
        _, seconds = _timed(fingerprint.file_identity, path)
        rows.append(("whole file, from the page cache", seconds))
        fingerprint._memo.clear()
        (Path(workdir) / "home" / "file-identities.json").unlink()
        drop_from_page_cache(path)
        _, seconds = _timed(fingerprint.file_identity, path)
        rows.append(("whole file, pages dropped first (disk)", seconds))
        _, seconds = _timed(fingerprint.file_identity, path)
        rows.append(("again in the same process (memo)", seconds))
        probe = (
            "import time; from llama_cache.state.fingerprint import file_identity; "
            f"t = time.perf_counter(); file_identity({str(path)!r}); print(time.perf_counter() - t)"
        )
        fresh = float(subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout)
        rows.append(("a fresh process (memo file)", fresh))
        drop_from_page_cache(path)
        _, seconds = _timed(_edges_identity, path)
        rows.append(("old identity: size + first and last MiB (disk)", seconds))
    width = max(len(name) for name, _ in rows)
    print(f"Model identity for a {args.gib:g} GiB file")
    print(f"{'what':<{width}}  {'seconds':>9}  {'GB/s':>6}")
    for name, seconds in rows:
        rate = size / seconds / 1e9 if "whole file" in name and seconds > 0 else float("nan")
        print(f"{name:<{width}}  {seconds:>9.4f}  {rate:>6.2f}")
    results = {"machine": described, "bytes": size, "seconds": dict(rows)}
    finish(results)
    write(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
