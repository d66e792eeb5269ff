"""Four repeats the Triton interpreter makes per operation or launch, done once, and one check it
computes and never asserts, skipped (tests only: speed; what the kernels compute is unchanged).

Language patching once per launch. The interpreter (triton 3.9, ``triton/runtime/interpreter.py``)
swaps ``triton.language``'s builtins for interpreted ones (``_patch_lang``) when a kernel launch
starts and restores them when it ends.
It also calls ``_patch_lang`` on every call of a ``@triton.jit`` device function inside the
launch, where everything is patched already: each such call re-scans the language modules with
``inspect.getmembers`` and re-sets the same attributes. The decode kernels call small device
functions per tile, so in the end-to-end tests that was about 12 % of the interpreter's time
(7,846 patch passes for 1,300 launches in one measured test). Here a device function called inside
a launch skips the repeat; the launch's own patching and restoring are unchanged.

Numpy dtypes looked up, not rebuilt. ``_get_np_dtype`` builds its 18-entry table of numpy dtypes on
every call (once per interpreted operation: 213,048 calls, 6 % of the same test's time); here the
table is built once per element dtype.

Block types and tensor shapes derived once per shape. Every interpreted operation builds its
result's ``tl.block_type`` (unwrapping and validating the shape, formatting its name) and a
``tl.tensor`` whose shape is a ``tl.tuple`` of fresh ``constexpr`` objects with a tuple type of
their own (429,249 block types and 573,402 tensors in test_triton_graphs.py, whose block types'
shapes are ``tl.tuple``s of ints). Here what depends only on the shape (and, for the name, on the
element type's name, which is its ``str``) is computed at the shape's first use and reused (98 % of
the block types there); every block type and tensor still gets a ``tl.tuple`` of its own
(``tl.tuple._setitem`` changes one in place), the ints, ``constexpr`` objects and tuple type in it
are shared (nothing changes those after construction). A shape that is not all plain ints goes the
original way, and so does every first use, so a bad shape raises as before.

Integer overflow checks that assert nothing, skipped. Every ``+``, ``-`` and ``*`` of int32 (or
narrower) tensors in a kernel calls ``binary_op_sanitize_overflow_impl`` (``semantic.py``), which
redoes the operation in int64, compares it with the type's bounds and hands the comparison to
``device_assert``. That returns without asserting unless the builder's ``options.debug`` is set, and
the interpreter's options are a frozen ``InterpreterOptions()`` whose ``debug`` is False: the check
computes int64 copies of the kernel's index arithmetic and throws them away (an int32 product that
wraps is stored wrapped, no error; test_interpreter_speed.py shows it). That was about 14 % of an
interpreted generation's CPU (the tiny fp32 Kimi-K2.5 target, one prompt, two tokens: 2.2 s ->
1.9 s; 31,507 checks in test_triton_graphs.py, whose index arithmetic is mostly int32). Here the
check returns at once while ``debug`` is off, as ``device_assert`` would have; with ``debug`` on it
runs as before. (Its two ``assert``s on the operand types go with it: the callers pass operands
that the type checks before made equal integer types.)

Builtin names read once. ``_patch_lang`` finds the builtins it wraps by listing ``triton.language``,
``triton.language.core``, ``tl.tensor``, ``tl.math`` and ``tensor_descriptor_base`` with
``inspect.getmembers`` (about 540 members) at every launch: 0.35 ms of patching and restoring a
GEMM launch, 0.15 ms without. Here the names of their builtins are read once, at install, and each
patching wraps what is still a builtin under those names, in the same (sorted) order: what
``getmembers`` would find, as these modules gain no builtin later. A member wrapped at install
stays wrapped: the scopes of device-function calls, which the interpreter never restores, leave
``core``'s functions wrapped for good (every later patching skips them, both ways). Any other
module or class goes the original way.
"""

from __future__ import annotations

from typing import Any

import pytest


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """All five (undone by ``monkeypatch``)."""
    _patch_once_per_launch(monkeypatch)
    _cache_np_dtypes(monkeypatch)
    _cache_shapes(monkeypatch)
    _skip_unasserted_overflow_checks(monkeypatch)
    _cache_builtin_names(monkeypatch)


def _skip_unasserted_overflow_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.language.semantic import TritonSemantic

    check = TritonSemantic.binary_op_sanitize_overflow_impl

    def check_if_asserted(self: Any, lhs: Any, rhs: Any, binary_op: Any) -> None:
        if not self.builder.options.debug:
            return None  # device_assert would drop the check's result
        return check(self, lhs, rhs, binary_op)

    check_if_asserted.__wrapped__ = check  # type: ignore[attr-defined]  # (test_interpreter_speed.py)
    monkeypatch.setattr(TritonSemantic, "binary_op_sanitize_overflow_impl", check_if_asserted)


def _cache_np_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime import interpreter as ti

    lookup, cache, block, pointer = ti._get_np_dtype, {}, ti.tl.block_type, ti.tl.pointer_type

    def cached(tt_dtype: Any) -> Any:
        # a block's numpy dtype is its element's (the interpreter's rule); hashing a block type
        # costs as much as the table, so the key is the element type
        element = tt_dtype.element_ty if isinstance(tt_dtype, block) else tt_dtype
        if isinstance(element, pointer):  # not hashable; every pointer is a uint64
            return lookup(element)
        try:
            return cache[element]
        except KeyError:
            cache[element] = got = lookup(element)
            return got

    monkeypatch.setattr(ti, "_get_np_dtype", cached)


