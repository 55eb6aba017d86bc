"""``llama-cache inspect DIR [--check] [--fix]``: list a disk cache's entries, optionally reconcile it.

    llama-cache inspect .cache/llama_cache               entries, most recently used first, and totals
    llama-cache inspect DIR --check [--deep]             also reconcile index rows with payload files
    llama-cache inspect DIR --fix [--grace SECONDS]      ... and remove what is broken

Wired into :mod:`llama_cache.cli` by :func:`add_inspect_command`; :func:`run_inspect` does the work
through :class:`~llama_cache.caches.disk.LlamaDiskCache`'s public methods and returns the report, which
the CLI prints.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from llama_cache.caches.disk import INDEX_FILE, CheckReport, DiskEntry, LlamaDiskCache, StorageReport

__all__ = ["add_inspect_command", "format_entries", "format_report", "format_storage", "run_inspect"]


def add_inspect_command(
    subparsers: Any, parents: Sequence[argparse.ArgumentParser] = ()
) -> argparse.ArgumentParser:
    """Register the ``inspect`` sub-command on an ``add_subparsers()`` object and return its parser.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers`` returned.
        parents: parent parsers whose options the sub-command shares.
    """
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "inspect",
        parents=list(parents),
        help="list a disk cache's entries; --check/--fix reconcile its index and files",
        description="List the entries of a LlamaDiskCache directory (most recently used first) with "
        "totals. --check reconciles index rows with payload files; --fix removes broken entries and "
        "orphan files.",
    )
    parser.add_argument("cache_dir", type=Path, metavar="DIR", help="the disk cache directory")
    parser.add_argument("--check", action="store_true", help="reconcile index rows and payload files")
    parser.add_argument("--fix", action="store_true", help="like --check, and remove what is broken")
    parser.add_argument(
        "--deep", action="store_true", help="with --check/--fix: also decode and checksum every payload"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="--fix leaves orphan files younger than this (a write in progress); default 60",
    )
    parser.add_argument(
        "--limit", type=int, default=None, metavar="N", help="list only the N most recently used entries"
    )
    return parser


def run_inspect(args: argparse.Namespace) -> tuple[int, str]:
    """Run ``llama-cache inspect`` with parsed arguments; the caller prints the report.

    Returns:
        The exit status and the report. Status 0 when the cache is fine (or was fixed), 1 when
        ``--check`` found entries that could hurt, 2 when ``DIR`` holds no disk cache (the report is
        then the error message).
    """
    cache_dir: Path = args.cache_dir
    if not (cache_dir / INDEX_FILE).is_file():
        return 2, f"llama-cache inspect: no disk cache in {cache_dir} (no {INDEX_FILE})"
    try:
        cache = LlamaDiskCache(cache_dir, write_behind=False)
    except OSError as error:
        return 2, f"llama-cache inspect: {error}"
    with cache:
        lines = [
            f"disk cache {cache_dir}",
            format_entries(cache.entries(), limit=args.limit, models=cache.models()),
            format_storage(cache.storage()),
        ]
        if not (args.check or args.fix):
            return 0, "\n".join(lines)
        report = cache.check(fix=bool(args.fix), deep=bool(args.deep), grace_seconds=float(args.grace))
    lines.append(format_report(report))
    return (1 if report.problems and not args.fix else 0), "\n".join(lines)


def format_entries(
    entries: Sequence[DiskEntry], limit: int | None = None, models: Mapping[str, Mapping[str, str]] | None = None
) -> str:
    """A table of entries, most recently used first, with totals per namespace and overall.

    ``models`` (from :meth:`LlamaDiskCache.models`) names the model of each namespace it knows.
    """
    models = models or {}
    newest_first = list(reversed(entries))
    shown = newest_first if limit is None else newest_first[: max(limit, 0)]
    header = ("#", "tokens", "size", "codec", "namespace", "hits", "last access", "created")
    rows = [
        (
            str(number),
            str(entry.n_tokens),
            _human(entry.size),
            entry.codec,
            entry.namespace,
            str(entry.hits),
            _when(entry.accessed),
            _when(entry.created),
        )
        for number, entry in enumerate(shown, 1)
    ]
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    right = {0, 1, 2, 5}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.rjust(width) if i in right else cell.ljust(width) for i, (cell, width) in enumerate(zip(cells, widths))
        ).rstrip()

    lines = [line(header), line(["-" * width for width in widths])]
    lines.extend(line(row) for row in rows)
    if len(shown) < len(entries):
        lines.append(f"... {len(entries) - len(shown)} older entries not shown")
    total = sum(entry.size for entry in entries)
    raw = sum(entry.raw_size for entry in entries)
    namespaces: dict[str, list[int]] = {}
    for entry in entries:
        counts = namespaces.setdefault(entry.namespace, [0, 0, 0])
        counts[0] += 1
        counts[1] += entry.size
        counts[2] += entry.hits
    lines.append("")
    for namespace, (count, size, hits) in sorted(namespaces.items()):
        lines.append(f"namespace {namespace}{_model_name(models.get(namespace))}: {count} entries, {_human(size)}, {hits} hits")
    summary = (
        f"total: {len(entries)} entries, {_human(total)} on disk in {len(namespaces)} namespace(s), "
        f"{sum(entry.hits for entry in entries)} hits, {sum(entry.n_tokens for entry in entries)} tokens"
    )
    if raw != total:
        summary += f" ({_human(raw)} uncompressed)"
    lines.append(summary)
    return "\n".join(lines)


def format_storage(report: StorageReport) -> str:
    """Unique against logical bytes: what sharing chunks saves."""
    return (
        f"storage: {_human(report.unique_bytes)} unique on disk ({report.chunks} shared KV chunks) for "
        f"{_human(report.logical_bytes)} of entries stored whole: {report.dedup_ratio:.2f}x"
    )


def format_report(report: CheckReport) -> str:
    """A short text account of a :class:`CheckReport`."""
    lines = [
        f"check: {report.entries} entries, {report.files} files, index records {_human(report.bytes_indexed)}, "
        f"files hold {_human(report.bytes_on_disk)}, SQLite quick_check {'ok' if report.index_ok else 'FAILED'}"
    ]
    for label, files in (
        ("entries whose file is missing", report.missing_files),
        ("entries whose file size differs from the index", report.size_mismatches),
        ("entries whose payload does not decode", report.corrupt_files),
        ("orphan files (named by no entry; harmless)", report.orphan_files),
        ("malformed rows (ignored by lookups; --fix deletes them)", report.malformed_rows),
        ("entries whose chunks are missing or damaged", report.broken_chains),
        ("chunks no entry uses (harmless; --fix frees them)", report.leaked_chunks),
        ("empty shard folders (harmless; --fix removes them)", report.empty_folders),
    ):
        if files:
            lines.append(f"  {len(files)} {label}:")
            lines.extend(f"    {file}" for file in files[:20])
            if len(files) > 20:
                lines.append(f"    ... and {len(files) - 20} more")
    if report.chunks:
        lines[0] += f", {report.chunks} chunks"
    lines.insert(1, f"  the directory takes {_human(report.disk_usage)} as du counts it; the byte budget counts "
                    f"{_human(report.budgeted_bytes)} of it")
    if report.removed_entries or report.removed_files:
        lines.append(f"fixed: removed {report.removed_entries} entries and {report.removed_files} orphan files")
    if report.ok:
        lines.append("check: no problem found")
    elif not report.problems:
        lines.append("check: no entry can hurt (orphans only waste space)")
    return "\n".join(lines)


def _model_name(info: Mapping[str, str] | None) -> str:
    """`` (file, desc, N params)`` for a namespace whose model is recorded, else nothing.

    The description comes from the index (untrusted): control characters are replaced so that a
    forged one cannot rewrite the terminal.
    """
    if not info:
        return ""
    parts = [info[name] for name in ("file", "desc") if info.get(name)]
    n_params = info.get("n_params", "")
    if n_params.isdigit():
        parts.append(f"{int(n_params) / 1e6:.0f}M params")
    text = ", ".join(parts) or ", ".join(f"{k}={v}" for k, v in sorted(info.items()))
    return " (" + "".join(c if c.isprintable() else "?" for c in text) + ")"


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))
