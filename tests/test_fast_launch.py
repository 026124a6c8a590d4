"""The cached launch path of ``sparsefuse._jit``: its key is at least as fine as Triton's own specialisation (so a
cached kernel is never reused for arguments Triton would compile differently), the arguments reach the compiled
launcher in signature order, and what the path does not model goes through Triton's ``run``. On a CPU the launcher
and Triton's ``run`` are stand-ins; the GPU test launches a real kernel both ways."""

import random
import types

import pytest
import torch
import triton
import triton.language as tl

from sparsefuse import _jit

_native = pytest.importorskip("triton._C.libtriton").native_specialize_impl


def _triton_spec(v):
    from triton.backends.compiler import BaseBackend

    return _native(BaseBackend, v, False, True, True)


def _edge_ints():
    edges = [0, 1, 2, 15, 16, 17, 31, 32, -1, -15, -16, -17]
    for p in (31, 32, 63, 64):
        for d in (-17, -16, -1, 0, 1, 16):
            edges += [(1 << p) + d, -(1 << p) + d]
    rng = random.Random(0)
    edges += [rng.randrange(-(1 << 64), 1 << 64) for _ in range(2000)]
    edges += [rng.randrange(-(1 << 33), 1 << 33) * 16 for _ in range(500)]
    return [v for v in edges if -(1 << 63) <= v < (1 << 64)]


def test_int_key_is_at_least_as_fine_as_tritons_specialisation():
    by_key: dict = {}
    for v in _edge_ints():
        by_key.setdefault(_jit.int_key(v), set()).add(_triton_spec(v))
    assert all(len(specs) == 1 for specs in by_key.values()), by_key


def test_tensor_key_is_at_least_as_fine_as_tritons_specialisation():
    by_key: dict = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.int8, torch.bool):
        base = torch.zeros(64, dtype=dtype)
        for offset in range(0, 33):
            t = base[offset:]
            by_key.setdefault(_jit.arg_key(t, False), set()).add(_triton_spec(t))
        by_key.setdefault(_jit.arg_key(base[:0], False), set()).add(_triton_spec(base[:0]))
    assert all(len(specs) == 1 for specs in by_key.values()), by_key
    for values in ((True, False), (0.5, 3.0, -1e30), (None,)):  # one key per type, as Triton has one spec per type
        assert len({_jit.arg_key(v, False) for v in values}) == 1
        assert len({_triton_spec(v) for v in values}) == 1
    with pytest.raises(_jit._Unmodelled):
        _jit.arg_key("text", False)
    assert _jit.arg_key(7, True) == 7  # a constexpr's value is baked in: it is its own key


def _toy(x_ptr, out_ptr, n, scale, FLAG: tl.constexpr, BLOCK: tl.constexpr = 32):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, x * scale + (1.0 if FLAG else 0.0), mask=offs < n)


class _StandIns:
    """Triton's driver, knobs and ``JITFunction.run`` replaced: records what each path was given."""

    def __init__(self, monkeypatch):
        self.standard_runs: list = []
        self.launches: list = []
        self.knobs = types.SimpleNamespace(
            runtime=types.SimpleNamespace(debug=False, launch_enter_hook=None, launch_exit_hook=None),
            compilation=types.SimpleNamespace(instrumentation_mode=""),
        )
        active = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d: 1234)
        monkeypatch.setattr(_jit, "driver", types.SimpleNamespace(active=active))
        monkeypatch.setattr(_jit, "knobs", self.knobs)

        def standard_run(jit_self, *args, grid, warmup, **kwargs):
            self.standard_runs.append((args, kwargs))
            return types.SimpleNamespace(run=lambda *a: self.launches.append(a), function="fn", packed_metadata="meta")

        monkeypatch.setattr(_jit.JITFunction, "run", standard_run)


