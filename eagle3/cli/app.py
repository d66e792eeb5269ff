"""The Typer application every command module registers on, the global ``--debug`` flag, and the
help layout of every command.

Help is click's plain layout, not rich's table: rich cuts option names that do not fit its column
(``--num-speculative-…`` in an 80-column terminal). Ours writes an option name whole on its own
line when it is long, groups options by their panel (``rich_help_panel``: the engine's flags under
their own heading), and wraps text at spaces only, so that a flag named in a help text is never
split at its hyphens; a paragraph opened by ``\\b`` (click's marker) keeps its lines, such as the
examples, each wrapped with a hanging indent. Nothing is cut at any width.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterable, Sequence
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

# Typer's own click classes (it carries its own copy of click): derived from, never named.
_BaseContext: Any = TyperCommand.context_class
_BaseFormatter: Any = _BaseContext.formatter_class
_HANG = "    "  # continuation indent of a wrapped example line


def _wrap(text: str, width: int, indent: str, hang: str = "") -> list[str]:
    return textwrap.wrap(text, max(width, 20), initial_indent=indent, subsequent_indent=indent + hang,
                         break_on_hyphens=False, break_long_words=False) or [indent.rstrip()]


class HelpFormatter(_BaseFormatter):
    """click's formatter, wrapping at spaces only (see the module docstring)."""

    def write_text(self, text: str) -> None:
        indent = " " * self.current_indent
        paragraphs = [p for p in textwrap.dedent(text).split("\n\n") if p.strip()]
        for i, par in enumerate(paragraphs):
            if i:
                self.write("\n")
            if par.startswith("\b"):  # kept as lines (examples): each wrapped with a hanging indent
                for line in par[1:].strip("\n").splitlines():
                    self.write("\n".join(_wrap(line, self.width, indent, _HANG)) + "\n")
            else:
                self.write("\n".join(_wrap(" ".join(par.split()), self.width, indent)) + "\n")

    def write_dl(self, rows: Sequence[tuple[str, str]], col_max: int = 30, col_spacing: int = 2) -> None:
        rows = list(rows)
        first = min(max((len(term) for term, _ in rows), default=0), col_max) + col_spacing
        indent = " " * self.current_indent
        text_width = self.width - self.current_indent - first
        for term, help_text in rows:
            lines = textwrap.wrap(help_text or "", max(text_width, 20), break_on_hyphens=False,
                                  break_long_words=False)
            if len(term) <= first - col_spacing:
                self.write((indent + term.ljust(first) + (lines[0] if lines else "")).rstrip() + "\n")
                lines = lines[1:]
            else:  # a long option name: whole, on its own line, its help below
                self.write(indent + term + "\n")
            for line in lines:
                self.write(indent + " " * first + line + "\n")


class _Context(_BaseContext):
    formatter_class = HelpFormatter


def _format_options(command: Any, ctx: Any, formatter: Any) -> None:
    """Arguments, then the options grouped by panel (``Options`` first, then each panel in order)."""
    args: list[tuple[str, str]] = []
    panels: dict[str, list[tuple[str, str]]] = {"Options": []}
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        if param.param_type_name == "argument":
            args.append(record)
        else:
            panels.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
    sections: Iterable[tuple[str, list[tuple[str, str]]]] = [("Arguments", args), *panels.items()]
    for title, rows in sections:
        if rows:
            with formatter.section(title):
                formatter.write_dl(rows)


class Command(TyperCommand):
    """Every eagle3 command: the help layout above."""

    context_class = _Context

    def format_options(self, ctx: Any, formatter: Any) -> None:
        _format_options(self, ctx, formatter)


class Group(TyperGroup):
    context_class = _Context

    def format_options(self, ctx: Any, formatter: Any) -> None:
        _format_options(self, ctx, formatter)
        self.format_commands(ctx, formatter)


app = typer.Typer(
    name="eagle3",
    cls=Group,
    help="EAGLE-3 speculative decoding for Kimi-K2.5: download, inspect, convert, quantize, serve.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's layout with HelpFormatter (rich cuts long option names)
    context_settings={"help_option_names": ["-h", "--help"]},
)

_state = {"debug": False}


def use_help_layout(typer_app: Any) -> None:
    """Give every registered command the help layout (called once they are all registered)."""
    for info in typer_app.registered_commands:
        if info.cls in (None, TyperCommand):
            info.cls = Command


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks instead of one-line errors.")] = False,
) -> None:
    _state["debug"] = debug


def print_json(obj: object) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
