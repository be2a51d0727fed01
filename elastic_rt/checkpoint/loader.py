"""Loading the newest checkpoint that verifies: candidates, distributed checks, fallback, DCP load."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Iterable, MutableMapping, Protocol

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from elastic_rt.checkpoint import collectives as coll
from elastic_rt.checkpoint.checked_read import verified_while_loading
from elastic_rt.checkpoint.collectives import CheckpointGroups
from elastic_rt.checkpoint.manifest import FileEntry, Manifest
from elastic_rt.checkpoint.options import CheckpointOptions
from elastic_rt.checkpoint.saver import describe_error
from elastic_rt.checkpoint.storage import CheckpointStore, file_problem, rank_filename
from elastic_rt.checkpoint.trust import SafeLoadPlanner
from elastic_rt.checkpoint.user_state import decode_per_rank, split_state
from elastic_rt.checkpoint.writer import METADATA_NAME, CheckpointReader
from elastic_rt.errors import CheckpointError, ElasticRTError
from elastic_rt.checkpoint import checksum

log = logging.getLogger(__name__)


class ReadSource(Protocol):
    """Where a load reads a step's files: storage (CheckpointStore), or host memory in front of it."""

    url: str

    def prepare(self, step: int, data_dir: str, manifest: Manifest) -> None: ...
    def verify_files(self, data_dir: str, files: Iterable[FileEntry]) -> list[str]: ...
    def check_sizes(self, data_dir: str, files: Iterable[FileEntry]) -> list[str]: ...
    def read_file(self, data_dir: str, name: str) -> bytes: ...
    def open_read(self, path: str) -> Any: ...


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A step's commit to try (manifest), or a damaged one to report (problem); `stops` ends the load."""

    step: int
    label: str
    data_dir: str = ""
    manifest: Manifest | None = None
    problem: str = ""
    stops: bool = False


_FIX_UNREADABLE = ("nothing was loaded, and an older checkpoint is not loaded in its place: fix the storage "
                   "error and start again")


def candidates(store: CheckpointStore) -> list[Candidate]:
    """Rank 0: every commit, newest step and generation first; damaged ones as reports."""
    out = []
    for entry in reversed(store.list()):
        newest = True
        for commit in reversed(entry.commits):
            label = f"step {entry.step}" if newest else f"step {entry.step} (an earlier save of it)"
            newest = False
            if commit.manifest is not None:
                out.append(Candidate(step=entry.step, label=label, data_dir=entry.data_dir(commit.manifest),
                                     manifest=commit.manifest))
                continue
            stops = commit.damage is not None and commit.damage.stops_load
            problem = f"{commit.name}: {commit.problem}"
            if stops and "upgrade" not in problem:
                problem = f"{problem}; {_FIX_UNREADABLE}"
            out.append(Candidate(step=entry.step, label=label, problem=problem, stops=stops))
    return out


def load_latest(
    state: MutableMapping[str, Any], *, store: CheckpointStore, source: ReadSource, groups: CheckpointGroups,
    options: CheckpointOptions, newer_than: int | None = None,
) -> int | None:
    """Every rank: load the newest committed checkpoint whose files match its manifest into state.
    A damaged manifest (bad JSON, checksum, signature) or a file that does not match is skipped with a
    warning naming the step and the reason, and left on storage; a manifest that cannot be read (a
    storage error) or is from a newer format stops the load with one line. Small files (.metadata,
    per-rank files) are checked before anything reads them; DCP's data files by the load's own read
    (checkpoint/checked_read.py); a step whose files do not match is loaded no further and the
    previous one is loaded again in full. None when nothing was ever committed (or, with `newer_than`,
    nothing newer than that step)."""
    found: Any = None
    if groups.rank == 0:
        try:
            found = candidates(store)
        except ElasticRTError as exc:
            found = f"cannot list checkpoints under {store.url}: {exc}"
    found = coll.broadcast(found, groups.ctl)
    if isinstance(found, str):
        raise CheckpointError(found)
    if newer_than is not None:
        found = [c for c in found if c.step > newer_than]
    failures = []
    for i, cand in enumerate(found):
        if cand.stops:
            raise CheckpointError(f"checkpoint {cand.label} under {store.url} cannot be read: {cand.problem}")
        problems = _try(cand, state, source, groups, options)
        if not problems:
            return cand.step
        following = found[i + 1].label if i + 1 < len(found) else "nothing"
        failures.append(f"{cand.label}: {problems[0]}")
        if groups.rank == 0:
            what = "has a damaged manifest" if cand.manifest is None else "is corrupt"
            log.warning("checkpoint %s under %s %s (%s); falling back to %s (the damaged one stays on storage)",
                        cand.label, store.url, what, "; ".join(problems), following)
    if failures:
        raise CheckpointError(
            f"none of the {len(failures)} checkpoints under {store.url} verifies "
            f"({'; '.join(failures)}); move them aside to start from scratch"
        )
    return None


