"""Retention and clean-up after a commit, on the current writer's rank 0 only.

Rules (docs/checkpoint.md, "Retention"):
- Nothing is deleted unless the new commit's files have the sizes its manifest says.
- keep_last counts the new commit and the verified checkpoints (committed, every file present with
  its size) below it, newest first; the new commit is never deleted. Steps above the new commit (a
  fallback left a damaged newer one behind, or the job was rolled back) are neither counted nor
  deleted: their files may not verify, so they never stand in for a checkpoint that does.
- A step with a damaged manifest (any generation) is never deleted, and each run says so.
- Only what older epochs (older rounds, launches, jobs) wrote is deleted, never anything of a
  newer epoch; a save folder that no manifest names is a leftover, deleted when its epoch is
  older than this writer's (or is this writer's own: a save of its own that failed).
- The writer's token is checked before the run (FencedError: nothing deleted) and its local part
  before every delete.
"""

from __future__ import annotations

import logging
import posixpath

from elastic_rt.checkpoint.guard import WriterGuard
from elastic_rt.checkpoint.storage import CheckpointEntry, CheckpointStore
from elastic_rt.errors import CheckpointError

log = logging.getLogger(__name__)


def _epochs(entry: CheckpointEntry) -> list[int | None]:
    found: list[int | None] = [c.manifest.writer.epoch for c in entry.commits if c.manifest is not None]
    return found + list(entry.save_dirs.values())


def _referenced(entry: CheckpointEntry) -> set[str]:
    return {c.manifest.data_dir for c in entry.commits if c.manifest is not None and c.manifest.data_dir}


def apply_retention(store: CheckpointStore, guard: WriterGuard, *, keep_last: int, newest_step: int) -> list[int]:
    """After newest_step committed: delete what the rules allow. Returns the steps deleted whole."""
    guard.check()
    entries = store.list()
    by_step = {e.step: e for e in entries}
    new = by_step.get(newest_step)
    if new is None or new.manifest is None:
        log.warning("checkpoint retention skipped: step %d is not committed under %s", newest_step, store.url)
        return []
    problems = store.check_sizes(new.data_dir(new.manifest), new.manifest.files)
    if problems:
        log.warning("checkpoint retention skipped: step %d under %s does not match its manifest (%s)",
                    newest_step, store.url, "; ".join(problems))
        return []
    mine = guard.epoch
    kept = [newest_step]  # counted from the new commit down: what lies above it is not this run's to judge
    for entry in reversed(entries):
        if len(kept) >= keep_last:
            break
        manifest = entry.manifest
        if (entry.step < newest_step and manifest is not None
                and not store.check_sizes(entry.data_dir(manifest), manifest.files)):
            kept.append(entry.step)
    oldest_kept = min(kept)
    deleted = []
    for entry in entries:
        damaged = [c for c in entry.commits if c.manifest is None]
        if damaged:
            log.warning("checkpoint step %d under %s is damaged (%s); retention keeps it: look at it, then move "
                        "it aside", entry.step, store.url, damaged[-1].problem)
            continue
        newer = any(epoch is None or epoch > mine for epoch in _epochs(entry))
        if entry.step < oldest_kept and entry.commits and not newer and _delete(store, guard, entry.path, entry):
            deleted.append(entry.step)
            continue
        _clean_leftovers(store, guard, entry, mine)
    return deleted


def _clean_leftovers(store: CheckpointStore, guard: WriterGuard, entry: CheckpointEntry, mine: int) -> None:
    """Save folders no manifest names, of older epochs (or this writer's own failed ones)."""
    referenced = _referenced(entry)
    removed = 0
    for name, epoch in entry.save_dirs.items():
        if name in referenced or epoch is None or epoch > mine:
            continue
        if _delete(store, guard, posixpath.join(entry.path, name), None):
            removed += 1
    if not entry.commits and removed == len(entry.save_dirs) and not entry.loose_files:
        try:
            store.storage.rmdir(entry.path)  # only if empty: a newer writer may be creating a save folder in it
        except (OSError, CheckpointError) as exc:
            log.debug("checkpoint step folder %s not removed (%s)", entry.path, exc)


def _delete(store: CheckpointStore, guard: WriterGuard, path: str, entry: CheckpointEntry | None) -> bool:
    try:
        guard.check_local()
        if entry is not None:
            store.delete_step(entry)
        else:
            store.storage.remove_tree(path)
        return True
    except CheckpointError as exc:
        log.warning("checkpoint retention under %s stopped before deleting %s: %s", store.url, path, exc)
        raise
    except OSError as exc:
        log.warning("checkpoint retention: could not delete %s (%s)", path, exc)
        return False
