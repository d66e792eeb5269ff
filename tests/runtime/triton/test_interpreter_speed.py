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
