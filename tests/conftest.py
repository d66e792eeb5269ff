"""Shared pytest fixtures.

``tiny_dir``: the tiny synthetic checkpoints of :mod:`eagle3.testing.tiny`, written once per test
session (about a second) into a temporary directory. Layout: ``tiny_dir / <name>`` for every name in
``eagle3.testing.tiny.MODEL_NAMES`` (kimi-k2.5, kimi-k2-thinking, kimi-k2.5-eagle3,
kimi-k2.5-eagle3-d2t, kimi-k2.6-eagle3.1-mla, speculators-eagle3). Treat it as read-only: it is
shared by every test of the session; copy a sub-directory first if a test must change it.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

# `make test` runs one xdist worker per core. The tiny models' GEMMs are far too small for intra-op
# parallelism: a second torch thread only spins (measured 0.3 ms -> 13 ms per tile on 2 busy cores).
# One thread per worker, and the same for CLI subprocesses the tests start (they inherit the env).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    import torch

    from tests import quark_speed

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    quark_speed.install()  # before any test imports Quark
    _cli_runner_builds_the_command_once()


def _cli_runner_builds_the_command_once() -> None:
    """typer's ``CliRunner().invoke(app, ...)`` builds the click command tree from every command's
    signature on each call (~0.03 CPU-s; the convert tests alone invoke it over a hundred times).
    ``eagle3.cli.main``, what users run, builds it once per process (``eagle3.cli._command``): the
    tests' runners get that same command."""
    import typer.testing

    from eagle3.cli import _command, app

    build = typer.testing._get_command
    typer.testing._get_command = lambda typer_app: _command() if typer_app is app else build(typer_app)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything alive now (torch's, transformers' and triton's module objects, the collected
    items) lives as long as the worker: frozen, the cyclic garbage collector's full passes stop
    rescanning it. Those passes were a third less CPU (2.8 -> 1.9 s over an interpreted Triton
    file and test_reference.py, -n 0)."""
    gc.freeze()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from eagle3.testing.tiny import make_tiny

    out = tmp_path_factory.mktemp("tiny") / "tiny"
    make_tiny(out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dir: Path) -> object:
    """The tiny Kimi-K2.5 target's fast tokenizer (vocab 1024, Kimi-style special ids)."""
    from tests.serve.fakes import load_tiny_tokenizer

    return load_tiny_tokenizer(tiny_dir)


@pytest.fixture(scope="session")
def trained_pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``kimi-k2.5-trained`` and its trained EAGLE-3 draft (``kimi-k2.5-trained-eagle3``), written
    once per session: a target whose drafts are accepted, so speculative steps really verify drafts
    (the random tiny pair's are almost never accepted)."""
    from eagle3.testing import tiny, trained

    out = tmp_path_factory.mktemp("trained") / "tiny"
    tiny.make_tiny(out, only=[trained.NAME, f"{trained.NAME}-eagle3"])
    return out
