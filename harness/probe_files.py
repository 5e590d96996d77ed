"""Probes read from their .npz files only when asked for: a 32x32x3 graph model's probe is ~100 MB, and a
resync's replays hold tens of them (harness.probe_jobs)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from algorithms.params import load_npz


class ReplayProbes:
    """The probes of a replay's points, read from their files one point at a time while iterated: a
    32x32x3 graph model's probe is ~100 MB, and a resync of 12 points with its float64, nudged and
    emulating replays is tens of them (held at once, one compare needed 15 GB). Iterating yields
    (step, candidate, reference compared against, its float64 probe or None, plain reference or None);
    an entry given as probes already in memory is yielded as it is."""

    def __init__(self, points: list[tuple[int, tuple[Path | dict[str, np.ndarray] | None, ...]]]):
        self._points = points

    def __iter__(self):
        for t, files in self._points:
            yield (t, *(load_npz(f) if isinstance(f, Path) else f for f in files))

    def __len__(self) -> int:
        return len(self._points)

    def restricted(self, at: list[int]) -> "ReplayProbes":
        return ReplayProbes([pt for pt in self._points if pt[0] in at])


class LazyProbeMap:
    """step -> probes (or a list of probes), each read from its file(s) when asked for, never kept."""

    def __init__(self, files: dict[int, Path | list[Path]]):
        self._files = files

    def get(self, t: int, default: Any = None) -> Any:
        f = self._files.get(t)
        if f is None:
            return default
        return [load_npz(x) for x in f] if isinstance(f, list) else load_npz(f)

    def __bool__(self) -> bool:
        return bool(self._files)

    def extended(self, more: dict[int, list[Path]]) -> "LazyProbeMap":
        """This map with more files per step (lists joined)."""
        out = {t: list(f) if isinstance(f, list) else [f] for t, f in self._files.items()}
        for t, fs in more.items():
            out.setdefault(t, []).extend(fs)
        return LazyProbeMap(out)


__all__ = ["LazyProbeMap", "ReplayProbes"]