def test_fast_path_reuses_only_identical_specialisations_and_orders_arguments(monkeypatch):
    stand_ins = _StandIns(monkeypatch)
    k = _jit.FastLaunchJIT(_toy)
    x, out = torch.zeros(64), torch.zeros(64)

    k[(2,)](x, out, 64, 0.5, FLAG=True, num_warps=4)  # first: Triton's run compiles
    assert len(stand_ins.standard_runs) == 1 and not stand_ins.launches
    k[(2, 3)](x, out, 64, 0.25, FLAG=True, num_warps=4)  # same specialisation: the cached launcher
    assert len(stand_ins.standard_runs) == 1
    grid_and_meta, values = stand_ins.launches[-1][:9], stand_ins.launches[-1][9:]
    assert grid_and_meta == (2, 3, 1, 1234, "fn", "meta", None, None, None)
    assert values == (x, out, 64, 0.25, True, 32)  # signature order, BLOCK from its default

    for args, kwargs in [
        ((x[1:], out, 64, 0.5), dict(FLAG=True, num_warps=4)),  # a pointer no longer 16-byte aligned
        ((x, out, 1, 0.5), dict(FLAG=True, num_warps=4)),  # n == 1 is baked in by Triton
        ((x, out, 63, 0.5), dict(FLAG=True, num_warps=4)),  # n no longer divisible by 16
        ((x, out, 1 << 31, 0.5), dict(FLAG=True, num_warps=4)),  # n needs 64 bits
        ((x.half(), out, 64, 0.5), dict(FLAG=True, num_warps=4)),  # another dtype
        ((x, out, 64, 0.5), dict(FLAG=False, num_warps=4)),  # another constexpr
        ((x, out, 64, 0.5), dict(FLAG=True, num_warps=8)),  # another launch option
        ((x, out, 64, 0.5), dict(FLAG=True, BLOCK=64, num_warps=4)),  # a default overridden
        ((x, out, 64, 0.5), dict(FLAG=True, num_stages=4)),  # the same values under another keyword
    ]:
        before = len(stand_ins.standard_runs)
        k[(2,)](*args, **kwargs)
        assert len(stand_ins.standard_runs) == before + 1, (args, kwargs)
    stand_ins.knobs.runtime.debug = True
    k[(2,)](x, out, 64, 0.5, FLAG=True, num_warps=4)  # Triton's debug knob enters its key
    assert len(stand_ins.standard_runs) == 11


def test_the_generated_key_is_arg_key_argument_by_argument():
    k = _jit.FastLaunchJIT(_toy)
    x = torch.zeros(64)
    for args in [(x, x[1:], 1, 0.5, True), (x, x, 1 << 31, 2.0, False), (x[4:], x, -16, None, True)]:
        want = tuple(_jit.arg_key(v, i == 4) for i, v in enumerate(args))
        assert k._key_fn(len(args), ())(*args) == want
    assert k._key_fn(2, ("n", "BLOCK"))(x, x, 17, 64) == (_jit.arg_key(x, False),) * 2 + (_jit.int_key(17), 64)


def test_what_the_fast_path_does_not_model_takes_tritons_run(monkeypatch):
    stand_ins = _StandIns(monkeypatch)
    k = _jit.FastLaunchJIT(_toy)
    x, out = torch.zeros(64), torch.zeros(64)
    k[(2,)](x, out, 64, 0.5, FLAG=True)
    k[lambda meta: (2,)](x, out, 64, 0.5, FLAG=True)  # a grid function (autotuning)
    k[(2,)](x, out, 64, 0.5, FLAG=[1])  # an unhashable constexpr
    k[(2,)](x, out, "64", 0.5, FLAG=True)  # an argument type the key does not model
    stand_ins.knobs.runtime.launch_enter_hook = lambda *a: None  # a profiler's launch hook
    k[(2,)](x, out, 64, 0.5, FLAG=True)
    stand_ins.knobs.runtime.launch_enter_hook = types.SimpleNamespace(calls=[])  # an empty HookChain: no hook
    k[(2,)](x, out, 64, 0.5, FLAG=True)
    assert len(stand_ins.launches) == 1
    stand_ins.knobs.runtime.launch_enter_hook = types.SimpleNamespace(calls=[print])  # a chain holding one
    k[(2,)](x, out, 64, 0.5, FLAG=True)
    stand_ins.knobs.runtime.launch_enter_hook = None
    k.pre_run_hooks.append(lambda *a, **kw: None)
    k[(2,)](x, out, 64, 0.5, FLAG=True)
    assert len(stand_ins.standard_runs) == 7 and len(stand_ins.launches) == 1


