"""`elastic-rt ckpt list|verify URL`: tables of checkpoints, committed or not, and their integrity."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

from elastic_rt.checkpoint.storage import CheckpointEntry, CheckpointStore
from elastic_rt.checkpoint.secret import read_secret_file
from elastic_rt.errors import ElasticRTError


def add_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `ckpt` (with `list` and `verify`) on the top-level parser's subparsers."""
    parser = subparsers.add_parser("ckpt", help="inspect and verify checkpoints")
    actions = parser.add_subparsers(dest="ckpt_command", metavar="{list,verify}")
    actions.required = True
    listing = actions.add_parser("list", help="list checkpoints under URL (committed or not)")
    listing.add_argument("url", metavar="URL", help="checkpoint root: a path or fsspec URL")
    verify = actions.add_parser(
        "verify", help="check every committed checkpoint's files against its manifest (sizes, crc32)"
    )
    verify.add_argument("url", metavar="URL", help="checkpoint root: a path or fsspec URL")
    verify.add_argument("--step", type=int, default=None, help="verify only this step")
    for sub in (listing, verify):
        sub.add_argument("--secret-file", default=None, metavar="PATH",
                         help="the job's checkpoint secret: manifests must be signed with it")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print the table for args.ckpt_command; 0 on success, non-zero when verification fails."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        secret_file = getattr(args, "secret_file", None)
        store = CheckpointStore(args.url, secret=read_secret_file(secret_file) if secret_file else None)
        entries = store.list()
        if getattr(args, "step", None) is not None:
            entries = [e for e in entries if e.step == args.step]
            if not entries:
                print(f"elastic-rt ckpt: no checkpoint for step {args.step} under {args.url}", file=err)
                return 1
        if not entries:
            print(f"elastic-rt ckpt: no checkpoints under {args.url}", file=err)
            return 1
        if args.ckpt_command == "list":
            _print_table(out, [_row(store, e) for e in entries], integrity=False)
            return 0
        return _verify(store, entries, out, err)
    except ElasticRTError as exc:
        print(f"elastic-rt ckpt: {exc}", file=err)
        return exc.exit_code
    except OSError as exc:
        print(f"elastic-rt ckpt: cannot read {args.url} ({exc})", file=err)
        return 1


def _verify(store: CheckpointStore, entries: list[CheckpointEntry], out: TextIO, err: TextIO) -> int:
    rows, details, failed = [], [], 0
    for entry in entries:
        row = _row(store, entry)
        if entry.manifest is None:
            row["integrity"] = "-"
        else:
            problems = store.verify_files(entry.data_dir(entry.manifest), entry.manifest.files)
            row["integrity"] = "ok" if not problems else f"FAILED ({len(problems)} files)"
            failed += bool(problems)
            details += [f"step {entry.step}: {p}" for p in problems]
        rows.append(row)
    _print_table(out, rows, integrity=True)
    for line in details:
        print(line, file=out)
    committed = sum(e.committed for e in entries)
    damaged = [e.step for e in entries if e.damaged]
    if damaged:
        print(f"elastic-rt ckpt: damaged manifests (steps {', '.join(map(str, damaged))}); they are never deleted "
              "by elastic-rt: look at them, then move them aside", file=err)
        return 1
    if failed:
        print(f"elastic-rt ckpt: {failed} of {committed} committed checkpoints failed verification", file=err)
        return 1
    if not committed:
        print(f"elastic-rt ckpt: no committed checkpoint under {store.url}", file=err)
        return 1
    return 0


def _row(store: CheckpointStore, entry: CheckpointEntry) -> dict[str, str]:
    manifest = entry.manifest
    if manifest is not None:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(manifest.created_unix_s))
        return {
            "step": str(entry.step),
            "world": str(manifest.world_size),
            "size": _human(manifest.total_bytes),
            "state": "committed",
            "created": created,
        }
    try:
        size = _human(store.fs.du(entry.path))
    except Exception:  # noqa: BLE001 (a size is a courtesy: any client error shows as '?')
        size = "?"
    return {
        "step": str(entry.step),
        "world": "-",
        "size": size,
        "state": f"DAMAGED: {entry.problem}" if entry.damaged else f"uncommitted: {entry.problem}",
        "created": "-",
    }


def _print_table(out: TextIO, rows: list[dict[str, str]], *, integrity: bool) -> None:
    columns = ["step", "world", "size", "created", "state"] + (["integrity"] if integrity else [])
    widths = {c: max(len(c), *(len(r.get(c, "")) for r in rows)) for c in columns}
    # the last column is free text: no padding
    print("  ".join(c.upper().ljust(widths[c]) for c in columns).rstrip(), file=out)
    for row in rows:
        print("  ".join(row.get(c, "").ljust(widths[c]) for c in columns).rstrip(), file=out)


def _human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (until the top-level CLI wires `ckpt` in)."""
    parser = argparse.ArgumentParser(prog="elastic-rt")
    add_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
