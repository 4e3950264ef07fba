"""Triton's CPU interpreter (TRITON_INTERPRET=1), made cheaper without changing what it computes.

Every call of a @triton.jit helper from inside a kernel (our own helpers, and triton.language's: tl.sum,
tl.zeros, tl.cdiv, tl.sigmoid) re-patches triton.language for the interpreter: `inspect.getmembers` over the
language modules and a fresh wrapper for every builtin, about 2 ms a call. The launch already patched those
modules and restores them when its grid ends; a helper's patch is never restored, so redoing one inside the
same launch sets the same wrappers again. In the test suite that was a quarter of the interpreter's time.

`skip_repeated_patching()` keeps the first patch of each language module per launch and skips the repeats.
It changes triton's private interpreter, so it installs only when the pieces it wraps are there, exactly as
expected; otherwise the interpreter runs unchanged (slower, same results).
"""

from __future__ import annotations

import inspect

_installed = False
PATCHES = 0  # patches of triton.language actually made (the test counts them)


def skip_repeated_patching() -> bool:
    """Install the skip; returns whether it is active (idempotent)."""
    global _installed
    if _installed:
        return True
    try:
        from triton.runtime import interpreter as it
    except ImportError:  # pragma: no cover - no triton
        return False
    executor = getattr(it, "GridExecutor", None)
    grid_call = executor.__call__ if isinstance(executor, type) else None
    patch_lang, scope_cls = getattr(it, "_patch_lang", None), getattr(it, "_LangPatchScope", None)
    tl = getattr(it, "tl", None)
    if grid_call is None or patch_lang is None or scope_cls is None or tl is None:
        return False
    if list(inspect.signature(patch_lang).parameters) != ["fn"]:
        return False

    patched: list[set[int] | None] = [None]  # ids of the language modules patched in the running launch

    def _langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_once(fn):
        done = patched[0]
        langs = _langs(fn)
        if done is not None and langs and langs <= done:
            return scope_cls()  # already patched in this launch: nothing to set, nothing to restore
        global PATCHES
        PATCHES += 1
        scope = patch_lang(fn)
        if done is not None:
            done |= langs
        return scope

    def launch(self, *args, **kwargs):
        outer = patched[0]
        patched[0] = set()  # the launch's own patch (made inside grid_call) is the first one recorded
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched[0] = outer

    it._patch_lang = patch_once
    it.GridExecutor.__call__ = launch
    _installed = True
    return True
