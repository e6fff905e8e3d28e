"""Commands loaded on demand, and errors as one line.

Every gpuq command lives in a module that pulls in its service (asyncpg, NATS, FastAPI, the admission core, ...):
importing them all to print `gpuq --help` cost over a second per command. A `LazyGroup` names its commands with a
one-line summary and the `module:attribute` that defines them; it imports that module only when the command runs
or shows its own help. This module (and cli/main.py) must stay light: typer and the standard library only.

`GpuqGroup.main` also decides how a failure reads: a usage error or an unexpected exception is one line
(`error: ...`) on stderr with a non-zero exit code; `--debug` (or GPUQ_DEBUG=1) shows the traceback instead."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import typer
import typer.core
import typer.main
import typer.models
from typer import _click

DEBUG_ENV = "GPUQ_DEBUG"
TOOLS_PACKAGE = "gpuq_tools"  # the benchmarks and the chaos harness (`gpuq bench ...`, `gpuq chaos`)
TOOLS_HINT = ("The benchmarks and `gpuq chaos` are the gpuq_tools package, which the service image leaves out: run "
              "them where gpuq is installed from its source (`pip install .`).")


@dataclass(frozen=True)
class Lazy:
    """A command of a group: where it is defined (`module:attribute`, a function or a typer.Typer) and the summary
    `gpuq --help` lists it with (the start of its docstring; tests/unit/cli/test_lazy_commands.py checks so)."""

    target: str
    summary: str
    panel: str | None = None  # where `gpuq --help` lists it (typer's rich help panels)


class _Listed(typer.core.TyperCommand):
    """What a group's help lists for a command it has not loaded: its name and summary."""


class LazyGroup(typer.core.TyperGroup):
    """A typer group whose commands in LAZY are imported only when run or asked for their own help."""

    LAZY: ClassVar[dict[str, Lazy]] = {}

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self._listing = False

    def list_commands(self, ctx: _click.Context) -> list[str]:
        return [*self.LAZY, *(n for n in super().list_commands(ctx) if n not in self.LAZY)]

    def get_command(self, ctx: _click.Context, cmd_name: str) -> _click.Command | None:
        if cmd_name in self.commands or cmd_name not in self.LAZY:
            return super().get_command(ctx, cmd_name)
        lazy = self.LAZY[cmd_name]
        if self._listing:  # the group's own help: a summary is all it shows
            listed = _Listed(cmd_name, help=lazy.summary, short_help=lazy.summary)
            listed.rich_help_panel = lazy.panel  # read by typer's rich help
            return listed
        command = self.load(cmd_name, lazy, f"{ctx.command_path} {cmd_name}")
        self.commands[cmd_name] = command
        return command

    def format_help(self, ctx: _click.Context, formatter: _click.HelpFormatter) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False

    def resolve_command(self, ctx: _click.Context, args: list[str]) -> tuple[str | None, _click.Command | None,
                                                                               list[str]]:
        # typer suggests near names among the loaded commands only: offer it every name
        loaded = self.commands
        self.commands = {**{n: _Listed(n) for n in self.LAZY}, **loaded}
        try:
            name, _, rest = super().resolve_command(ctx, args)
        finally:
            self.commands = loaded
        if name:
            self.prepare(name)
        return name, self.get_command(ctx, name) if name else None, rest

    def prepare(self, name: str) -> None:
        """Before the command `name` is loaded and parses its options."""

    def load(self, name: str, lazy: Lazy, path: str) -> _click.Command:
        """The command `name` (`path`: as typed, e.g. `gpuq bench placement`), its module imported now."""
        module, _, attribute = lazy.target.partition(":")
        try:
            loaded = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            # The command's own package is absent (the service image leaves out gpuq_tools): say which command
            # needs what, rather than a bare "No module named". A module missing further down is a real error.
            if exc.name is None or not (module == exc.name or module.startswith(exc.name + ".")):
                raise
            hint = f" {TOOLS_HINT}" if exc.name.partition(".")[0] == TOOLS_PACKAGE else ""
            raise _click.ClickException(f"`{path}` is not installed here (no module {exc.name!r}).{hint}") from None
        target = getattr(loaded, attribute)
        if isinstance(target, typer.Typer):
            command = typer.main.get_command(target)
            command.name = name
            return command
        return typer.main.get_command_from_info(
            typer.models.CommandInfo(name=name, callback=target), pretty_exceptions_short=True,
            rich_markup_mode=self.rich_markup_mode)


def debug_wanted() -> bool:
    return os.environ.get(DEBUG_ENV, "").lower() in ("1", "true", "yes", "on")


def one_line(exc: BaseException) -> str:
    """An exception as one readable line: a pydantic ValidationError names each field and what is wrong with it."""
    from cli.errors import describe

    return describe(exc)


class GpuqGroup(LazyGroup):
    """The root group: also turns every failure into one line and a non-zero exit code (unless --debug)."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, windows_expand_args: bool = True,
             **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        # --debug is global, wherever it is written (before a `--`): taken out here
        end = argv.index("--") if "--" in argv else len(argv)
        debug = "--debug" in argv[:end] or debug_wanted()
        argv = [a for a in argv[:end] if a != "--debug"] + argv[end:]
        if not standalone_mode:
            return super().main(argv, prog_name, complete_var, standalone_mode, windows_expand_args, **extra)
        try:
            code = super().main(argv, prog_name, complete_var, False, windows_expand_args, **extra)
        except _click.exceptions.NoArgsIsHelpError as exc:
            message = exc.format_message()  # the help (typer's rich help printed it already: empty then)
            if message.strip():
                _click.echo(message, err=True)
            sys.exit(exc.exit_code)
        except _click.exceptions.ClickException as exc:
            ctx = getattr(exc, "ctx", None)  # usage errors and bad parameters carry the command's context
            where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            _click.echo(f"error: {exc.format_message()}{where}", err=True)
            sys.exit(exc.exit_code)
        except typer.Abort:
            _click.echo("aborted", err=True)
            sys.exit(1)
        except Exception as exc:
            if debug:
                raise
            _click.echo(f"error: {one_line(exc)} (--debug shows the traceback)", err=True)
            sys.exit(1)
        # typer.Exit comes back as its code; a command's return value (None) means success
        sys.exit(code if isinstance(code, int) else 0)
