"""Training checkpoints and resume: <save_dir>/iter_<rollout_id>/{model/, optimizer/, rng/, state.json, hf_config/,
manifest.json}, the `latest` pointer, pruning, the free-space check before a save, and the resume fingerprint.

(Re-exported by vime_core.checkpoint, where the HF and torch_dist formats live.)
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path

from vime_core.config.fingerprint import FINGERPRINT_VERSION, VERSION_KEY
from vime_core.errors import DiskSpaceError, VimeError
from vime_core.fsutil import atomic_write_text, fsync_dir
from vime_core.integrity import (
    MANIFEST,
    SPACE_MARGIN,
    disk_full_error,
    free_bytes,
    gib,
    is_disk_full,
    manifest_bytes,
    manifest_problems,
    safetensors_problem,
    write_manifest,
)

log = logging.getLogger(__name__)

LATEST = "latest"
STATE_FILE = "state.json"


class ResumeError(VimeError, RuntimeError):
    """A checkpoint cannot be resumed; the message names the differences and the way to start fresh."""


class CheckpointReadError(VimeError, OSError):
    """A checkpoint file could not be read for a reason that does not prove damage (EIO, EACCES): the checkpoint is
    left in place, not set aside; the message names the file."""


def _read_error(ckpt: Path, e: OSError) -> CheckpointReadError:
    return CheckpointReadError(
        f"{e.filename or ckpt} cannot be read ({e.strerror or e}) while checking checkpoint {ckpt}; it was left in "
        "place (the file may be intact): fix the disk or the permissions and run again"
    )


def iter_name(rollout_id: int) -> str:
    return f"iter_{rollout_id:07d}"


ITER_RE = re.compile(r"iter_\d{7}")


_VERIFIED: set[tuple] = set()


def _verified_key(ckpt: Path) -> tuple:
    """A checkpoint as it is on disk now: its path and every file's (size, mtime) by the manifest's list."""
    try:
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
        stats = tuple((rel, (ckpt / rel).stat().st_size, (ckpt / rel).stat().st_mtime_ns) for rel in sorted(files))
    except (OSError, ValueError, KeyError, TypeError):
        return (str(ckpt), None)
    return (str(ckpt.resolve()), stats)


class Checkpointer:
    """Owns the save directory. A checkpoint only ever appears complete by a directory rename, after every file in it
    was fsynced and listed (size, CRC-32) in its manifest; `latest` is replaced after it, and old ones beyond
    `keep_last` are renamed out of the way (`.deleting-*`) before they are deleted, so a kill at any moment never
    leaves a partial directory that counts as complete. An interrupted save leaves a `*.tmp-*` directory that is
    never picked and is cleaned up by the next save. On resume the newest checkpoint that passes its manifest is
    used; a damaged one is renamed `*.damaged-<time>` (kept, never deleted) with a warning naming what was wrong."""

    def __init__(self, save_dir: str | Path, keep_last: int = 2):
        self.dir = Path(save_dir)
        self.keep_last = keep_last

    # -- writing --------------------------------------------------------------------------------------------------------
    def begin(self, rollout_id: int) -> Path:
        """A fresh temporary directory for the save of `rollout_id` (stale temporaries are removed), after checking
        that the disk can hold it (see `make_room`)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in [*self.dir.glob("iter_*.tmp-*"), *self.dir.glob(".deleting-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        self.make_room()
        tmp = self.dir / f"{iter_name(rollout_id)}.tmp-{os.getpid()}"
        tmp.mkdir()
        return tmp

    def make_room(self) -> None:
        """Free space for one more checkpoint of the size of the last one: prune first the checkpoints that the
        save would prune anyway (never the newest), then raise DiskSpaceError saying how much is needed and where."""
        done = self.complete()
        need = manifest_bytes(done[-1]) if done else None
        if not need:
            return
        need = int(need * SPACE_MARGIN)
        prunable = done[: max(0, len(done) + 1 - self.keep_last)][: len(done) - 1]  # never the newest
        while free_bytes(self.dir) < need and prunable:
            old = prunable.pop(0)
            log.warning(
                "only %s free in %s, the next checkpoint needs ~%s: pruning %s now (keep_last = %d would "
                "after the save)",
                gib(free_bytes(self.dir)),
                self.dir,
                gib(need),
                old.name,
                self.keep_last,
            )
            self._delete(old)
        free = free_bytes(self.dir)
        if free < need:
            raise DiskSpaceError(
                f"not enough free space in {self.dir} for the next checkpoint: it needs ~{gib(need)} (the size of "
                f"{done[-1].name}), {gib(free)} are free. The earlier checkpoints are intact; free space there, move "
                f"output_dir, or lower checkpoint.keep_last (now {self.keep_last}; the newest checkpoint is always kept)"
            )

    @contextmanager
    def writing(self, tmp: Path):
        """Around a save into `tmp`: a full disk (torch's `unexpected pos` among its spellings) becomes one
        DiskSpaceError naming the path and the size needed; the torn `tmp` is removed to give the space back."""
        try:
            yield tmp
        except Exception as e:
            if not is_disk_full(e):
                raise
            done = self.complete()
            shutil.rmtree(tmp, ignore_errors=True)
            raise disk_full_error(self.dir, manifest_bytes(done[-1]) if done else None) from e

    def commit(self, tmp: Path, rollout_id: int, state: dict) -> Path:
        (tmp / STATE_FILE).write_text(json.dumps({**state, "rollout_id": rollout_id}, indent=2, default=str))
        write_manifest(tmp)  # fsyncs every file and directory first
        final = self.dir / iter_name(rollout_id)
        if final.exists():  # a redo of a step after a crash: the new one replaces it
            self._delete(final)
        os.replace(tmp, final)
        fsync_dir(self.dir)
        atomic_write_text(self.dir / LATEST, iter_name(rollout_id))
        self._prune()
        return final

    def _prune(self) -> None:
        done = self.complete()
        for old in done[: max(0, len(done) - self.keep_last)]:
            self._delete(old)

    def _delete(self, ckpt: Path) -> None:
        """Rename first (atomic: it stops counting as a checkpoint at once), then delete."""
        doomed = self.dir / f".deleting-{ckpt.name}-{os.getpid()}"
        try:
            os.replace(ckpt, doomed)
        except FileNotFoundError:  # set aside meanwhile (found damaged by another process)
            return
        shutil.rmtree(doomed, ignore_errors=True)

    # -- reading --------------------------------------------------------------------------------------------------------
    def complete(self) -> list[Path]:
        """Checkpoint directories that look complete (named iter_NNNNNNN, with a state file), oldest first."""
        if not self.dir.is_dir():
            return []
        return sorted(
            p
            for p in self.dir.glob("iter_*")
            if ITER_RE.fullmatch(p.name) and p.is_dir() and (p / STATE_FILE).is_file()
        )

    def latest(self) -> Path | None:
        """The newest intact checkpoint: the one `latest` names, else the highest complete iteration; any that fails
        its manifest or whose state file does not parse is set aside with a warning, and the next one is tried.
        Raises ResumeError when checkpoints were there but none is intact (also on a later call, by the
        `*.damaged-*` dirs left): restarting at step 0 in the same dir would silently lose the run."""
        for cand in self._candidates():
            problems = self.problems(cand)
            if not problems:
                return cand
            if not cand.exists():
                continue  # pruned by a running save while we read it (another process): not damaged
            aside = cand.with_name(cand.name + time.strftime(".damaged-%Y%m%d-%H%M%S"))
            try:
                os.replace(cand, aside)
            except FileNotFoundError:
                continue
            log.warning(
                "checkpoint %s is damaged (%s): kept as %s; resuming from the one before it",
                cand,
                "; ".join(problems[:4]),
                aside.name,
            )
        damaged = sorted(p.name for p in self.dir.glob("iter_*.damaged-*")) if self.dir.is_dir() else []
        if damaged:
            raise ResumeError(
                f"no intact checkpoint in {self.dir}: {', '.join(damaged[-3:])} are damaged (kept, renamed; see the "
                "warnings above). Set checkpoint.start_fresh=true to start over (the old ones are kept, renamed), or "
                "restore a checkpoint there"
            )
        return None

    def peek_latest(self) -> Path | None:
        """The checkpoint `latest` would pick, by a cheap check only (state file parses, sizes match the manifest;
        no checksums, nothing set aside): for reading a value from its state (the MLflow run id) without reading
        every byte of a large checkpoint (~26 s for an 8B model with optimizer state)."""
        for cand in self._candidates():
            if not self.problems(cand, full=False):
                return cand
        return None

    def _candidates(self) -> list[Path]:
        done = self.complete()
        pointer = self.dir / LATEST
        named = None
        if pointer.is_file():
            try:
                named = self.dir / pointer.read_bytes().decode().strip()
            except (OSError, UnicodeDecodeError):
                log.warning("%s is unreadable (not a checkpoint name): using the newest complete checkpoint", pointer)
            if named is not None and named not in done:
                named = None  # a stale pointer (a save that never completed) or garbage
        return ([named] if named else []) + [d for d in reversed(done) if d != named]

    @staticmethod
    def problems(ckpt: Path, full: bool = True) -> list[str]:
        """What is wrong with a checkpoint ([] when intact): its state file must parse; its files must match its
        manifest. One without a manifest (written before manifests existed, or its manifest was lost) gets what its
        files' own formats can tell, `unlisted_problems`: a truncated shard beside a missing manifest is damage too."""
        problems = []
        try:
            json.loads((ckpt / STATE_FILE).read_text())
        except (FileNotFoundError, ValueError) as e:  # definite: gone, torn or garbage (UnicodeDecodeError too)
            problems.append(f"{STATE_FILE} is unreadable ({type(e).__name__})")
        except OSError as e:  # EIO, EACCES...: not proof of damage, never a reason to set the checkpoint aside
            raise _read_error(ckpt, e) from e
        if (ckpt / MANIFEST).exists():
            key = _verified_key(ckpt)
            if full and not problems and key in _VERIFIED:
                return []  # checksummed already by this process (the CLI and the loop both ask), sizes unchanged
            try:
                found = manifest_problems(ckpt, full)
            except OSError as e:
                raise _read_error(ckpt, e) from e
            problems += [p for p in found if not (problems and p.startswith(STATE_FILE))]
            if full and not problems:
                _VERIFIED.add(key)
        elif not problems:
            try:
                problems = unlisted_problems(ckpt)
            except OSError as e:
                raise _read_error(ckpt, e) from e
        return problems

    @staticmethod
    def read_state(ckpt: Path) -> dict:
        path = ckpt / STATE_FILE
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ResumeError(
                f"{path} is unreadable ({type(e).__name__}: {str(e)[:120]}); remove {ckpt} to resume "
                f"from the checkpoint before it, or start fresh with --set checkpoint.start_fresh=true"
            ) from None

    def move_aside(self) -> Path | None:
        """`checkpoint.start_fresh`: keep the old checkpoints, renamed with a timestamp, and start empty."""
        if not self.dir.exists() or not any(self.dir.iterdir()):
            return None
        aside = self.dir.with_name(self.dir.name + time.strftime(".old-%Y%m%d-%H%M%S"))
        os.replace(self.dir, aside)
        return aside


def unlisted_problems(ckpt: Path) -> list[str]:
    """What is wrong with a checkpoint that has no manifest, from its files' own formats, without loading them
    (~10 ms for the tiny model): every torch.save file (`.pt`: a zip archive) ends with its central directory, every
    safetensors header matches its file's size, every JSON file parses, and the `.distcp` shards of each torch_dist
    directory hold the byte ranges its `.metadata` lists. A shard cut short is found here, not as a 231-line
    `CheckpointException ... EOFError` from every rank after the actors started."""
    problems = []
    for p in sorted(f for f in ckpt.rglob("*") if f.is_file()):
        rel = p.relative_to(ckpt).as_posix()
        if p.suffix == ".pt" and not zipfile.is_zipfile(p):
            problems.append(f"{rel} is truncated or corrupt (not a complete torch.save archive)")
        elif p.suffix == ".safetensors" and (problem := safetensors_problem(p)):
            problems.append(problem)
        elif p.suffix == ".json":
            try:
                json.loads(p.read_bytes())
            except ValueError as e:  # UnicodeDecodeError too
                problems.append(f"{rel} is unreadable ({type(e).__name__})")
        elif p.name == ".metadata":
            problems += distcp_problems(p.parent, ckpt)
    return problems


def distcp_problems(d: Path, ckpt: Path) -> list[str]:
    """A torch_dist directory's shards against the byte ranges its `.metadata` records (torch's reader unpickles the
    metadata only: no tensor is read)."""
    from torch.distributed.checkpoint import FileSystemReader

    rel = d.relative_to(ckpt).as_posix()
    try:
        metadata = FileSystemReader(str(d)).read_metadata()
    except (EOFError, pickle.UnpicklingError) as e:  # torn or garbage: damage
        return [f"{rel}/.metadata is unreadable ({type(e).__name__})"]
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, end in sorted(need.items()):
        shard = d / name
        if not shard.is_file():
            problems.append(f"{rel}/{name} is missing")
        elif shard.stat().st_size < end:
            problems.append(f"{rel}/{name} has {shard.stat().st_size:,} bytes, its .metadata needs {end:,}")
    return problems


def fingerprint_differences(saved: dict, current: dict, prefix: str = "", common_only: bool = False) -> list[str]:
    """Dotted fields whose values differ between two fingerprint dicts, as 'field: saved -> current'. A field only
    one side records differs too ('<absent>'), unless `common_only`."""
    out = []
    keys = set(saved) & set(current) if common_only else set(saved) | set(current)
    for key in sorted(keys):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += fingerprint_differences(a, b, name + ".", common_only)
        elif a != b:
            out.append(f"{name}: {a!r} -> {b!r}")
    return out


def dotted_keys(d: dict, prefix: str = "") -> set[str]:
    return {
        k
        for key, v in d.items()
        for k in (dotted_keys(v, f"{prefix}{key}.") if isinstance(v, dict) else {prefix + key})
    }


def check_resume_setting(cfg) -> None:
    """checkpoint.resume = false in a save dir that holds checkpoints is refused: the new run's iter_N would mix
    with the old run's (pruning by name deletes the new ones, an export of an old iter_N is reused as this run's)."""
    if cfg.checkpoint.resume or cfg.checkpoint.start_fresh:
        return
    done = Checkpointer(cfg.save_dir).complete()
    if done:
        raise ResumeError(
            f"checkpoint.resume = false but {cfg.save_dir} holds checkpoints up to {done[-1].name}; set "
            "checkpoint.start_fresh=true to move them aside, or choose another output_dir"
        )


def check_resumable(state: dict, cfg) -> None:
    """Refuse a resume whose fixed settings (`RunConfig.fingerprint_fields`) differ from the checkpoint's.

    A checkpoint of fingerprint version 1 (the hand-kept list, before the fields were tagged: no version key) records
    a subset of today's fixed fields; those it records are compared, the others cannot be and are named in a warning.
    A version this code does not know (written by a newer vime-flow) is refused."""
    saved, current = state.get("fingerprint_fields") or {}, cfg.fingerprint_fields()
    if not saved:
        raise ResumeError(
            f"the checkpoint in {cfg.save_dir} records no settings (its {STATE_FILE} has no fingerprint_fields), so "
            f"nothing says that resuming would continue that run; start fresh with --set checkpoint.start_fresh=true "
            f"(the old checkpoints are kept, renamed) or choose another output_dir."
        )
    version = saved.get(VERSION_KEY, 1)
    if version not in (1, FINGERPRINT_VERSION):
        raise ResumeError(
            f"the checkpoint in {cfg.save_dir} records fingerprint version {version}, which this vime-flow (version "
            f"{FINGERPRINT_VERSION}) cannot compare; resume it with the vime-flow that wrote it, or start fresh with "
            f"--set checkpoint.start_fresh=true (the old checkpoints are kept, renamed) or another output_dir."
        )
    diffs = fingerprint_differences(saved, current, common_only=version == 1)
    if version == 1 and not diffs:
        unchecked = sorted(dotted_keys(current) - dotted_keys(saved) - {VERSION_KEY})
        log.warning(
            "the checkpoint in %s was written before every setting was tagged (fingerprint version 1): "
            "resuming; %d fixed setting(s) it does not record could not be compared: %s",
            cfg.save_dir,
            len(unchecked),
            ", ".join(unchecked),
        )
    if diffs:
        raise ResumeError(
            f"the checkpoint in {cfg.save_dir} was written by a run with different settings, so resuming would not "
            f"continue that run: {'; '.join(diffs)}. Restore those settings to resume, or start fresh with "
            f"--set checkpoint.start_fresh=true (the old checkpoints are kept, renamed) or another output_dir."
        )
