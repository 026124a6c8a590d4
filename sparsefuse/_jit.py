"""``@kernel``: ``triton.jit`` for the kernels the package launches, with a shorter host path per launch.

Why: a Triton launch of ~25 arguments costs 30-50 us of host time on H100 and H200 machines, of which the compiled
kernel's own launcher takes ~14 us. The rest is Triton's generic binding: its generated binder specialises every
argument (~17 us), hashes the specialisation into a cache key, looks up global-value guards, knobs, hooks and the
launch metadata. A small eager call (one token's SAE decode, one token through the FFN) makes two to four launches,
and the training step sixteen, so that overhead is a large share of what an eager call costs over its GPU time.

How: each launch computes a key that is at least as fine as Triton's own specialisation of the same arguments -- per
tensor its dtype and address modulo 16, per integer whether it is 1, whether it divides by 16 and its width
(i32/i64/u64), the value of every constexpr, the keywords' names and values (launch options included), the device
and the two knobs that enter Triton's key -- and on a hit calls the compiled kernel's launcher directly with the
arguments in signature order. A miss (first call, new specialisation) goes through Triton's own ``run``, which
compiles as usual and returns the kernel that the key then maps to. So a cached entry is only ever reused for
arguments Triton would have specialised identically.

Anything this path does not model goes through Triton's ``run`` every time: a grid given as a function (autotuned
kernels), launch hooks (profilers such as Proton), pre-run hooks, warm-up, an argument of another type (e.g. a
tensor descriptor), and Triton releases before 3.4 (another launcher convention). Under ``TRITON_INTERPRET=1``
``@kernel`` is plain ``triton.jit``.

Measured on an H200 machine (Triton 3.6), a 25-argument launch: 25.7-27.1 us through Triton's ``run``, 20.2-20.6
us through this path (its key 6.3 us, the compiled launcher ~14 us). The path is **opt-in**
(``SPARSEFUSE_FAST_LAUNCH=1``) until the whole GPU suite passes with it on; ``SPARSEFUSE_FAST_LAUNCH=verify``
checks each cached launch against Triton's own pick and raises where they differ.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
import triton
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from ._backend import INTERPRET

try:  # Triton >= 3.4
    from triton import knobs
except ImportError:  # pragma: no cover - older Triton takes the standard launch (FAST_LAUNCH False)
    knobs = None


def _version(v: str) -> tuple[int, int]:
    major, minor = v.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


# Triton 3.4 to 3.9 (read in each) launch as ``kernel.run(gx, gy, gz, stream, function, packed_metadata,
# launch_metadata, enter_hook, exit_hook, *every_bound_argument)``; 3.3 and earlier pass other hooks.
FAST_LAUNCH: bool = (
    not INTERPRET
    and os.environ.get("SPARSEFUSE_FAST_LAUNCH", "0") in ("1", "verify")
    and (3, 4) <= _version(triton.__version__) < (4, 0)
)
# "verify": every cached launch also asks Triton which kernel it would run (its binder, no launch) and raises if that
# is not the cached one -- slower than either path; for test runs that check the key.
VERIFY: bool = os.environ.get("SPARSEFUSE_FAST_LAUNCH") == "verify"

_INT32_MIN, _INT32_MAX, _INT64_MAX = -(1 << 31), (1 << 31) - 1, (1 << 63) - 1


class _Unmodelled(Exception):
    """An argument the launch key does not model: Triton's own path takes the call."""


# The key's parts as Python expressions of an argument ``{v}``: written once, evaluated both as the functions below
# (which the tests compare with Triton's own specialisation) and inline in each kernel's generated key function.
# An integer: == 1 (baked in as a constant), divisible by 16 (an alignment hint), its type (i32, i64 or u64).
_INT_KEY = f"({{v}} == 1, not {{v}} & 15, {_INT32_MIN} <= {{v}} <= {_INT32_MAX}, {{v}} <= {_INT64_MAX})"
# A tensor: its dtype and its address modulo 16 (Triton's 16-byte alignment hint).
_TENSOR_KEY = "({v}.dtype, {v}.data_ptr() & 15)"

int_key: Callable[[int], tuple[bool, bool, bool, bool]] = eval(f"lambda v: {_INT_KEY.format(v='v')}")
int_key.__doc__ = "What Triton's specialisation of a non-constexpr integer depends on (see ``_INT_KEY``)."
_tensor_key: Callable[[torch.Tensor], tuple[torch.dtype, int]] = eval(f"lambda v: {_TENSOR_KEY.format(v='v')}")


def arg_key(v: Any, constexpr: bool) -> Any:
    """One argument's part of the launch key (see the module docstring). Raises :class:`_Unmodelled` for a type the
    key does not cover."""
    if constexpr:
        return v  # baked into the kernel: the value itself (hashable, or the lookup falls back)
    if isinstance(v, torch.Tensor):
        return _tensor_key(v)
    t = type(v)
    if t is int:
        return int_key(v)
    if t is bool or t is float or v is None:
        return t
    raise _Unmodelled(t)


def _hooked(hook: Any) -> bool:
    """Whether a Triton launch hook is set: None, or (Triton >= 3.5) an empty ``HookChain``, is none."""
    return hook is not None and getattr(hook, "calls", True) != []


