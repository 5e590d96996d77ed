"""The `duipai` command line: the click group, assembled from the command modules in
harness/commands/, and the console entry. Every command: clear one-line errors, exit 2 for bad input."""
from __future__ import annotations

import errno
import os
import signal
import sys

import click

from .commands.check import baseline_group, check_cmd
from .commands.common import fail
from .commands.compare import compare_cmd
from .commands.info import backends, faults, models
from .commands.matrix import all_cmd, matrix_cmd
from .commands.report import report_cmd
from .commands.run import probe, run
from .commands.selftest import selftest_cmd
from .errors import EXIT_CRASH, EXIT_OK
from .worker_pool import interrupt


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main() -> None:
    """duipai (对拍): differential testing of one CNN spec trained by several deep-learning frameworks.

    \b
    Typical use:
      duipai all                         every installed backend on the default model and data
      duipai run -m cnn2d_hard -b B      one run of backend B; results/<name>/{steps.csv,eval.csv,run.log,manifest.json}
      duipai probe -b B                  step-0 forward/gradient/update probe vs the reference
      duipai models --show cnn2d_hard    the layers and inferred shapes of a model
    """


for _command in (run, probe, models, backends, faults, all_cmd, matrix_cmd, report_cmd, compare_cmd, selftest_cmd,
                 check_cmd, baseline_group):
    main.add_command(_command)


def one_blas_thread() -> None:
    """The harness's own NumPy work is vectors of 10^3-10^5 floats (projections, norms, envelopes): a BLAS
    pool of one thread per core gains nothing there and, beside the backend processes that keep every core
    busy, made each dot product wait for threads to be scheduled (0.49 ms against 12.3 ms for a 32k-element
    projection on a busy 2-core machine; docs/measurements.md). Backend processes set their own thread
    counts (wrappers.__main__.set_backend_env)."""
    from threadpoolctl import threadpool_limits
    threadpool_limits(limits=1)


# what ends a command cleanly (exit 128 + the signal, as a shell says): Ctrl-C, a CI job cancelled, the terminal closed
STOP_SIGNALS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated", signal.SIGHUP: "hung up"}
_SIGNALLED: list[int] = []


def _stop(signum: int, _frame: object) -> None:
    """Ctrl-C, SIGTERM or SIGHUP: the backend processes (each in a process group of its own, out of the terminal's
    reach) are killed and no new job starts, so the command ends within seconds, not when its queued runs are
    done; runs already published stay and are reused by the same command again. A second signal ends at once."""
    if _SIGNALLED:
        os._exit(128 + signum)
    _SIGNALLED.append(signum)
    interrupt()
    raise KeyboardInterrupt


def entry() -> None:
    """Console entry: usage errors become one line (`duipai: error: ...`) and exit code 2; an interrupt is one
    line and exit code 128 + the signal (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP)."""
    one_blas_thread()
    before = {sig: signal.signal(sig, _stop) for sig in STOP_SIGNALS}
    try:
        _main()
    finally:   # called in-process (tests, harness.testing): the caller's handlers again
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _main() -> None:
    try:
        main.main(standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as e:
        click.echo(e.ctx.get_help() if e.ctx else str(e))
        sys.exit(EXIT_OK)
    except click.UsageError as e:
        cmd = e.ctx.command_path if e.ctx else "duipai"
        fail(f"{e.format_message()} (see `{cmd.replace('python -m harness.cli', 'duipai')} --help`)")
    except (click.Abort, KeyboardInterrupt):
        signum = _SIGNALLED[0] if _SIGNALLED else signal.SIGINT
        click.echo(f"duipai: {STOP_SIGNALS[signum]}: what finished is kept (runs, probe and replay jobs) and the "
                   "same command again reuses it", err=True)
        sys.exit(128 + signum)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # a full disk is the machine's, not a bug to trace: one line (runs and jobs that finished are kept, and
        # the same command again reuses them)
        fail(f"no space left on the device{f' writing {e.filename}' if e.filename else ''}: free some space and run "
             f"the same command again (the runs and jobs that finished are reused)", EXIT_CRASH)


if __name__ == "__main__":
    entry()
