"""Every Triton kernel of the package compiles for an H100 (sm_90), checked on a CPU-only machine.

CI runs the kernels through TRITON_INTERPRET=1, which executes them in Python and accepts code the real compiler
rejects (and never shows register spills). This test compiles them instead, without running anything on a GPU:

1. Record: small interpreter calls of every public op run with ``InterpretedFunction.run`` wrapped, so each launch
   is specialised exactly as a GPU launch of the same arguments would be (Triton's own binder for the CUDA backend:
   pointer dtypes, i32/i64, 16-divisibility, constexprs) together with its launch options (num_warps, num_stages).
2. Compile: each unique (kernel, signature, constexprs, attributes, options) goes through ``triton.compile`` for
   ``GPUTarget("cuda", 90, 32)`` in fresh processes without TRITON_INTERPRET (tests/_sm90_compile.py), with the
   Triton wheel's bundled ptxas.

A compile error fails the test; registers and spills (from ptxas -v) are printed as information (``pytest -s``).

Limits: launchers pick smaller tiles (and a single autotuning config) under the interpreter, so the compiled
specialisations are the interpreter's tile sizes, not necessarily the GPU's; spill counts are indicative only.
``_sfu`` (sparsefuse/_triton/sfu.py) exists only on the compiled path: it is compiled through the sfu_* helpers.
Coverage is asserted: every ``@triton.jit`` function in sparsefuse is launched or called by a launched kernel.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import sparsefuse
from sparsefuse import _backend

pytestmark = pytest.mark.skipif(not _backend.INTERPRET, reason="records launches through Triton's interpreter")

PACKAGE = Path(sparsefuse.__file__).parent
WORKER = Path(__file__).with_name("_sm90_compile.py")
# Reached only on the compiled path (see module docstring): compiled through their callers, never interpreted.
# _bitwise_or: a tl.reduce combine function, which the interpreter applies without calling it (row_bits_kernel).
COMPILED_ONLY = {
    ("sparsefuse._triton.sfu", "_sfu"),
    ("sparsefuse.splade.head.kernels", "_nan_max"),
    ("sparsefuse.sparse.compact", "_bitwise_or"),
}
# Constexprs the launchers set from _backend.INTERPRET: compiled with their GPU value (_nan_max behind it).
COMPILED_PATH_CONSTEXPRS = {"NATIVE_NAN_MAX": True}
WORKERS = 2  # CI has 2 cores; each worker process compiles its share serially


def _sm90_backend() -> Any:
    """Triton's CUDA backend for sm_90, or a skip when this Triton wheel lacks it or its ptxas."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import get_ptxas
        from triton.compiler import make_backend

        ptxas = get_ptxas(90).path
    except Exception as e:  # noqa: BLE001 -- ImportError, RuntimeError (no ptxas) ... all mean "cannot compile"
        pytest.skip(f"Triton has no usable NVIDIA backend/ptxas for sm_90: {type(e).__name__}: {e}")
    if not os.access(ptxas, os.X_OK):
        pytest.skip(f"ptxas not executable: {ptxas}")
    return make_backend(GPUTarget("cuda", 90, 32))


