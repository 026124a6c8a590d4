"""Float64 ground truth of one training step of the gated ReLU block, written product by product: the formulas the
sparse kernels implement, each one checked against torch autograd in the tests.

Forward, for x [M, K], W_g and W_u [N, K] (``nn.Linear`` weights), W_d [K, N] and a gate ``activation`` of
:data:`ACTIVATIONS` (as ``twell_mlp``'s; ``t``: FATReLU's threshold, 0 otherwise):

* ``pre = x W_g^T + b_g``, ``fired = pre > t``, ``h_g = pre where fired, else 0``  (the gate: the one dense product;
  ReLU and dReLU: ``t = 0``, ``h_g = relu(pre)``; FATReLU: the value unshifted)
* ``h_u = x W_u^T + b_u``, and ``a_u = h_u`` (dReLU: ``relu(h_u)``)  (needed only where the gate fired)
* ``h = h_g * a_u``, ``y = h W_d^T + b_d``
* ``l1 = sum(h_g) / (M * N)``: the gate activations' L1 norm **per element**, so a coefficient means the same at
  any batch or layer size (``l1_on="gate"``, the default); with ``l1_on="hidden"`` the TwELL paper's term (its eq.
  2, per layer) on the hidden representation, ``l1 = sum(|h|) / (M * N)``, normalised alike.

Backward, for ``dy`` [M, K] and ``dl1`` (the loss's gradient with respect to ``l1``, i.e. the L1 coefficient):

* ``dh = dy W_d``                                         (needed only on the pattern)
* ``dh_u = dh * h_g * a_u'``, ``dpre = (dh * a_u + dl1 / (M * N)) * [fired]`` (``a_u' = 1``; dReLU: ``[h_u > 0]``,
  as torch's relu differentiates; FATReLU's gate differentiates to 1 where it fired, 0 elsewhere)
* ``l1_on="hidden"``: ``dh`` gains ``dl1 / (M * N) * sign(h)`` before the chain rule instead, so ``dh_u = (dh + c *
  sign(a_u)) * h_g * a_u'`` and ``dpre = (dh * a_u + c * |a_u|) * [fired]`` with ``c = dl1 / (M * N)`` (``sign(h) =
  sign(a_u)`` where the gate fired; both are zero off the pattern, so the term stays on it)
* ``dx = dh_u W_u + dpre W_g``
* ``dW_u = dh_u^T x``, ``dW_g = dpre^T x``, ``dW_d = dy^T h``; ``db_u``, ``db_g``, ``db_d``: column sums of
  ``dh_u``, ``dpre``, ``dy``.

Every product but the gate's forward is zero off the pattern ``fired``: eight of the nine run on it. (dReLU's
``h`` is zero where ``h_u <= 0`` too, but the gate's L1 term still has a gradient there: the step keeps the gate's
pattern.)

The non-gated block (``W_u`` None) is the same with ``h_u = 1``: ``h = h_g``, ``dpre = (dh + dl1 / (M * N)) *
[pre > 0]``, ``dx = dpre W_g``, and no up gradients (both L1 terms are then one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..twell.reference import ACTIVATIONS

# What the L1 term is taken on: the gate activations h_g, or the hidden representation h = h_g * h_u (the paper's)
L1_TERMS = ("gate", "hidden")


@dataclass
class StepGrads:
    """Gradients of one step (float64): x [M, K], the weights as given, the biases (None when absent)."""

    x: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor | None
    w_down: torch.Tensor
    b_gate: torch.Tensor | None
    b_up: torch.Tensor | None
    b_down: torch.Tensor | None


def _d(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.double()


@torch.no_grad()  # gradients by the formulas: no autograd graph (which would also hold the inputs' accumulators)
def hybrid_step_reference(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    dy: torch.Tensor,
    dl1: float = 0.0,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    l1_on: str = "gate",
    activation: str = "relu",
    threshold: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, StepGrads]:
    """(y [M, K], l1 (0-dim), gradients) in float64 for x [M, K] and the output gradient dy [M, K] (``w_up=None``:
    the non-gated block). ``l1_on``: ``"gate"`` (``l1`` on h_g) or ``"hidden"`` (on h = h_g * a_u). ``activation``
    and ``threshold``: the gate (module docstring)."""
    if l1_on not in L1_TERMS:
        raise ValueError(f"hybrid_step_reference: l1_on must be one of {', '.join(map(repr, L1_TERMS))}; got {l1_on!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"hybrid_step_reference: activation must be one of {ACTIVATIONS}; got {activation!r}")
    x, wg, wu, wd, dy = x.double(), w_gate.double(), _d(w_up), w_down.double(), dy.double()
    bg, bu, bd = _d(b_gate), _d(b_up), _d(b_down)
    M, N = x.shape[0], wg.shape[0]
    pre = x @ wg.t() + (bg if bg is not None else 0.0)
    fired = pre > (threshold if activation == "fatrelu" else 0.0)
    h_g = torch.where(fired, pre, 0.0)
    h_u = x @ wu.t() + (bu if bu is not None else 0.0) if wu is not None else torch.ones_like(h_g)
    u_slope = (h_u > 0).double() if activation == "drelu" else torch.ones_like(h_u)
    h_u = h_u * u_slope  # a_u
    h = h_g * h_u
    y = h @ wd.t() + (bd if bd is not None else 0.0)
    c = dl1 / max(M * N, 1)
    dh = dy @ wd
    if l1_on == "hidden":
        l1 = h.abs().sum() / max(M * N, 1)
        dh_l1 = dh + c * torch.sign(h)  # the L1 term's gradient joins h's before the chain rule
        dh_u = dh_l1 * h_g * u_slope
        dpre = torch.where(fired, dh_l1 * h_u, 0.0)
    else:
        l1 = h_g.sum() / max(M * N, 1)
        dh_u = dh * h_g * u_slope
        dpre = torch.where(fired, dh * h_u + c, 0.0)
    grads = StepGrads(
        x=dh_u @ wu + dpre @ wg if wu is not None else dpre @ wg,
        w_gate=dpre.t() @ x,
        w_up=dh_u.t() @ x if wu is not None else None,
        w_down=dy.t() @ h,
        b_gate=dpre.sum(0) if bg is not None else None,
        b_up=dh_u.sum(0) if bu is not None else None,
        b_down=dy.sum(0) if bd is not None else None,
    )
    return y, l1, grads