def test_verify_mode_raises_where_tritons_pick_is_not_the_cached_kernel(monkeypatch):
    stand_ins = _StandIns(monkeypatch)
    monkeypatch.setattr(_jit, "VERIFY", True)
    k = _jit.FastLaunchJIT(_toy)
    x, out = torch.zeros(64), torch.zeros(64)
    k[(2,)](x, out, 64, 0.5, FLAG=True)  # a miss: Triton's run, then cached
    with pytest.raises(RuntimeError, match="_toy's cached kernel is not the one Triton picks"):
        k[(2,)](x, out, 64, 0.5, FLAG=True)  # the stand-in's run returns a new kernel each time: a mismatch
    assert not stand_ins.launches
    cached = k._launches[next(iter(k._launches))][0]
    monkeypatch.setattr(_jit.JITFunction, "run", lambda *a, **kw: cached)  # Triton picks the cached kernel
    k[(2,)](x, out, 64, 0.5, FLAG=True)
    assert len(stand_ins.launches) == 1


def test_kernel_decorator_is_triton_jit_where_the_fast_path_is_off():
    if _jit.FAST_LAUNCH:
        assert isinstance(_jit.kernel(_toy), _jit.FastLaunchJIT)
    else:  # off by default, under the interpreter (CI), or with a Triton before 3.4
        assert not isinstance(_jit.kernel(_toy), _jit.FastLaunchJIT)
    assert _jit._version("3.6.0") == (3, 6) and _jit._version("3.10.0+git1234") == (3, 10)


@pytest.mark.gpu
def test_fast_path_launches_the_kernel_triton_compiled(device, monkeypatch):
    if _jit._version(triton.__version__) < (3, 4):
        pytest.skip("the fast launch path needs Triton >= 3.4")
    monkeypatch.setattr(_jit, "VERIFY", True)  # each cached launch also checked against Triton's own pick
    k = _jit.FastLaunchJIT(_toy)  # whether or not SPARSEFUSE_FAST_LAUNCH turns it on for the package
    standard = triton.jit(_toy)
    base = torch.randn(300, device=device)
    for offset, n, scale, flag in [(0, 256, 0.5, True), (0, 200, 2.0, False), (1, 17, -1.0, True), (4, 1, 3.0, True)]:
        x = base[offset : offset + n]
        got, want = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
        for _ in range(2):  # the second launch takes the cached path
            k[(triton.cdiv(n, 32),)](x, got, n, scale, FLAG=flag)
        standard[(triton.cdiv(n, 32),)](x, want, n, scale, FLAG=flag)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(k._launches) == 4


def _jitted(obj):
    """The jitted function under ``obj`` (through an autotuner's wrapping), or None."""
    while hasattr(obj, "fn") and not isinstance(obj.fn, types.FunctionType):
        obj = obj.fn
    return obj if isinstance(getattr(obj, "fn", None), types.FunctionType) else None


def test_every_kernel_the_package_launches_is_decorated_with_kernel():
    import importlib
    import pkgutil

    import sparsefuse

    kernels = {}
    for info in pkgutil.walk_packages(sparsefuse.__path__, "sparsefuse."):
        if ".bench" in info.name or ".integrations" in info.name:
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            jitted = _jitted(obj)
            if name.endswith("_kernel") and jitted is not None and jitted.fn.__module__ == info.name:
                kernels[f"{info.name}.{name}"] = jitted
    assert len(kernels) >= 40
    assert [name for name, k in kernels.items() if not getattr(k, "launched_kernel", False)] == []