def _key_source(names: list[str], kinds: list[str]) -> str:
    """The source of a launch-key function over arguments ``names`` (their ``kinds``: "runtime" or "baked"), one
    expression per argument so that a launch pays no Python call per argument: for a plain tensor its dtype and
    address modulo 16, for an int :func:`int_key`'s tuple, a baked value itself, anything else through
    :func:`arg_key` (which raises for types it does not model)."""
    parts = []
    for n, kind in zip(names, kinds):
        if kind == "baked":
            parts.append(n)
        else:
            parts.append(
                f"({_TENSOR_KEY.format(v=n)} if type({n}) is _Tensor else "
                f"{_INT_KEY.format(v=n)} if type({n}) is int else _arg_key({n}, False))"
            )
    return f"def key({', '.join(names)}):\n    return ({', '.join(parts)},)\n"


class FastLaunchJIT(JITFunction):
    """A ``JITFunction`` whose ``run`` launches cached specialisations without Triton's binder."""

    def __init__(self, fn: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(fn, **kwargs)
        self._launches: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self._key_fns: dict[tuple[Any, ...], Callable[..., tuple[Any, ...]]] = {}

    def _key_fn(self, n_positional: int, keywords: tuple[str, ...]) -> Callable[..., tuple[Any, ...]]:
        """The key function for calls with ``n_positional`` arguments and these keywords (built once per form)."""
        fn = self._key_fns.get((n_positional, keywords))
        if fn is None:
            constexpr = {p.name for p in self.params if p.is_constexpr}
            runtime = {p.name for p in self.params} - constexpr
            names = [f"a{i}" for i in range(n_positional)] + [f"k_{name}" for name in keywords]
            kinds = ["baked" if p.is_constexpr else "runtime" for p in self.params[:n_positional]]
            kinds += ["runtime" if name in runtime else "baked" for name in keywords]  # options are baked
            if len(kinds) < n_positional:  # more positional arguments than parameters: Triton's run raises
                raise _Unmodelled(self.__name__)
            namespace = {"_Tensor": torch.Tensor, "_arg_key": arg_key}
            exec(_key_source(names, kinds), namespace)
            fn = self._key_fns[(n_positional, keywords)] = namespace["key"]
        return fn

    def _key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        mode = getattr(knobs.compilation, "instrumentation_mode", None)  # in Triton's key from 3.6
        keywords = tuple(kwargs)  # the names too: the same values under other keywords are another launch
        head = (driver.active.get_current_device(), knobs.runtime.debug, mode, keywords)
        return head + self._key_fn(len(args), keywords)(*args, *kwargs.values())

    def _entry(self, kernel: Any, n_positional: int, kwargs: dict[str, Any]) -> tuple[Any, ...]:
        # The bound arguments after the positional ones, in signature order: from the keywords, else defaults.
        tail = tuple((p.name, p.default) for p in self.params[n_positional:])
        if any(name not in kwargs and default is inspect.Parameter.empty for name, default in tail):
            raise _Unmodelled(self.__name__)
        return kernel, kernel.run, kernel.function, kernel.packed_metadata, tail

    def _verify(self, compiled: Any, args: tuple[Any, ...], kwargs: dict[str, Any], grid: Any) -> None:
        expected = super().run(*args, grid=grid, warmup=True, **kwargs)  # Triton's pick, compiled if new; no launch
        if hasattr(expected, "result"):  # an asynchronous compile's future
            expected = expected.result()
        if expected is not compiled:
            raise RuntimeError(
                f"sparsefuse fast launch: {self.__name__}'s cached kernel is not the one Triton picks for these "
                f"arguments (keywords {sorted(kwargs)}): the launch key misses a specialisation"
            )

    def run(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        runtime = knobs.runtime
        if (
            warmup
            or callable(grid)
            or self.pre_run_hooks
            or _hooked(runtime.launch_enter_hook)
            or _hooked(runtime.launch_exit_hook)
        ):
            return super().run(*args, grid=grid, warmup=warmup, **kwargs)
        try:
            key = self._key(args, kwargs)
            entry = self._launches.get(key)
        except (_Unmodelled, TypeError):  # TypeError: an unhashable constexpr
            return super().run(*args, grid=grid, warmup=warmup, **kwargs)
        if entry is None:
            compiled = super().run(*args, grid=grid, warmup=warmup, **kwargs)
            if compiled is not None:
                try:
                    self._launches[key] = self._entry(compiled, len(args), kwargs)
                except _Unmodelled:
                    pass
            return compiled
        compiled, launcher, function, metadata, tail = entry
        if VERIFY:
            self._verify(compiled, args, kwargs, grid)
        values = args + tuple([kwargs[name] if name in kwargs else default for name, default in tail])
        n = len(grid)
        stream = driver.active.get_current_stream(key[0])
        launcher(
            grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, function, metadata,
            None, None, None, *values,
        )  # fmt: skip
        return compiled


def kernel(fn: Callable[..., Any] | None = None, **jit_kwargs: Any) -> Any:
    """``@triton.jit`` for a kernel launched from the host (``kernel[grid](...)``), with the cached launch path of
    this module where it applies. Helpers called from other kernels keep ``@triton.jit``."""

    def wrap(f: Callable[..., Any]) -> Any:
        jitted = FastLaunchJIT(f, **jit_kwargs) if FAST_LAUNCH else triton.jit(f, **jit_kwargs)
        jitted.launched_kernel = True  # what the tests check every host-launched kernel carries
        return jitted

    return wrap(fn) if fn is not None else wrap
