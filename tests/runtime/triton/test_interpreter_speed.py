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


def test_int_shape_comparison_equals_the_originals() -> None:
    with pytest.MonkeyPatch.context() as mp:
        interpreter_speed._compare_int_shapes_directly(mp)
        fast, original = core.tuple.__eq__, _original(core.tuple, "__eq__")
        for a in ([16, 32], [16], [core.constexpr(16), 32]):
            for b in ([16, 32], [32, 16], [16], core.tuple([16, 32]), [core.constexpr(16), 32], [True, 32]):
                got, want = fast(core.tuple(a), b), original(core.tuple(a), b)
                assert type(got) is type(want) is core.constexpr and got.value == want.value, (a, b)


def _dtypes() -> list[Any]:
    return [core.int1, core.int8, core.int32, core.uint32, core.int64, core.float8e4nv, core.float16, core.bfloat16,
            core.float32, core.float64]


def _outcome(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except (TypeError, ValueError) as e:
        return type(e)


def test_memoized_computation_types_equal_the_originals() -> None:
    from triton.language.semantic import TritonSemantic

    with pytest.MonkeyPatch.context() as mp:
        interpreter_speed._memoize_computation_types(mp)
        memo, original = TritonSemantic.computation_type_impl, _original(TritonSemantic, "computation_type_impl")
        sem = TritonSemantic(None)
        for a in _dtypes():
            for b in _dtypes():
                for flags in ((False, False), (True, False), (False, True)):
                    for div in (False, True):
                        args = (a, flags[0], b, flags[1], div)
                        want = _outcome(original, sem, *args)
                        assert _outcome(memo, sem, *args) == want and _outcome(memo, sem, *args) == want, args


def _tensor(dtype: Any, shape: list[int], value: float = 1.5) -> Any:
    import numpy as np
    from triton.runtime import interpreter as ti

    np_dtype = ti._get_np_dtype(dtype)
    data = np.full(shape or [1], value).astype(np_dtype)
    return core.tensor(ti.TensorHandle(data, dtype), core.block_type(dtype, shape) if shape else dtype)


def _seen(pair: Any) -> list[tuple[str, Any]]:
    return [(str(t.type), t.handle.data.dtype.str, t.handle.data.shape, t.handle.data.tobytes()) for t in pair]


def test_matching_operands_and_splats_equal_the_originals() -> None:
    """Operands of one dtype and shape pass through the type checks and broadcasting as the
    original passes them (the same objects); every other pair, and a scalar splat to a block, gives
    tensors of the original's types and bits."""
    import os

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("the interpreter's builder")
    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter as ti

    sem = ti.interpreter_semantic
    with pytest.MonkeyPatch.context() as mp:
        interpreter_speed._pass_matching_operands_through(mp)
        fast, original = TritonSemantic.binary_op_type_checking_impl, _original(TritonSemantic,
                                                                                 "binary_op_type_checking_impl")
        bcast, bcast_original = TritonSemantic.broadcast_impl_value, _original(TritonSemantic, "broadcast_impl_value")
        f32, i32, f16 = core.float32, core.int32, core.float16
        pairs = [(_tensor(f32, [16, 8]), _tensor(f32, [16, 8])), (_tensor(i32, [4]), _tensor(i32, [4])),
                 (_tensor(f32, []), _tensor(f32, [])), (_tensor(f32, [16, 8]), _tensor(i32, [16, 8])),
                 (_tensor(f32, [16, 1]), _tensor(f32, [1, 8])), (_tensor(f32, [16, 8]), _tensor(f16, [])),
                 (_tensor(i32, []), _tensor(f32, [4, 2])), (_tensor(f16, [4]), _tensor(f16, [4])),
                 (_tensor(i32, [4]), 3), (2.5, _tensor(f16, [2, 4])), (_tensor(f32, [8]), _tensor(f32, [16]))]
        for lhs, rhs in pairs:
            for div in (False, True):
                got, want = _outcome(fast, sem, lhs, rhs, False, False, True, div), \
                    _outcome(original, sem, lhs, rhs, False, False, True, div)
                if isinstance(want, type):
                    assert got is want
                    continue
                assert _seen(got) == _seen(want), (lhs, rhs, div)
                if lhs is want[0] and rhs is want[1]:
                    assert got[0] is lhs and got[1] is rhs
            if not isinstance(lhs, float) and not isinstance(rhs, int):
                got, want = _outcome(bcast, sem, lhs, rhs), _outcome(bcast_original, sem, lhs, rhs)
                assert got is want if isinstance(want, type) else _seen(got) == _seen(want)


def test_memoized_device_functions_return_fresh_equal_results() -> None:
    import numpy as np

    calls = []

    def double(x: Any, k: Any) -> Any:
        calls.append(k)
        from triton.runtime import interpreter as ti

        return core.tensor(ti.TensorHandle(x.handle.data * 2, x.handle.dtype), core.block_type(x.dtype, [4]))

    memo = interpreter_speed._PureMemo(1 << 20)
    f = memo.wrap(double)
    x = _tensor(core.float32, [4], 1.5)
    first, second = f(x, core.constexpr(0.0)), f(_tensor(core.float32, [4], 1.5), 0.0)
    assert len(calls) == 1 and _seen([first]) == _seen([second]) and second.handle.data is not first.handle.data
    assert second.type is not first.type and second.shape is not first.shape
    second.handle.data[0] = 7.0  # a result of its own: the memo keeps its copy
    assert np.array_equal(f(x, 0.0).handle.data, first.handle.data) and len(calls) == 1
    f(x, -0.0)  # another key: -0.0 is not 0.0
    f(_tensor(core.float32, [4], 2.5), 0.0)
    assert len(calls) == 3
