"""The size limit of the localization cache (RESULTS/.localize): least recently used job folders go first,
never one that a comparison running now may still read.

Probe and replay jobs keep their .npz probes so that comparing again reuses them. On the 32x32x3 graph
models one job folder holds 100-300 MB, and a bench sweep of a few dozen comparisons once wrote 40 GB
and filled the disk. So after each job and each judged pair the cache is trimmed to
DUIPAI_LOCALIZE_CACHE_GB gigabytes (default 4; 0 keeps only what the comparisons running now use; a
negative value never trims), the way ccache trims to CCACHE_MAXSIZE. A folder is in use while a pair
that named its run is not judged (the reference's jobs: until its comparison ends), or, for a folder
another process may be reading, while it was used less than GRACE_S ago. A job that was removed is
simply run again when a later comparison needs it.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

from .errors import BadInput

ENV_VAR = "DUIPAI_LOCALIZE_CACHE_GB"
DEFAULT_GB = 4.0
GRACE_S = 600.0      # a folder another process used this recently is left alone


def limit_bytes() -> int | None:
    """The cache limit in bytes from DUIPAI_LOCALIZE_CACHE_GB; None: never trim. A value that is not a
    number is bad input naming the variable (exit 2)."""
    text = os.environ.get(ENV_VAR, "").strip()
    if not text:
        return int(DEFAULT_GB * 1e9)
    try:
        gb = float(text)
    except ValueError:
        raise BadInput(f"{ENV_VAR}={text!r}: not a number of gigabytes") from None
    return None if gb < 0 else int(gb * 1e9)


def folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


class CacheBudget:
    """Tracks which job folders of one cache this process uses for which run, and trims the cache."""

    def __init__(self, jobs_dir: Path, log: Callable[[str], None], limit: int | None = None, grace_s: float = GRACE_S):
        self.dir = Path(jobs_dir)
        self.log = log
        self.limit = limit_bytes() if limit is None else limit
        self.grace_s = grace_s
        self._owner: dict[str, str] = {}      # folder name -> the run it was used for
        self._released: set[str] = set()      # runs whose pairs are judged
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._warned = False

    def used(self, folder: Path, run: str) -> None:
        """`folder` was just run or reused for `run`: pinned until `run` is released; its time of use is
        its modification time (so that another process sees it recently used)."""
        with self._lock:
            self._owner[folder.name] = run
            self._released.discard(run)
            self._sizes.pop(folder.name, None)   # a job run again may have another size
        try:
            os.utime(folder)
        except OSError:
            pass
        self.trim()

    def release(self, run: str) -> None:
        """Every pair that needs `run`'s jobs is judged: they may go (least recently used first)."""
        with self._lock:
            self._released.add(run)
        self.trim()

    def release_all(self) -> None:
        with self._lock:
            self._released.update(self._owner.values())
        self.trim()

    def _pinned(self, name: str, mtime: float, now: float) -> bool:
        run = self._owner.get(name)
        if run is not None:
            return run not in self._released
        return now - mtime < self.grace_s

    def trim(self) -> list[str]:
        """Remove least recently used folders that are not pinned until the cache is within the limit;
        returns the names removed."""
        if self.limit is None or not self.dir.is_dir():
            return []
        with self._lock:
            now = time.time()
            entries = []
            for e in os.scandir(self.dir):
                if e.name.startswith(".") or not e.is_dir(follow_symlinks=False):
                    continue
                size = self._sizes.get(e.name)
                if size is None:
                    size = self._sizes[e.name] = folder_bytes(Path(e.path))
                entries.append((e.stat(follow_symlinks=False).st_mtime, e.name, size))
            total = sum(s for _, _, s in entries)
            if total <= self.limit:
                return []
            removed, freed = [], 0
            for mtime, name, size in sorted(entries):
                if total - freed <= self.limit:
                    break
                if self._pinned(name, mtime, now):
                    continue
                self._remove(name)
                removed.append(name)
                freed += size
            if removed:
                self.log(f"localize: cache {total / 1e9:.1f} GB over its {self.limit / 1e9:g} GB limit ({ENV_VAR}): "
                         f"removed {len(removed)} job folder(s), {freed / 1e9:.1f} GB, least recently used first")
            if total - freed > self.limit and not self._warned:
                self._warned = True
                self.log(f"localize: cache {(total - freed) / 1e9:.1f} GB, over its {self.limit / 1e9:g} GB limit "
                         f"({ENV_VAR}) with jobs the comparisons running now still need; trimmed as pairs finish")
            return removed

    def _remove(self, name: str) -> None:
        """Renamed out of the cache first (atomic: a reader finds the job whole or not at all), then deleted."""
        src = self.dir / name
        trash = self.dir / f".evicted-{uuid.uuid4().hex[:8]}"
        try:
            os.replace(src, trash)
        except OSError:
            return
        shutil.rmtree(trash, ignore_errors=True)
        self._sizes.pop(name, None)
        self._owner.pop(name, None)
