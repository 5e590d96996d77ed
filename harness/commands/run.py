"""`duipai run` and `duipai probe`: one backend on one configuration, in its own process."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

import click

from algorithms.contract import MANIFEST_FILE, RunConfig, probe_file_stem
from algorithms.faults import FAULTS, perturbation
from algorithms.optim import OPTIMIZERS, SCHEDULES, HParamError, HParams

from .. import runner
from ..defaults import REFERENCE
from ..errors import EXIT_BUG, EXIT_CRASH, EXIT_OK, BackendFailed, BadInput
from .common import SECONDS, Progress, fail

DEFAULT_OUT = Path("results")


def _check_fault(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None or value in FAULTS or perturbation(value) is not None:
        return value
    raise click.BadParameter(f"unknown fault {value!r}: not catalogued (`duipai faults`) nor a perturbation "
                             "<target>_<rel|abs>_<e>[_from_<step>] such as lr_rel_1e-06")


def config_options(f):
    """The options that define one run (shared by run and probe)."""
    opts = [
        click.option("--model", "-m", default="cnn2d_2conv_2fc", show_default=True,
                     help="Built-in model name (see `duipai models`) or a path to a .toml spec."),
        click.option("--backend", "-b", default=REFERENCE, show_default=True,
                     help="A backend name (`duipai backends` lists them)."),
        click.option("--steps", type=int, default=300, show_default=True, help="Training steps (global batches)."),
        click.option("--batch-size", type=int, default=64, show_default=True, help="Global batch size."),
        click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="momentum", show_default=True),
        click.option("--lr", type=float, default=0.05, show_default=True, help="Base learning rate."),
        click.option("--momentum", type=float, default=0.9, show_default=True),
        click.option("--weight-decay", type=float, default=0.0, show_default=True,
                     help="L2 (sgd/momentum/nesterov/adam) or decoupled (adamw)."),
        click.option("--schedule", type=click.Choice(SCHEDULES), default="constant", show_default=True),
        click.option("--seed", type=int, default=0, show_default=True, help="Data order and dropout masks."),
        click.option("--init-seed", type=int, default=0, show_default=True, help="Canonical initial weights."),
        click.option("--data", default="digits", show_default=True,
                     help="digits (at the model's shape: 8x8x1, or digits32 for a 32x32x3 model) | digits32 | "
                          "synthetic[:N] | train.csv[,test.csv] | file.npz"),
        click.option("--devices", type=int, default=1, show_default=True, help="Data-parallel replicas."),
        click.option("--threads", type=int, default=1, show_default=True, help="Intra-op threads (pinned)."),
        click.option("--fault", default=None, callback=_check_fault, metavar="FAULT",
                     help="Inject a catalogued bug into this backend (see `duipai faults`), or a perturbation "
                          "<target>_<rel|abs>_<e>[_from_<step>] (e.g. lr_rel_1e-06, bn_eps_abs_1e-05)."),
        click.option("--dropout", type=click.Choice(["harness", "native"]), default="harness", show_default=True,
                     help="harness: identical NumPy masks in every backend; native: the framework's RNG."),
        click.option("--dtype", type=click.Choice(["float32", "float64"]), default="float32", show_default=True),
        click.option("--no-jit", is_flag=True, help="Run the step eagerly (the framework's compilation off; capability eager)."),
        click.option("--hosts", type=int, default=1, show_default=True,
                     help="Local processes standing in for hosts (torchrun agents, TF workers, JAX processes)."),
        click.option("--sync-bn", is_flag=True, help="Synchronized BatchNorm across replicas, where the framework has it."),
        click.option("--port", type=int, default=0, help="Rendezvous port on 127.0.0.1 (default: a free one)."),
        click.option("--xla", is_flag=True, help="Compile the step with XLA (jit_compile=True; capability xla)."),
        click.option("--channels-last", is_flag=True, help="Channels-last memory format for the convolutions (capability channels_last)."),
        click.option("--onednn", type=click.Choice(["default", "on", "off"]), default="default",
                     help="TensorFlow's oneDNN kernels (TF_ENABLE_ONEDNN_OPTS)."),
        click.option("--perturb-ulp", type=int, default=None,
                     help="Move every initial weight by one ULP, signs drawn from this seed (envelope runs)."),
        click.option("--out", type=click.Path(path_type=Path), default=DEFAULT_OUT, show_default=True,
                     help="Results root folder."),
        click.option("--name", default=None, help="Result folder name (default: derived from the configuration)."),
        click.option("--timeout", type=SECONDS, default=None, help="Kill the backend after this many seconds."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def make_config(kw: dict[str, Any]) -> RunConfig:
    """The RunConfig of the options of config_options (bad hyper-parameters: exit 2)."""
    try:
        hp = HParams(optimizer=kw["optimizer"], lr=kw["lr"], momentum=kw["momentum"],
                     weight_decay=kw["weight_decay"], schedule=kw["schedule"], steps=kw["steps"],
                     batch_size=kw["batch_size"], seed=kw["seed"], init_seed=kw["init_seed"],
                     eval_every=min(50, kw["steps"]), checkpoint_every=min(50, kw["steps"]))
    except HParamError as e:
        fail(str(e))
    extra: dict[str, Any] = {}
    if kw["hosts"] != 1:
        extra["hosts"] = kw["hosts"]
    if kw["sync_bn"]:
        extra["sync_bn"] = True
    if kw["port"]:
        extra["port"] = kw["port"]
    if kw["xla"]:
        extra["xla"] = True
    if kw["channels_last"]:
        extra["channels_last"] = True
    if kw["onednn"] != "default":
        extra["onednn"] = kw["onednn"]
    return RunConfig(model=kw["model"], backend=kw["backend"], hparams=hp, data=kw["data"], threads=kw["threads"],
                     fault=kw["fault"], devices=kw["devices"], dropout=kw["dropout"], dtype=kw["dtype"],
                     jit=not kw["no_jit"], perturb_ulp=kw["perturb_ulp"], extra=extra)


def _said_replaced(replaced: dict[str, str]) -> Callable[[Path, Path, str], None]:
    """A run of another configuration under the same name is moved aside, never lost, and said (on stderr, and
    in `replaced` for --json)."""
    def say(folder: Path, kept: Path, why: str) -> None:
        replaced.update(kept=str(kept), differs=why)
        click.echo(f"duipai: warning: {folder} held a run of another configuration ({why}); it is kept in {kept}",
                   err=True)
    return say


@click.command()
@config_options
@click.option("--json", "as_json", is_flag=True, help="Print the result folder and manifest summary as JSON.")
def run(as_json: bool, **kw: Any) -> None:
    """Train one backend on one configuration, in its own process; write CSV, log and manifest."""
    cfg = make_config(kw)
    replaced: dict[str, str] = {}
    try:
        folder = runner.execute(cfg, kw["out"], kw["name"], timeout=kw["timeout"],
                                on_progress=Progress(f"{cfg.backend} {cfg.model}"), on_replace=_said_replaced(replaced))
    except BadInput as e:
        fail(str(e))
    except BackendFailed as e:
        fail(str(e), EXIT_CRASH)
    man = json.loads((folder / MANIFEST_FILE).read_text())
    if man.get("fault_inert"):
        click.echo(f"duipai: warning: --fault {cfg.fault} does not apply here: {man['fault_inert']}; "
                   "this run is not that bug", err=True)
    if as_json:
        click.echo(json.dumps({"folder": str(folder), "manifest": man, **({"replaced": replaced} if replaced else {})},
                              default=str))
    else:
        click.echo(f"{folder}  ({man['backend']}, {man['model']}, {cfg.hparams.steps} steps, {man['wall_s']:.1f} s)")


@click.command()
@config_options
@click.option("--probe-steps", type=int, default=3, show_default=True, help="Optimizer steps recorded.")
@click.option("--against", default=REFERENCE, show_default=True, help="Reference backend to compare with.")
@click.option("--json", "as_json", is_flag=True)
def probe(probe_steps: int, against: str, as_json: bool, **kw: Any) -> None:
    """Step-0 probes of BACKEND and a reference: forward per layer (training and inference mode),
    gradient per parameter, updates."""
    from .. import probes
    from algorithms.params import load_npz
    cfg = make_config(kw)
    ref_cfg = RunConfig(**{**cfg.__dict__, "backend": against, "fault": None})
    try:
        a = runner.execute(cfg, kw["out"], kw["name"], mode="probe", probe_steps=probe_steps, timeout=kw["timeout"])
        b = runner.execute(ref_cfg, kw["out"], None, mode="probe", probe_steps=probe_steps, timeout=kw["timeout"])
    except BadInput as e:
        fail(str(e))
    except BackendFailed as e:
        fail(str(e), EXIT_CRASH)
    diffs = probes.compare(load_npz(a / f"{probe_file_stem(0)}.npz"), load_npz(b / f"{probe_file_stem(0)}.npz"))
    bad = [d for d in diffs if not d.ok]
    if as_json:
        click.echo(json.dumps({"backend": cfg.backend, "against": against, "ok": not bad,
                               "diffs": [d.to_dict() for d in diffs]}))
    else:
        for d in diffs:
            flag = "ok " if d.ok else "BAD"
            click.echo(f"{flag} {d.key:<42} max|diff| {d.max_abs:9.3g}  rel {d.rel:9.3g}")
        first = probes.first_failure(diffs)
        click.echo(f"\n{cfg.backend} vs {against}: " + ("all probes agree" if not first else
                   f"first disagreement: {first.key} (rel {first.rel:.3g})"))
    sys.exit(EXIT_BUG if bad else EXIT_OK)
