"""Command line: the commands (:mod:`hybridkv_cli.commands`, one module each) on one app, and every
error mapped to one line and an exit code."""

from __future__ import annotations

import functools
import os
import sys

import typer

from hybridkv_cli.commands.ask import ask
from hybridkv_cli.commands.bench import bench
from hybridkv_cli.commands.calibrate import calibrate
from hybridkv_cli.commands.compress import compress
from hybridkv_cli.commands.model_step import model_step
from hybridkv_cli.commands.options import ASK_HELP, BENCH_HELP, COMPRESS_HELP
from hybridkv_cli.commands.profile import profile
from hybridkv_cli.commands.route import route
from hybridkv_cli.commands.serve import SERVE_HELP, serve
from hybridkv_cli.io.console import err, one_line_warnings, print_error, quiet_libraries
from hybridkv_cli.io.errors import HybridKVError, one_line
from hybridkv_cli.io.signals import describe, exit_code, leave, signal_of, stop_on_signals

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Answer questions about videos and image sets with Qwen2.5-VL under a KV-cache budget.")


def _stoppable(command):
    """A command that ends a Ctrl-C, SIGTERM or SIGHUP itself, with its line and exit code (typer
    would turn it into exit 130 and no line)."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt as e:
            return _stopped(e)

    return run


app.command(help=ASK_HELP)(_stoppable(ask))
app.command()(_stoppable(profile))
app.command(help=BENCH_HELP)(_stoppable(bench))
app.command(help=COMPRESS_HELP)(_stoppable(compress))
app.command()(_stoppable(route))
app.command()(_stoppable(calibrate))
app.command(name="model-step")(model_step)
app.command(help=SERVE_HELP)(_stoppable(serve))


@app.command()
def methods():
    """List the compression methods."""
    from hybridkv_cli.compression import METHODS

    for name, cls in sorted(METHODS.items()):
        print(f"{name:14s} {(cls.__doc__ or '').strip().splitlines()[0]}")


def run(argv: list[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default: sys.argv) and return the exit status: 0 ok, 1 runtime
    failure, 2 usage error, 130 interrupted (143 SIGTERM, 129 SIGHUP). Every error is one line on
    stderr (``--debug``: the traceback); libraries' warnings and log lines only show with ``--debug``."""
    try:  # typer >= 0.25 runs on a vendored click: its exceptions are not `click`'s
        from typer import _click as click
    except ImportError:  # pragma: no cover - older typer on the real click
        import click

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)  # known before typer parses: libraries log early
    with one_line_warnings(), quiet_libraries(debug), stop_on_signals():
        try:
            code = app(args=argv, prog_name="hybridkv", standalone_mode=False)
        except HybridKVError as e:
            if debug:
                raise
            print_error(str(e))
            return e.exit_code
        except (KeyboardInterrupt, typer.Abort) as e:
            return _stopped(e)
        except click.exceptions.NoArgsIsHelpError as e:
            e.show()
            return 2
        except click.exceptions.UsageError as e:
            where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            print_error(one_line(e.format_message(), limit=None) + where)
            return e.exit_code
        except click.exceptions.ClickException as e:
            print_error(one_line(e.format_message(), limit=None))
            return e.exit_code
        except BrokenPipeError:  # stdout closed early (e.g. `| head -1`): stop quietly
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):
                pass
            return 1
        except Exception as e:  # anything unexpected: still one line unless --debug
            if debug:
                raise
            print_error(f"{type(e).__name__}: {one_line(e, limit=None)} (run with --debug for the traceback)")
            return 1
    return code if isinstance(code, int) else 0


def _stopped(e: BaseException) -> int:
    """Ctrl-C, SIGTERM or SIGHUP outside a batch: one line, exit 128 + the signal number."""
    signum = signal_of(e)
    err.print(describe(signum), highlight=False)
    return exit_code(signum)


def main() -> None:
    """Console entry point (a stopped run leaves at once: :func:`hybridkv_cli.io.signals.leave`)."""
    leave(run())


if __name__ == "__main__":
    main()