class Recorder:
    """Wraps InterpretedFunction.run: each launch becomes a compile spec, deduplicated; device-function calls
    (InterpretedFunction.__call__) are noted for the coverage check."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.specs: dict[str, dict[str, Any]] = {}
        self.seen: set[tuple[str, str]] = set()
        self._binders: dict[Any, tuple[Any, Callable[..., Any]]] = {}

    def _binder(self, interpreted: Any) -> tuple[Any, Callable[..., Any]]:
        from triton.runtime.jit import JITFunction, create_function_from_signature

        if interpreted.fn not in self._binders:
            keep = ("do_not_specialize", "do_not_specialize_on_alignment")
            jit = JITFunction(interpreted.fn, **{k: v for k, v in interpreted.kwargs.items() if k in keep})
            self._binders[interpreted.fn] = (
                jit,
                create_function_from_signature(jit.signature, jit.params, self.backend),
            )
        return self._binders[interpreted.fn]

    def launch(self, interpreted: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        fn = interpreted.fn
        self.seen.add((fn.__module__, fn.__name__))
        jit, binder = self._binder(interpreted)
        bound, specialization, options = binder(*args, **kwargs)
        # The same packing JITFunction.run does before compiling (it also rejects unknown launch keywords).
        _, signature, constexprs, attrs = jit._pack_args(self.backend, kwargs, bound, specialization, options)
        names = {(jit.arg_names.index(p.name),): p.name for p in jit.params}
        constexprs = {
            path: _portable(COMPILED_PATH_CONSTEXPRS.get(names.get(path, ""), v)) for path, v in constexprs.items()
        }
        launch_options = {k: v for k, v in kwargs.items() if k not in jit.arg_names and v is not None}
        key = repr(
            (fn.__module__, fn.__name__, signature, sorted(constexprs.items()), attrs, sorted(launch_options.items()))
        )
        self.specs.setdefault(key, {
            "key": key, "module": fn.__module__, "name": fn.__name__, "signature": signature,
            "constexprs": constexprs, "attrs": attrs, "options": launch_options,
        })  # fmt: skip

    def call(self, interpreted: Any) -> None:
        self.seen.add((interpreted.fn.__module__, interpreted.fn.__name__))


def _portable(value: Any) -> Any:
    """A constexpr value that pickles into the compile worker (JIT functions travel by name)."""
    if hasattr(value, "fn") and callable(value):
        return ("__jit__", value.fn.__module__, value.fn.__name__)
    return value


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    from triton.runtime.interpreter import InterpretedFunction

    rec = Recorder(_sm90_backend())
    run, call = InterpretedFunction.run, InterpretedFunction.__call__

    def recording_run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        rec.launch(self, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def recording_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec.call(self)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    monkeypatch.setattr(InterpretedFunction, "__call__", recording_call)
    yield rec


def _jit_functions() -> set[tuple[str, str]]:
    """(module, name) of every function decorated with ``@triton.jit`` in the package, from the source."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(("sparsefuse", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(ast.unparse(d) == "triton.jit" for d in node.decorator_list):
                found.add((module, node.name))
    return found


