"""Accuracy checks shared by the test suite and ``python -m sparsefuse check``.

The bound for an output element follows flash-attention's rule, applied per element: a kernel may be at most twice
as far from the float64 reference as plain PyTorch computing the same expression in the low-precision dtype, plus
a rounding allowance of that dtype:

    |ours - ref64| <= 2 * |torch_lowp - ref64| + eps(dtype) * (2 * |ref64| + max|ref64|) + extra_abs

NaN must appear exactly where the reference has NaN, and infinities must match (a reference value beyond the
dtype's range counts as an infinity of its sign).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def dtype_eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


@dataclass
class Comparison:
    ok: bool
    max_abs_error: float
    max_rel_error: float  # max |ours - ref| / max |ref|
    n_bad: int
    message: str


def compare_to_reference(
    ours: torch.Tensor,
    ref64: torch.Tensor,
    torch_lowp: torch.Tensor | None = None,
    *,
    dtype: torch.dtype | None = None,
    extra_abs: float | torch.Tensor = 0.0,
    name: str = "output",
) -> Comparison:
    """Elementwise check of ``ours`` against a float64 reference (see module docstring for the bound).

    ``dtype`` is the precision the kernel was asked to deliver (defaults to ``ours.dtype``); ``torch_lowp`` is plain
    torch's result in that dtype (omit it where torch has no comparable expression)."""
    dtype = dtype or ours.dtype
    if ours.shape != ref64.shape:
        return Comparison(
            False,
            float("inf"),
            float("inf"),
            ours.numel(),
            f"{name}: shape {list(ours.shape)} != reference {list(ref64.shape)}",
        )
    ours64, ref64 = ours.detach().to("cpu", torch.float64), ref64.detach().to("cpu", torch.float64)
    # A value beyond the dtype's range is correctly delivered as an infinity of the same sign.
    finfo = torch.finfo(dtype)
    overflow = ref64.abs() > finfo.max * (1 + finfo.eps / 2)
    ref64 = torch.where(overflow, ref64.sign() * float("inf"), ref64)
    nan_ours, nan_ref = torch.isnan(ours64), torch.isnan(ref64)
    if not torch.equal(nan_ours, nan_ref):
        n = int((nan_ours != nan_ref).sum())
        where = (nan_ours & ~nan_ref).nonzero()[:3].tolist()
        return Comparison(
            False,
            float("nan"),
            float("nan"),
            n,
            f"{name}: {n} NaN mismatches (unexpected NaN at {where}; unwritten output?)",
        )
    inf_ref = torch.isinf(ref64)
    if not torch.equal(ours64[inf_ref], ref64[inf_ref]) or bool(torch.isinf(ours64[~inf_ref]).any()):
        return Comparison(False, float("inf"), float("inf"), 1, f"{name}: infinities differ from the reference")
    finite = torch.isfinite(ref64)
    o, r = ours64[finite], ref64[finite]
    if r.numel() == 0:
        return Comparison(True, 0.0, 0.0, 0, f"{name}: ok (no finite elements)")
    err = (o - r).abs()
    eps = dtype_eps(dtype)
    scale = float(r.abs().max())
    if isinstance(extra_abs, torch.Tensor):  # per element (e.g. accumulation_allowance)
        extra_abs = extra_abs.detach().to("cpu", torch.float64).expand_as(ref64)[finite]
    tol = eps * (2 * r.abs() + scale) + extra_abs
    if torch_lowp is not None:
        tol = tol + 2 * (torch_lowp.detach().to("cpu", torch.float64)[finite] - r).abs().nan_to_num(0.0)
    bad = err > tol
    max_abs = float(err.max())
    max_rel = max_abs / scale if scale > 0 else max_abs
    if bool(bad.any()):
        i = int((err - tol).argmax())
        return Comparison(
            False,
            max_abs,
            max_rel,
            int(bad.sum()),
            f"{name}: {int(bad.sum())}/{r.numel()} elements out of tolerance; worst: ours={float(o[i])!r} "
            f"ref={float(r[i])!r} |err|={float(err[i]):.3g} > tol={float(tol[i]):.3g}",
        )
    return Comparison(True, max_abs, max_rel, 0, f"{name}: ok (max abs err {max_abs:.3g}, rel {max_rel:.3g})")


def accumulation_allowance(a: torch.Tensor, b: torch.Tensor, acc_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-element rounding allowance of ``a @ b`` summed in ``acc_dtype`` in an order other than torch's:
    Higham's bound for recursive summation, ``gamma_n * (|a| @ |b|)`` with ``gamma_n = n u / (1 - n u)``, n the most
    non-zero terms in a row of ``a`` and u the unit roundoff. Two correct kernels may differ by this much."""
    n = int((a != 0).sum(-1).max()) if a.numel() else 0
    u = torch.finfo(acc_dtype).eps / 2
    gamma = n * u / (1 - n * u)
    return gamma * (a.detach().double().abs().nan_to_num(0.0) @ b.detach().double().abs())


def assert_close_to_reference(ours, ref64, torch_lowp=None, **kwargs) -> Comparison:
    result = compare_to_reference(ours, ref64, torch_lowp, **kwargs)
    assert result.ok, result.message
    return result


def assert_norm_close_to_reference(ours, ref64, torch_lowp, *, dtype=None, name="output") -> float:
    """Whole-tensor bound for deep pipelines (a model's output), where per-element errors of two equally good
    computations are uncorrelated: ``||ours - ref|| <= 2 * ||torch_lowp - ref|| + eps(dtype) * ||ref||``.
    Returns ours' relative error."""
    dtype = dtype or ours.dtype
    ref = ref64.detach().to("cpu", torch.float64)
    err_ours = float((ours.detach().to("cpu", torch.float64) - ref).norm())
    err_torch = float((torch_lowp.detach().to("cpu", torch.float64) - ref).norm())
    bound = 2 * err_torch + dtype_eps(dtype) * float(ref.norm())
    assert err_ours <= bound, f"{name}: ||ours - ref|| = {err_ours:.3g} > {bound:.3g} (torch's error {err_torch:.3g})"
    return err_ours / max(float(ref.norm()), 1e-300)
