"""The engine's flags on the command line, generated from :class:`EngineConfig`'s fields.

Which commands carry them: those that run the bundled engine, ``serve`` (serving, ``--validate``,
which is the engine side of a validation, and the ``--engine`` hand-off, which maps the same config
onto vLLM / SGLang / ATOM) and ``bench`` (with TARGET it serves in-process). ``validate`` measures a
server someone else started and carries none of them.

A command declares a parameter ``engine_flags: EngineFlags``; :func:`engine_options` replaces it by
one option per flag field of the config (name, type, default and help from the field's
``metadata["flag"]``, runtime/engine/config.py), and hands the command the values as given. The
command turns them into the one :class:`EngineConfig` (:meth:`EngineFlags.config`) at the point where
it needs it, so that its own flag checks keep their order.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable
from typing import Annotated, Any

import typer

from eagle3.errors import UsageError
from eagle3.runtime.engine.config import AUTO, EngineConfig, engine_flags, flag_name

ENGINE_PANEL = "Engine options (the bundled runtime; docs/architecture.md)"


def cli_default(f: dataclasses.Field[Any]) -> Any:
    """The default the command line shows and starts from."""
    flag = f.metadata["flag"]
    return flag.cli_default if flag.cli_default is not None else f.default


def flag_message(message: str) -> str:
    """An EngineConfig message in the flags' names: ``nnodes (--nnodes)`` and ``nnodes`` -> ``--nnodes``,
    ``node_rank=3`` -> ``--node-rank 3``, ``'auto'`` -> ``auto``."""
    for f, _ in engine_flags():
        name = flag_name(f)
        # a whole name only: not the tail of another field or flag (dtype in kv_cache_dtype, --kv-cache-dtype)
        word = rf"(?<![\w-]){f.name}"
        message = re.sub(rf"{word}=", name + " ", message)
        message = re.sub(rf"{word}(?![\w-])(?: \({re.escape(name)}\))?", name, message)
    return message.replace("'auto'", AUTO)


class EngineFlags:
    """The engine flags as the command line gave them (by field name, before parsing)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        self.torchrun_rank: int | None = None  # set by config(): this process is a torchrun rank > 0

    def value(self, name: str) -> Any:
        return self.values[name]

    def given(self, exclude: tuple[str, ...] = ()) -> list[str]:
        """The flags set to something other than their default, in declaration order."""
        return [flag_name(f) for f, _ in engine_flags()
                if f.name not in exclude and self.values[f.name] != cli_default(f)]

    def config(self, draft: object = None, *, serving: bool = True) -> EngineConfig:
        """The one EngineConfig of these flags: each parsed (a bad value: one line naming its flag),
        the rank layout taken from torchrun's environment when it started this process, and the
        whole checked by EngineConfig (its messages in the flags' names). ``serving=False`` (a
        config-only plan) does not ask a multi-node layout for node 0's address yet."""
        from eagle3.cli.options import node_layout

        values = {}
        for f, flag in engine_flags():
            raw = self.values[f.name]
            values[f.name] = flag.parse(raw) if flag.parse is not None and raw is not None else raw
        if values["num_speculative_tokens"] == AUTO and draft is None:
            raise UsageError("--num-speculative-tokens auto needs --draft (it chooses how many draft tokens to verify)")
        layout, self.torchrun_rank = node_layout(values["tensor_parallel_size"], values["nnodes"],
                                                 values["node_rank"], values["dist_init_addr"], values["device"])
        values.update(layout)
        try:
            config = EngineConfig(**values)
            if serving:
                config.check_address()
        except UsageError as err:
            raise UsageError(flag_message(str(err))) from None
        return config


def _option(f: dataclasses.Field[Any], panel: str) -> inspect.Parameter:
    flag = f.metadata["flag"]
    name = flag_name(f)
    decl = f"{name}/--no-{name[2:]}" if flag.type is bool else name
    info = typer.Option(decl, help=flag.help, rich_help_panel=panel)
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=cli_default(f),
                             annotation=Annotated[flag.type, info])


def engine_options(panel: str = ENGINE_PANEL) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator (under ``@app.command()``): the command's ``engine_flags: EngineFlags`` parameter
    becomes one option per engine flag, listed after the command's own options."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn, eval_str=True)
        if "engine_flags" not in sig.parameters:
            raise TypeError(f"{fn.__name__} needs a parameter engine_flags: EngineFlags")
        own = [p for p in sig.parameters.values() if p.name != "engine_flags"]
        clash = {p.name for p in own} & {f.name for f, _ in engine_flags()}
        if clash:
            raise TypeError(f"{fn.__name__}: parameters {sorted(clash)} are engine flags (declared in EngineConfig)")
        params = own + [_option(f, panel) for f, _ in engine_flags()]
        names = [f.name for f, _ in engine_flags()]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            values = {n: kwargs.pop(n) for n in names}
            return fn(**kwargs, engine_flags=EngineFlags(values))

        command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return wrap
