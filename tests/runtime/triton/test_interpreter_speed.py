"""The shape caches of interpreter_speed.py build what the interpreter builds: a block type or
tensor made through them has the original constructors' shape, numel, name and dtype, a shape
object of its own, and a bad shape still raises. (conftest.py installs the shims for the session
under the interpreter; ``__wrapped__`` is the original constructor.)"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("triton")

from triton.language import core  # noqa: E402

from tests.runtime.triton import interpreter_speed  # noqa: E402

SHAPES = [[16], [16, 32], core.tuple([4, 8, 2]), [core.constexpr(16), 8]]
ELEMENTS = [core.float32, core.pointer_type(core.int8), core.pointer_type(core.int8, const=True)]


def _fields() -> list[tuple[Any, ...]]:
    out = []
    for shape in SHAPES:
        for element in ELEMENTS:
            for _ in range(2):  # a shape's second use is the cached one
                b = core.block_type(element, shape)
                t = core.tensor(None, b)
                out.append((b.element_ty, list(b.shape), str(b.shape.type), b.numel, b.name, str(t.shape),
                            t.numel.value, t.dtype, t.type is b))
    return out


def test_cached_shapes_equal_the_interpreters() -> None:
    with pytest.MonkeyPatch.context() as mp:
        interpreter_speed._cache_shapes(mp)  # on top of the session's, if any: still the same values
        cached = _fields()
        a, b = core.block_type(core.float32, [16, 32]), core.tensor(None, core.block_type(core.float32, [16, 32]))
        c = core.tensor(None, a)
        assert a.shape is not b.type.shape and b.shape is not c.shape
        with pytest.raises(ValueError, match="power of 2"):
            core.block_type(core.float32, [3])
        with pytest.raises(AssertionError):  # triton's block_type takes a list or tl.tuple only
            core.block_type(core.float32, (16, 32))
        for cls in (core.block_type, core.tensor):
            init = cls.__init__
            while hasattr(init, "__wrapped__"):
                init = init.__wrapped__
            mp.setattr(cls, "__init__", init)
        assert _fields() == cached


def _original(cls: type, name: str) -> Any:
    fn = getattr(cls, name)
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def test_skipped_overflow_checks_asserted_nothing() -> None:
    """Under the interpreter the original overflow check lets an int32 wrap through (its
    ``device_assert`` needs ``debug``), so skipping it gives the same bits; with ``debug`` on the
    shim still runs it and the wrap raises."""
    import dataclasses
    import os

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("the interpreter's overflow check (a compiled kernel's is the compiler's)")
    import torch
    import triton
    import triton.language as tl
    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter as ti
    from triton.runtime.errors import InterpreterError

    @triton.jit
    def wrap(x_ptr, out_ptr):  # type: ignore[no-untyped-def]
        i = tl.arange(0, 4)
        x = tl.load(x_ptr + i)
        tl.store(out_ptr + i, x * x)
        tl.store(out_ptr + 4 + i, x + x)
        tl.store(out_ptr + 8 + i, -x - x)

    x = torch.tensor([2**20, 3, 2**30, -5], dtype=torch.int32)
    want = torch.cat([x.long() * x.long(), 2 * x.long(), -2 * x.long()]).to(torch.int32)  # wrapped mod 2**32

    def run() -> torch.Tensor:
        out = torch.zeros(12, dtype=torch.int32)
        wrap[(1,)](x, out)
        return out

    with pytest.MonkeyPatch.context() as mp:
        interpreter_speed._skip_unasserted_overflow_checks(mp)  # the session's, if not installed
        assert torch.equal(run(), want)
        mp.setattr(ti.interpreter_builder, "options", dataclasses.replace(ti.interpreter_builder.options, debug=True))
        with pytest.raises(InterpreterError, match="int32 overflow detected for operation mul"):
            run()
        mp.setattr(ti.interpreter_builder, "options", dataclasses.replace(ti.interpreter_builder.options, debug=False))
        mp.setattr(TritonSemantic, "binary_op_sanitize_overflow_impl",
                   _original(TritonSemantic, "binary_op_sanitize_overflow_impl"))
        assert torch.equal(run(), want)


def test_builtin_names_read_once_patch_what_getmembers_finds() -> None:
    """Each language module's and class's patching through the cached names sets the same
    attributes, in the same order, to wrappers of the same builtins as the original's."""
    from triton.runtime import interpreter as ti

    def patched(patch: Any, pkg: Any) -> list[tuple[Any, str, Any, Any]]:
        scope = ti._LangPatchScope()
        patch(pkg, ti.interpreter_builder, scope)
        out = [(obj, name, original, getattr(obj, name).__defaults__) for obj, name, original in scope._changes]
        scope.restore()
        return out

    with pytest.MonkeyPatch.context() as mp:
        interpreter_speed._cache_builtin_names(mp)
        cached, original = ti._patch_builtin, _original(ti, "_patch_builtin")
        found = 0
        for pkg in (ti.tl, ti.tl.core, ti.tl.tensor, ti.tl.math, ti.tl.core.tensor_descriptor_base):
            want = patched(original, pkg)
            assert patched(cached, pkg) == want
            found += len(want)
        # (after a launch's device function call core's builtins stay wrapped: the interpreter never
        # restores that scope, so the original finds few there then, and so do the cached names)
        assert found > 150
