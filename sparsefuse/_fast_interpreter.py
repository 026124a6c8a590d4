"""Triton's interpreter without the work it throws away: three changes that leave every result and error as it was.

First, no redundant re-patching of ``triton.language`` on every device-function call. Under ``TRITON_INTERPRET=1``
a kernel launch swaps the builtins of the ``triton.language`` modules its globals reach (``tl``, ``tl.core``) for
interpreted versions, and restores them when it ends. Every call of a ``@triton.jit`` helper from inside the kernel
(``tl.zeros``, ``_popcount``, a gather helper in a loop) does the same swap again for the helper's modules --
already swapped by the launch or by an earlier helper call of the same launch -- and never restores it. That
repeated walk over the modules' members was ~23% of the interpreter's time in the training step's property cases.
Here a helper call swaps only the language modules not yet swapped during the current launch; each launch starts
afresh, so every kernel and helper runs on exactly the patched modules it would otherwise run on.

Second, the interpreter skips its integer-overflow sanitiser. With ``sanitize_overflow`` on, every 32-bit integer
add, subtract and multiply is recomputed in int64 and range-checked -- and the check handed to ``device_assert``,
which does nothing unless the options' ``debug`` is set, which the interpreter's never is. So the work is thrown
away; it was ~35% of the interpreter's time in the training step's property cases (int32 index arithmetic in the
compaction and gather kernels). Turning it off changes no result and no error: compiled kernels without ``debug``
drop the same asserts. With ``debug`` set, the sanitiser stays.

Third, the interpreter's map from a Triton dtype to its numpy dtype is memoised: Triton builds the whole table of
dtypes anew on every call (~20 us each, tens of thousands of calls a property run), where the answer depends on the
dtype alone.

Opt-in, for a process that runs the package's kernels through the interpreter (the test suite and the programs it
starts, or a CPU run of an example): ``SPARSEFUSE_FAST_INTERPRETER=1`` beside ``TRITON_INTERPRET=1`` before
sparsefuse is imported installs it (``sparsefuse._backend``); tests/conftest.py sets both, so the subprocesses the
tests start (the CLI's check, torchrun, spawned gloo ranks) inherit it. A Triton whose interpreter is built
otherwise (no module-level ``_patch_lang``, or device calls that do not go through it; no ``interpreter_builder``
with these options) is left as it is.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from typing import Any


def install() -> bool:
    """The module's three changes (idempotent); False where this Triton's interpreter differs for the first."""
    skip_discarded_overflow_checks()
    memoise_numpy_dtypes()
    return patch_languages_once()


def skip_discarded_overflow_checks() -> bool:
    """The interpreter's options without ``sanitize_overflow`` while ``debug`` is off (its checks are discarded then);
    False where this Triton's interpreter has no such options or has ``debug`` on."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or not {"debug", "sanitize_overflow"} <= set(vars(options)):
        return False
    if options.debug:
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


def memoise_numpy_dtypes() -> bool:
    """The interpreter's ``_get_np_dtype`` answered from a table per dtype (idempotent); False where it has none."""
    from triton.runtime import interpreter

    convert = getattr(interpreter, "_get_np_dtype", None)
    if convert is None or getattr(convert, "_sparsefuse_memo", False):
        return convert is not None
    memo: dict[Any, Any] = {}

    def get_np_dtype(tt_dtype: Any) -> Any:
        try:
            return memo[tt_dtype]
        except KeyError:
            memo[tt_dtype] = found = convert(tt_dtype)
            return found
        except TypeError:  # an unhashable dtype: Triton's own answer
            return convert(tt_dtype)

    get_np_dtype._sparsefuse_memo = True
    interpreter._get_np_dtype = get_np_dtype
    return True


def patch_languages_once() -> bool:
    """Wraps the interpreter's language patching (idempotent); False where this Triton's interpreter differs."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    function = getattr(interpreter, "InterpretedFunction", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or function is None or executor is None:
        return False
    if getattr(patch_lang, "_sparsefuse_once", False):
        return True
    try:
        if not all("_patch_lang(self.fn)" in inspect.getsource(f.__call__) for f in (function, executor)):
            return False
    except (OSError, TypeError):
        return False

    # per thread: launches running, depth of device calls, language modules swapped in the running launch
    state = threading.local()
    lang_ids: dict[int, frozenset[int]] = {}

    def languages(fn: Any) -> frozenset[int]:
        key = id(fn)
        if key not in lang_ids:
            lang_ids[key] = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)
            )
        return lang_ids[key]

    def patch_once(fn: Any) -> Any:
        langs = languages(fn)
        if getattr(state, "launches", 0):
            if getattr(state, "depth", 0):  # a helper called from the running kernel
                if langs and langs <= state.patched:
                    return None  # the caller discards a helper call's scope
                state.patched = state.patched | langs
            else:  # the launch itself: it restores its own swaps when it ends
                state.patched = langs
        return patch_lang(fn)  # and anything called outside a launch, as before

    patch_once._sparsefuse_once = True

    def counted(wrapped: Any, counter: str, forget_on_exit: bool = False) -> Any:
        """``wrapped`` (a ``__call__``) with the thread's ``counter`` raised while it runs; with ``forget_on_exit``
        (a launch) its end also forgets the modules swapped in it (its own swaps are restored by then)."""

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            setattr(state, counter, getattr(state, counter, 0) + 1)
            try:
                return wrapped(self, *args, **kwargs)
            finally:
                setattr(state, counter, getattr(state, counter) - 1)
                if forget_on_exit:
                    state.patched = frozenset()

        return call

    device_call, launch = (
        counted(function.__call__, "depth"),
        counted(executor.__call__, "launches", forget_on_exit=True),
    )

    interpreter._patch_lang = patch_once
    function.__call__ = device_call
    executor.__call__ = launch
    return True