def _try(cand: Candidate, state: MutableMapping[str, Any], source: ReadSource, groups: CheckpointGroups,
         options: CheckpointOptions) -> list[str]:
    manifest = cand.manifest
    if manifest is None:
        return [cand.problem]
    source.prepare(cand.step, cand.data_dir, manifest)
    problems = _check_before_load(cand.data_dir, manifest, source=source, groups=groups, options=options)
    if not problems:
        problems = _load_step(cand.step, cand.data_dir, manifest, state, source=source, groups=groups,
                              options=options)
    return problems


def _everyone(problems: list[str], groups: CheckpointGroups) -> list[str]:
    return sorted(p for per_rank in coll.all_gather(problems, groups.ctl) for p in per_rank)


def _check_before_load(
    data_dir: str, manifest: Manifest, *, source: ReadSource, groups: CheckpointGroups, options: CheckpointOptions
) -> list[str]:
    """Every rank (collective): sizes of 1/world of the files, and the checksums of those among them that
    the load's own read does not check. The problems of all ranks, so that all decide alike."""
    problems: list[str] = []
    if options.verify_on_load:
        mine = [f for j, f in enumerate(manifest.files) if j % groups.world_size == groups.rank]
        problems = source.verify_files(data_dir, [f for f in mine if not verified_while_loading(f.path)])
        problems += source.check_sizes(data_dir, [f for f in mine if verified_while_loading(f.path)])
    return _everyone(problems, groups)


def _check_after_load(
    reader: CheckpointReader, data_dir: str, manifest: Manifest, *, source: ReadSource, groups: CheckpointGroups,
) -> list[str]:
    """Every rank (collective): what the load's reads found, and the checksums of data files no rank read
    (no state came from them, but a checkpoint that loads has every file intact)."""
    gathered = coll.all_gather((reader.problems, sorted(reader.files_read)), groups.ctl)
    problems = sorted(p for found, _ in gathered for p in found)
    read = {name for _, names in gathered for name in names}
    unread = [f for f in manifest.files if verified_while_loading(f.path) and f.path not in read]
    if unread:  # the same list on every rank
        mine = [f for j, f in enumerate(unread) if j % groups.world_size == groups.rank]
        problems += _everyone(source.verify_files(data_dir, mine), groups)
    return problems


def _load_step(
    step: int,
    data_dir: str,
    manifest: Manifest,
    state: MutableMapping[str, Any],
    *,
    source: ReadSource,
    groups: CheckpointGroups,
    options: CheckpointOptions,
) -> list[str]:
    """Load one step into `state`; the problems its data files showed (then `state` must not be used)."""
    global_part, per_rank = split_state(state, options.per_rank_keys)
    by_name = {f.path: f for f in manifest.files}
    verify = options.verify_on_load or manifest.signed
    expected = {n: f for n, f in by_name.items() if verified_while_loading(n)} if verify else None
    reader = CheckpointReader(source.open_read, data_dir, expected=expected,
                              metadata_entry=by_name.get(METADATA_NAME) if verify else None)
    try:
        dcp.load(global_part, storage_reader=reader, planner=SafeLoadPlanner(), process_group=groups.io,
                 no_dist=groups.io is None)
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(
            f"loading step {step} from {source.url} failed ({describe_error(exc)}); "
            "does the state passed to load_latest() have the keys and shapes that were saved?"
        ) from exc
    if expected is not None:
        problems = _check_after_load(reader, data_dir, manifest, source=source, groups=groups)
        if problems:
            return problems
    state.update(global_part)
    wanted = set(per_rank) & set(manifest.per_rank_keys)
    if not wanted:
        return []
    name = rank_filename(groups.rank)
    entry = by_name.get(name)
    if entry is None:
        log.info(
            "rank %d: step %d was saved at world size %d and has no %s for this rank; keeping current",
            groups.rank, step, manifest.world_size, sorted(wanted),
        )
        return []
    data = source.read_file(data_dir, name)
    if verify:  # the bytes that are decoded are the bytes that are checked
        sha = hashlib.sha256(data).hexdigest() if entry.sha256 is not None else None
        problem = "size" if len(data) != entry.size else file_problem(entry, (checksum.crc32(data), sha))
        if problem is not None:
            raise CheckpointError(f"{data_dir}/{name} changed after it was verified ({problem}); not loaded")
    loaded = decode_per_rank(data)
    for key in wanted & set(loaded):
        state[key] = loaded[key]
    return []
