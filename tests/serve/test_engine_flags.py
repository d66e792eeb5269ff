"""The engine's flags are declared once, on EngineConfig's fields, and generated onto the commands that
run the bundled engine; ``--num-speculative-tokens`` reaches the proposer through that one config.

Which commands carry engine flags: ``serve`` (serving, ``--validate``: the engine side of a
validation, and the ``--engine`` hand-off, which maps the same config) and ``bench`` (TARGET: served
in-process). ``validate`` measures a server someone else started and carries none.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import typer.main

from eagle3.cli import app, main
from eagle3.cli.engine_flags import cli_default
from eagle3.runtime.engine.config import EngineConfig, engine_flags, flag_name

ENGINE_COMMANDS = ("serve", "bench")
NO_ENGINE_COMMANDS = ("validate",)
# EngineConfig fields that are Python-API only (each says why in engine/config.py); a new field
# must be one of these or carry a flag.
PYTHON_ONLY = {"tokenizer", "block_size", "num_blocks", "max_num_batched_tokens", "draft_sampling", "log_stats"}


def _commands() -> dict[str, object]:
    return typer.main.get_command(app).commands  # type: ignore[attr-defined,return-value]


def _help(cmd: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
          columns: int = 80) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    with pytest.raises(SystemExit) as e:
        main([*cmd, "--help"])
    assert not e.value.code
    return capsys.readouterr().out


def _engine_params(command: str) -> dict[str, tuple[object, str]]:
    """The command's engine options: name -> (default, help)."""
    names = {flag_name(f) for f, _ in engine_flags()}
    return {p.opts[0]: (p.default, p.help) for p in _commands()[command].params  # type: ignore[attr-defined]
            if p.opts and p.opts[0] in names}


def test_every_engine_config_field_is_a_flag_or_python_only() -> None:
    flagged = {f.name for f, _ in engine_flags()}
    assert flagged | PYTHON_ONLY == {f.name for f in dataclasses.fields(EngineConfig)}
    assert not flagged & PYTHON_ONLY


def test_serve_and_bench_list_the_same_engine_flags_with_engine_configs_defaults(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    want = {flag_name(f): (cli_default(f), flag.help) for f, flag in engine_flags()}
    assert want["--num-speculative-tokens"][0] == "3" and want["--kernel-backend"][0] == EngineConfig().backend
    for command in ENGINE_COMMANDS:
        assert _engine_params(command) == want, command
        out = _help([command], capsys, monkeypatch)
        # listed under their own heading, after the command's own options
        engine = out.split("\nEngine options (")[1]
        for name in want:
            assert re.search(rf"^  {re.escape(name)}[ /]", engine, re.M), (command, name)
    for command in NO_ENGINE_COMMANDS:  # an external server: no engine flag at all
        assert _engine_params(command) == {}, command
        assert "Engine options" not in _help([command], capsys, monkeypatch)


@pytest.mark.parametrize("columns", [80, 100])
def test_help_keeps_every_option_name_whole(columns: int, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """In a narrow terminal every option name of every command appears whole (rich cut them:
    ``--num-speculative-…``) and no line is wider than the terminal."""
    for name, command in [("", typer.main.get_command(app)), *_commands().items()]:
        out = _help([name] if name else [], capsys, monkeypatch, columns)
        wide = [line for line in out.splitlines() if len(line) > columns]
        assert not wide, (name, wide)
        for param in command.params:  # type: ignore[attr-defined]
            if getattr(param, "hidden", False):
                continue
            for opt in [*param.opts, *param.secondary_opts]:
                if opt.startswith("--"):
                    assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", out), (name, opt)


class _Built(Exception):
    """Stops bench right after it built the engine (the test looks at the engine, not the benchmark)."""


@pytest.mark.parametrize("extra", [[], ["--speculative-eagle-topk", "2"]])
def test_num_speculative_tokens_reaches_the_proposer_through_one_config(
        tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str]) -> None:
    from eagle3.serve import launcher

    built = []
    real = launcher.build_llm

    def build(target: Path, draft: Path, config: EngineConfig) -> object:
        built.append((config, real(target, draft, config)))
        raise _Built

    monkeypatch.setattr(launcher, "build_llm", build)
    with pytest.raises(_Built):
        main(["bench", str(tiny_dir / "kimi-k2.5"), "--draft", str(tiny_dir / "kimi-k2.5-eagle3"),
              "--num-speculative-tokens", "4", "--dtype", "float32", "--kv-cache-memory", "8MiB", *extra])
    config, llm = built[0]
    try:
        runner, scheduler = llm.runner, llm.scheduler
        proposer = runner.proposer
        holders = [llm, scheduler, runner, proposer] + ([proposer.tree] if extra else [])
        # one object from the flags to the proposer ...
        assert config.num_speculative_tokens == 4 and llm.config is config
        assert all(h.config is config for h in holders)
        # ... read where it is used, never copied under another name
        assert llm.k == scheduler.k == runner.k == 4
        copies = {"k", "num_speculative_tokens", "max_k", "steps", "num_steps_per_draft", "draft_sampling", "tree",
                  "topk", "num_nodes", "block_size", "max_num_seqs", "max_num_batched_tokens"}
        for h in holders:  # (the proposer's ``tree`` is its TreeDrafting, a holder itself)
            copied = {n for n, v in vars(h).items() if n in copies and isinstance(v, (int, str, tuple))}
            assert not copied, (type(h).__name__, copied)
        if extra:
            assert proposer.tree.steps == 4 and llm.tree == (2, 9)
    finally:
        launcher.close_llm(llm)


def test_no_constructor_takes_k_apart_from_the_config() -> None:
    """Below LLM, k, the tree and draft sampling come with the config, not as parameters."""
    from eagle3.runtime.engine.model_runner import ModelRunner
    from eagle3.runtime.engine.scheduler import Scheduler
    from eagle3.runtime.spec.proposer import EagleProposer
    from eagle3.runtime.spec.tree_proposer import TreeDrafting

    taken_apart = {"num_speculative_tokens", "k", "steps", "topk", "num_nodes", "draft_sampling",
                   "block_size", "max_num_seqs", "max_num_batched_tokens", "tree_slots"}
    for cls in (Scheduler, ModelRunner, EagleProposer, TreeDrafting):
        params = set(inspect.signature(cls).parameters)
        assert "config" in params and not params & taken_apart, (cls.__name__, params & taken_apart)
