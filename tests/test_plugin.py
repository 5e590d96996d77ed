"""The plugin door: a throw-away backend package in a temporary folder, registered by its own entry point
(a .dist-info written by hand, put on PYTHONPATH of the child processes: nothing is installed into the
shared environment), seen by `python -m wrappers info`, run by `duipai run`, judged by `duipai compare`;
and broken plugins reported by name and skipped, the other backends unaffected."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from .conftest import INFO, ROOT, need

PLUGIN = "toy-numpy"
STEPS = 30

PACKAGE = '''\
"""A third-party backend: the numpy backend's computation under another name and distribution."""
from pathlib import Path

from wrappers.numpy import NumpyEntry


class ToyEntry(NumpyEntry):
    name = "toy-numpy"
    module = "duipai_toyplugin.backend"
    description = "a throw-away plugin (tests/test_plugin.py)"

    @classmethod
    def sources(cls):
        return super().sources() + [str(p) for p in sorted(Path(__file__).parent.glob("*.py"))]


def not_an_entry():
    return None
'''
BACKEND = '''\
from wrappers.numpy.backend import NumpyBackend


class ToyBackend(NumpyBackend):
    framework = "toy"


BACKEND = ToyBackend
'''


def write_plugin(root: Path, entry_points: str, dist: str = "duipai_toyplugin") -> Path:
    """The package and its .dist-info (METADATA + entry_points.txt) in `root`: what pip would install."""
    pkg = root / "duipai_toyplugin"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(PACKAGE)
    (pkg / "backend.py").write_text(BACKEND)
    info = root / f"{dist}-0.3.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: 0.3.1\n")
    (info / "entry_points.txt").write_text("[duipai.backends]\n" + textwrap.dedent(entry_points))
    return root


def env_with(path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), str(ROOT)])}


def info(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wrappers", "info"], capture_output=True, text=True, cwd=ROOT, env=env)


def duipai(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=600)


def test_without_it_nothing_refers_to_it():
    assert PLUGIN not in INFO
    assert INFO["numpy"]["origin"].startswith("built-in") and INFO["numpy"]["distribution"] == "duipai"


def test_a_plugin_is_listed_run_and_compared(tmp_path):
    need("torch")
    env = env_with(write_plugin(tmp_path / "site", f"{PLUGIN} = duipai_toyplugin:ToyEntry\n"))
    r = info(env)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert list(got)[-1] == PLUGIN and "torch" in got and "numpy" in got   # the built-ins first
    assert got[PLUGIN]["origin"] == "plugin"
    assert (got[PLUGIN]["distribution"], got[PLUGIN]["version"]) == ("duipai-toyplugin", "0.3.1")
    assert got[PLUGIN]["entry_point"] == "duipai_toyplugin:ToyEntry"
    assert any(s.endswith("duipai_toyplugin/backend.py") for s in got[PLUGIN]["sources"])
    out = tmp_path / "runs"
    for backend in (PLUGIN, "torch"):
        r = duipai(env, "run", "-b", backend, "--steps", str(STEPS), "--out", str(out))
        assert r.returncode == 0, r.stdout + r.stderr
    runs = sorted(out.glob(f"*__{PLUGIN}__*")) + sorted(out.glob("*__torch__momentum-constant__s0"))
    assert len(runs) == 2
    manifest = json.loads((runs[0] / "manifest.json").read_text())
    assert manifest["backend"] == PLUGIN
    r = duipai(env, "compare", *map(str, runs), "-k", "2", "--no-localize")
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(l for l in r.stdout.splitlines() if l.startswith(PLUGIN))
    assert line.split()[1] == "DRIFT", r.stdout


def test_broken_plugins_are_named_and_skipped(tmp_path):
    """An import error, an object that is not an Entry, a clash with a built-in's name, an entry point whose
    name is not its Entry's: each said on stderr by name; every built-in still there, still built-in."""
    env = env_with(write_plugin(tmp_path / "site", """\
        broken = duipai_toyplugin_missing.module:Entry
        notentry = duipai_toyplugin:not_an_entry
        torch = duipai_toyplugin:ToyEntry
        renamed = duipai_toyplugin:ToyEntry
        """))
    r = info(env)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert set(INFO) == set(got)                       # none of them registered, nothing lost
    assert got["torch"]["origin"] == INFO["torch"]["origin"] and got["torch"]["distribution"] == "duipai"
    err = r.stderr
    assert "'broken'" in err and "import failed: ModuleNotFoundError" in err
    assert "'notentry'" in err and "not a subclass of wrappers.base.Entry" in err
    assert "'torch'" in err and "name clash" in err
    assert "'renamed'" in err and "Entry's name is 'toy-numpy'" in err
    assert len([l for l in err.splitlines() if l.startswith("duipai: backend")]) == 4


def test_the_builtins_entry_points_in_pyproject(tmp_path):
    """pyproject.toml's entry points as `pip install -e .` would write them (a duipai .dist-info ahead of the
    installed one on PYTHONPATH): every built-in found through its entry point, none imported directly, in the
    registry's order. Without them (an install that predates them) the built-ins are imported directly."""
    import tomllib
    from wrappers.registry import BUILTINS
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["duipai.backends"]
    assert eps == BUILTINS
    info_dir = tmp_path / "site" / "duipai-0.1.0.dist-info"
    info_dir.mkdir(parents=True)
    (info_dir / "METADATA").write_text("Metadata-Version: 2.1\nName: duipai\nVersion: 0.1.0\n")
    (info_dir / "entry_points.txt").write_text("[duipai.backends]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    r = info(env_with(tmp_path / "site"))
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    got = json.loads(r.stdout)
    assert list(got) == list(BUILTINS)
    assert all(got[n]["origin"] == "built-in" and got[n]["entry_point"] == eps[n] for n in got)
    direct = [n for n, i in INFO.items() if "imported directly" in i["origin"]]
    assert direct in ([], list(BUILTINS))              # all through entry points, or none (an older install)