def _sparse_rows(rows: int, features: int, l0s: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Feature activations whose row r has l0s[r % len(l0s)] non-zeros (l0 == features: a row firing everything)."""
    acts = torch.zeros(rows, features)
    for r in range(rows):
        idx = torch.randperm(features)[: l0s[r % len(l0s)]]
        acts[r, idx] = torch.rand(len(idx)) + 0.5
    return acts.to(dtype)


def _exercise_ops(dtype: torch.dtype, ffn: bool) -> None:
    """Small calls of every public op (results unchecked: the other tests check them; bf16 runs here too)."""
    from sparsefuse.ffn.hybrid import hybrid_mlp, hybrid_relu_mlp
    from sparsefuse.sae import jumprelu_sae_forward

    def r(*shape: int, scale: float = 1.0, grad: bool = False) -> torch.Tensor:
        return (torch.randn(*shape) * scale).to(dtype).requires_grad_(grad)

    x = r(2, 8, 64)
    sparsefuse.snake(x, r(8).abs() + 0.5)
    sparsefuse.snake(x, r(8).abs() + 0.5, fast_sin=True)
    with sparsefuse.planning(snake={"flat_forward": False}):  # the row kernel (GPU: huge or strided x)
        sparsefuse.snake(x, r(8).abs() + 0.5)
    sparsefuse.snake(r(2, 8, 64, grad=True), r(8).abs().add(0.5).requires_grad_()).sum().backward()
    sparsefuse.celu(x)
    sparsefuse.celu(r(300, grad=True), alpha=0.5).sum().backward()
    acts = _sparse_rows(5, 700, [3, 700, 0, 12, 1], dtype)  # row 1 fires every feature: the long-row pass runs
    for method in ("scan", "fixed", "exact", "dense"):  # dense: cuBLAS, then the pass over its non-finite elements
        sparsefuse.sparse_decode(acts, r(700, 40, scale=0.1), method=method, max_l0=16)
    # the full row alone: split over programs summed by atomics, its 16-bit ranges are dense units (dense_units.py)
    sparsefuse.sparse_decode(acts[1:2], r(700, 40, scale=0.1), method="scan")
    if dtype != torch.float32:  # (dense units are 16-bit only)
        # a dead feature's NaN row inside a near-full row's ranges: the dense unit sums its item again over non-zeros
        holed, poisoned = _sparse_rows(1, 300, [300], dtype), r(300, 40, scale=0.1)
        holed[0, 5], poisoned[5] = 0.0, float("nan")
        sparsefuse.sparse_decode(holed, poisoned, method="scan")
    # backward: the sampled dense-pattern product (its kernels' specialisations do not need the full row, which the
    # interpreter walks slowly)
    grad_acts = _sparse_rows(3, 200, [3, 40, 0], dtype).requires_grad_()
    sparsefuse.sparse_decode(grad_acts, r(200, 40, scale=0.1, grad=True), method="scan").float().sum().backward()
    # TopK decode forward and backward (the slots' sampled dots; W_dec's gradient by feature)
    sparsefuse.topk_decode(
        torch.randint(0, 256, (4, 8)), r(4, 8, grad=True), r(256, 40, grad=True)
    ).float().sum().backward()
    xe, w_enc, b_enc = r(4, 64), r(64, 256, scale=0.1), r(256, scale=0.1)
    sparsefuse.jumprelu_encode(xe, w_enc, b_enc, torch.full((256,), 0.1, dtype=dtype), b_dec=r(64))
    sparsefuse.topk_encode(xe, w_enc, b_enc, 8)
    threshold = torch.zeros(256, dtype=dtype)  # rows overflow max_l0=4: the decode completes them from the encoder
    jumprelu_sae_forward(xe, w_enc, b_enc, threshold, r(256, 64, scale=0.1), r(64), max_l0=4, fused_encode=True)
    # S=40 spans several sequence tiles: the forward's partial maxima are combined by a second kernel
    hidden, weight, mask = r(2, 40, 32), r(96, 32, scale=0.2), torch.tensor([[1] * 40, [1] * 30 + [0] * 10])
    for pooling in ("max", "sum"):
        sparsefuse.splade_pool(hidden, weight, r(96), mask, pooling=pooling)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        sparsefuse.splade_pool(h, w, r(96, grad=True), mask, pooling=pooling).sum().backward()
    # the fused Llama pieces: RMSNorm with and without a weight, rows whole and chunked; rotary with GQA heads
    from sparsefuse.norms.rmsnorm.launch import RMSNormKnobs
    from sparsefuse.rotary import apply_rotary_pos_emb

    for single_max in (RMSNormKnobs().single_max, 16):
        with sparsefuse.planning(rms_norm={"single_max": single_max, "chunk": 16}):
            sparsefuse.rms_norm(r(6, 48, grad=True), 48, r(48, grad=True)).float().sum().backward()
            sparsefuse.rms_norm(r(6, 48, grad=True), 48).float().sum().backward()
    q, k = r(2, 5, 4, 64, grad=True), r(2, 5, 2, 64, grad=True)  # [B, S, H, hd] storage, as Llama's projections
    cos, sin = r(1, 5, 64), r(1, 5, 64)
    qe, ke = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    (qe.float().sum() + ke.float().sum()).backward()
    # the dense training step's elementwise kernels (cheap) in every dtype, bf16 (the training dtype) included, with
    # and without the L1 term's gradient
    from sparsefuse.ffn.hybrid.dense import relu_l1, relu_mul_l1

    pre, up = r(20, 300, grad=True), r(20, 300, grad=True)
    for fused in (lambda: relu_mul_l1(pre, up)[1:3], lambda: relu_l1(pre)[:2]):
        h, l1 = fused()
        (h.float().sum() + l1).backward()
        fused()[0].float().sum().backward()
    if not ffn:  # the MLPs dominate the interpreter's time: fp32 and fp16 only
        return
    K, N = 64, 256  # 64 tokens: several row blocks (heavy-first schedule) and row sorting (block plan)
    xf, w_gate, w_up, w_down = r(64, K), r(N, K, scale=0.2), r(N, K, scale=0.2), r(K, N, scale=0.1)
    # the TwELL tiles' kernels take 15 tokens (the fused gate, which keeps its overflowed tiles' pre-activations)
    # and 16 (cuBLAS's gate GEMM, its packing pass, overflowed tiles from its output): the interpreter walks each
    # token's tile; the block method takes the 64. The separate kernels' up/down recomputes overflowed tiles by GEMV.
    for tokens in (15, 16):
        sparsefuse.twell_mlp(xf[:tokens], w_gate, w_up, w_down, b_gate=r(N), method="twell")
        sparsefuse.twell_relu_mlp(xf[:tokens], w_up, w_down, method="twell")  # "twell" or "dense" only
    gate = sparsefuse.ffn.twell_gate(xf[:15], w_gate)
    sparsefuse.ffn.twell_up_down(gate, xf[:15], w_gate, w_up, w_down)
    with sparsefuse.planning(twell_mlp={"heavy_pass_min_tokens": 16}):  # the heavy tokens' launches
        sparsefuse.twell_mlp(xf[:16], w_gate, w_up, w_down, b_gate=r(N), method="twell")
    sparsefuse.twell_mlp(xf, w_gate, w_up, w_down, b_gate=r(N), method="block")
    for layout in ("block", "hybrid", "dense"):
        leaves = [t.detach().clone().requires_grad_() for t in (xf, w_gate, w_up, w_down)]
        out = hybrid_mlp(*leaves, b_gate=r(N, grad=True), layout=layout)
        (out.y.float().sum() + out.l1).backward()
        if layout == "hybrid":  # hybrid_relu_mlp has no "hybrid" layout
            continue
        leaves = [t.detach().clone().requires_grad_() for t in (xf, w_up, w_down)]
        out = hybrid_relu_mlp(*leaves, b_up=r(N, grad=True), layout=layout)
        (out.y.float().sum() + out.l1).backward()
    # one row block: no schedule launch, so the pack sums its own offsets
    leaves = [t.detach().clone().requires_grad_() for t in (xf[:8], w_gate, w_up, w_down)]
    out = hybrid_mlp(*leaves, layout="block")
    (out.y.float().sum() + out.l1).backward()
    # FATReLU and dReLU gates: the block step's passes on the unions, the dense passes' gate variants, and the L1
    # term on h (with dReLU); 16-bit only -- elementwise passes over the unions, whose fp32 specialisations differ
    # only in their loads' and stores' types
    if dtype != torch.float16:
        return
    for layout in ("block", "dense"):
        for activation, threshold, l1_on in (("fatrelu", 0.1, "gate"), ("drelu", 0.0, "hidden")):
            leaves = [t.detach().clone().requires_grad_() for t in (xf, w_gate, w_up, w_down)]
            gate = {"activation": activation, "threshold": threshold, "l1_on": l1_on}
            out = hybrid_mlp(*leaves, b_gate=r(N, grad=True), layout=layout, **gate)
            (out.y.float().sum() + out.l1).backward()


def _compile(specs: list[dict[str, Any]], tmp_path: Path) -> list[dict[str, Any]]:
    """Compiles the specs in WORKERS fresh processes, without the interpreter: each takes the next spec no other
    has claimed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), TRITON_ALWAYS_COMPILE="1")  # ptxas must run: its log
    (tmp_path / "specs.pkl").write_bytes(pickle.dumps(specs))
    (tmp_path / "claims").mkdir()
    procs = []
    for i in range(WORKERS):
        cmd = [sys.executable, str(WORKER), str(tmp_path / "specs.pkl"), str(tmp_path / f"out{i}.json")]
        cmd.append(str(tmp_path / "claims"))
        procs.append(subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    results = []
    for i, proc in enumerate(procs):
        output = proc.communicate(timeout=600)[0].decode(errors="replace")
        assert proc.returncode == 0, f"compile worker {i} crashed:\n{output[-4000:]}"
        results += json.loads((tmp_path / f"out{i}.json").read_text())
    assert len(list((tmp_path / "claims").iterdir())) == len(specs), "a spec no worker compiled"
    return results


def test_every_kernel_compiles_for_sm90(recorder: Recorder, tmp_path: Path) -> None:
    start = time.perf_counter()
    with _backend.poison_outputs(False):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            _exercise_ops(dtype, ffn=dtype != torch.bfloat16)
    recorded = time.perf_counter() - start
    missing = _jit_functions() - recorder.seen - COMPILED_ONLY
    assert not missing, f"@triton.jit functions no recorded call reaches: {sorted(missing)}"

    specs = sorted(recorder.specs.values(), key=lambda s: (s["module"], s["name"], s["key"]))
    results = _compile(specs, tmp_path)
    print(f"\nrecorded {len(specs)} specialisations of {len({s['name'] for s in specs})} kernels in {recorded:.0f} s;")
    print(f"compiled for sm_90 in {time.perf_counter() - start - recorded:.0f} s ({WORKERS} processes)")
    for res in sorted(results, key=lambda r: r["name"]):
        status = "FAILED" if "error" in res else f"{res.get('regs', '?'):>3} regs"
        spills = f"spill stores/loads {res.get('spill_stores', '?')}/{res.get('spill_loads', '?')} B"
        print(f"  {res['name']:<34} {status}  {spills}  {res['seconds']:5.1f} s")
    failed = {r["key"]: r["error"] for r in results if "error" in r}
    assert not failed, "kernels that do not compile for sm_90:\n" + "\n\n".join(f"{k}\n{e}" for k, e in failed.items())