def _patch_once_per_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect

    from triton.runtime import interpreter as ti

    # The language modules patched since the launch started: a device function is skipped only
    # when its own (``triton.language`` and / or ``triton.language.core``, as ``_patch_lang``
    # finds them in its globals) are all among them; ``tl.zeros`` and the other library functions
    # see only ``core``, which a kernel that imports ``triton.language as tl`` does not patch.
    state: dict[str, Any] = {"in_launch": False, "patched": set()}
    patch_lang, launch = ti._patch_lang, ti.GridExecutor.__call__
    langs = (ti.tl, ti.tl.core)

    def patch_once(fn: Any) -> Any:
        mine = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and any(v is m for m in langs)}
        if state["in_launch"] and mine <= state["patched"]:
            return ti._LangPatchScope()  # nothing to restore: the launch's scope holds the patches
        scope = patch_lang(fn)
        if state["in_launch"]:
            state["patched"] |= mine
        return scope

    def scoped_launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        state["in_launch"], state["patched"] = True, set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            state["in_launch"], state["patched"] = False, set()

    monkeypatch.setattr(ti, "_patch_lang", patch_once)
    monkeypatch.setattr(ti.GridExecutor, "__call__", scoped_launch)


def _plain_shape(shape: Any, tl_tuple: type) -> tuple[int, ...] | None:
    """``shape`` (a list or ``tl.tuple``: what ``block_type`` accepts; a block type's own shape is a
    ``tl.tuple`` of ints) as a tuple when all its dims are plain ints: the cacheable case."""
    kind = type(shape)
    if kind is tl_tuple:
        shape = shape.values
    elif kind is not list:
        return None
    for d in shape:
        if type(d) is not int:
            return None
    return tuple(shape)


def _cache_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.language import core

    block_init, tensor_init, tl_tuple = core.block_type.__init__, core.tensor.__init__, core.tuple
    blocks: dict[tuple[str, tuple[int, ...]], tuple[list[int], Any, int, str]] = {}
    shapes: dict[tuple[int, ...], tuple[list[Any], Any, Any]] = {}

    def cached_block_init(self: Any, element_ty: Any, shape: Any) -> None:
        dims = _plain_shape(shape, tl_tuple)
        # the name is '<shape, str(element_ty)>' and every dtype's (and pointer type's) str is its name
        key = None if dims is None else (element_ty.name, dims)
        hit = None if key is None else blocks.get(key)
        if hit is None:
            block_init(self, element_ty, shape)  # validates: a bad shape raises as before
            if key is not None:
                blocks[key] = (list(self.shape.values), self.shape.type, self.numel, self.name)
            return
        values, tuple_type, self.numel, self.name = hit
        self.element_ty = element_ty
        self.shape = tl_tuple(values, tuple_type)  # a list of its own

    def cached_tensor_init(self: Any, handle: Any, ty: Any) -> None:
        dims = _plain_shape(ty.shape, tl_tuple) if ty.is_block() else ()
        hit = None if dims is None else shapes.get(dims)
        if hit is None:
            tensor_init(self, handle, ty)
            if dims is not None:
                shapes[dims] = (list(self.shape.values), self.shape.type, self.numel)
            return
        values, tuple_type, numel = hit
        self.handle, self.type, self.dtype, self.numel = handle, ty, ty.scalar, numel
        self.shape = tl_tuple(values, tuple_type)

    cached_block_init.__wrapped__ = block_init  # type: ignore[attr-defined]  # (test_interpreter_speed.py)
    cached_tensor_init.__wrapped__ = tensor_init  # type: ignore[attr-defined]
    monkeypatch.setattr(core.block_type, "__init__", cached_block_init)
    monkeypatch.setattr(core.tensor, "__init__", cached_tensor_init)


def _cache_builtin_names(monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect

    from triton.runtime import interpreter as ti

    is_builtin, patch_builtin = ti.tl.core.is_builtin, ti._patch_builtin
    pkgs = (ti.tl, ti.tl.core, ti.tl.tensor, ti.tl.math, ti.tl.core.tensor_descriptor_base)
    names = {id(p): (p, [n for n, m in inspect.getmembers(p) if is_builtin(m)]) for p in pkgs}

    def patch_named(pkg: Any, builder: Any, scope: Any) -> None:
        known = names.get(id(pkg))
        if known is None or known[0] is not pkg:
            return patch_builtin(pkg, builder, scope)
        for name in known[1]:
            member = getattr(pkg, name)
            if is_builtin(member):  # (one a leaked scope left patched is not, as before)
                ti._patch_attr(pkg, name, member, builder, scope)
        return None

    patch_named.__wrapped__ = patch_builtin  # type: ignore[attr-defined]  # (test_interpreter_speed.py)
    monkeypatch.setattr(ti, "_patch_builtin", patch_named)
