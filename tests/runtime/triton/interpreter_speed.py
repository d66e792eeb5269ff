"""Two repeats the Triton interpreter makes per operation, done once (tests only: speed; what the
kernels compute is unchanged).

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
"""

from __future__ import annotations

from typing import Any

import pytest


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both (undone by ``monkeypatch``)."""
    _patch_once_per_launch(monkeypatch)
    _cache_np_dtypes(monkeypatch)


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
