"""Every backend configuration, found through the `duipai.backends` entry points; no framework imported.

A backend is an `Entry` subclass named by an entry point of the group `duipai.backends`
(`name = "package.module:EntryClass"`, the entry point's name = `Entry.name`). The built-in backends are
registered the same way in this project's pyproject.toml. An installation made before those entry points
existed (an old editable install) has none: the built-ins missing from the entry points are then imported
directly (`origin` says so) until `pip install -e .` is rerun.

A broken plugin (its import fails, it is not an Entry subclass, its name clashes with another backend's)
is reported on stderr by name and skipped; the other backends are unaffected.
"""
from __future__ import annotations

import importlib
import importlib.metadata as md
import sys
from typing import Any

from .base import REGISTRY, Entry

GROUP = "duipai.backends"
PROJECT = "duipai"
# the built-ins, in the order the registry lists them (the same values as pyproject.toml's entry points)
BUILTINS: dict[str, str] = {
    "torch": "wrappers.torch:TorchEntry",
    "jax": "wrappers.jax:JaxEntry",
    "tensorflow": "wrappers.tensorflow:TensorflowEntry",
    "keras-tensorflow": "wrappers.keras:KerasTensorflowEntry",
    "keras-jax": "wrappers.keras:KerasJaxEntry",
    "keras-torch": "wrappers.keras:KerasTorchEntry",
    "numpy": "wrappers.numpy:NumpyEntry",
}
# name -> where the backend comes from: origin (built-in | plugin), distribution, version, entry_point
ORIGINS: dict[str, dict[str, str]] = {}
# what was skipped, one line each (also printed on stderr)
PROBLEMS: list[str] = []


def _project_version() -> str:
    try:
        return md.version(PROJECT)
    except md.PackageNotFoundError:
        return "unknown (not installed)"


def _resolve(value: str) -> Any:
    module, _, attr = value.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


def _problem(msg: str) -> None:
    PROBLEMS.append(msg)
    print(f"duipai: {msg}", file=sys.stderr)


def _accept(name: str, value: str, origin: dict[str, str], found: dict[str, type[Entry]]) -> None:
    """Load one entry point's object and keep it if it is a usable Entry; otherwise say why, by name."""
    who = f"backend {name!r} ({value}, from {origin['distribution']})"
    if name in found:
        _problem(f"{who}: name clash with the backend {name!r} from {ORIGINS[name]['distribution']} "
                 f"({ORIGINS[name]['entry_point']}); skipped")
        return
    try:
        obj = _resolve(value)
    except Exception as e:  # noqa: BLE001 - any failure of a plugin's import is that plugin's, not ours
        _problem(f"{who}: import failed: {type(e).__name__}: {e}; skipped")
        return
    if not (isinstance(obj, type) and issubclass(obj, Entry)):
        _problem(f"{who}: {obj!r} is not a subclass of wrappers.base.Entry; skipped")
        return
    if obj.name != name:
        _problem(f"{who}: the entry point is named {name!r} but the Entry's name is {obj.name!r}; skipped")
        return
    found[name] = obj
    ORIGINS[name] = {**origin, "entry_point": value}


def discover() -> dict[str, type[Entry]]:
    """The registry: built-ins first (in BUILTINS order), then plugins by name. Rebuilds REGISTRY in place."""
    found: dict[str, type[Entry]] = {}
    ORIGINS.clear()
    PROBLEMS.clear()
    try:
        eps = sorted(md.entry_points(group=GROUP), key=lambda ep: ep.name)
    except Exception as e:  # noqa: BLE001 - a malformed .dist-info somewhere on sys.path: keep the built-ins
        _problem(f"the entry points of group {GROUP} could not be read ({type(e).__name__}: {e}); built-ins only")
        eps = []
    ours = [ep for ep in eps if ep.dist is not None and ep.dist.name.lower() == PROJECT]
    ours.sort(key=lambda ep: list(BUILTINS).index(ep.name) if ep.name in BUILTINS else len(BUILTINS))
    for ep in ours:
        _accept(ep.name, ep.value, {"origin": "built-in", "distribution": ep.dist.name, "version": ep.dist.version}, found)
    for name, value in BUILTINS.items():   # an install that predates the entry points: import them directly
        if name not in found:
            _accept(name, value, {"origin": "built-in (imported directly: entry point not installed, rerun "
                                            "pip install -e .)", "distribution": PROJECT,
                                  "version": _project_version()}, found)
    for ep in eps:                         # third-party plugins, after every built-in: a clash is theirs
        if ep not in ours:
            _accept(ep.name, ep.value, {"origin": "plugin", "distribution": ep.dist.name if ep.dist else "?",
                                        "version": ep.dist.version if ep.dist else "unknown"}, found)
    order = [n for n in BUILTINS if n in found] + sorted(n for n in found if n not in BUILTINS)
    REGISTRY.clear()          # drops Entry subclasses that defined themselves without an entry point
    REGISTRY.update({n: found[n] for n in order})
    return REGISTRY


discover()

__all__ = ["REGISTRY", "ORIGINS", "PROBLEMS", "GROUP", "BUILTINS", "discover"]
