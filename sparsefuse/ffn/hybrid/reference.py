"""Float64 ground truth of one training step of the gated ReLU block, written product by product: the formulas the
sparse kernels implement, each one checked against torch autograd in the tests.

Forward, for x [M, K], W_g and W_u [N, K] (``nn.Linear`` weights), W_d [K, N]:

* ``pre = x W_g^T + b_g``, ``h_g = relu(pre)``            (the gate: the one dense product)
* ``h_u = x W_u^T + b_u``                                 (needed only where ``h_g > 0``)
* ``h = h_g * h_u``, ``y = h W_d^T + b_d``
* ``l1 = sum(h_g) / (M * N)``: the gate activations' L1 norm **per element**, so a coefficient means the same at
  any batch or layer size (``l1_on="gate"``, the default); with ``l1_on="hidden"`` the TwELL paper's term (its eq.
  2, per layer) on the hidden representation, ``l1 = sum(|h|) / (M * N)``, normalised alike.

Backward, for ``dy`` [M, K] and ``dl1`` (the loss's gradient with respect to ``l1``, i.e. the L1 coefficient):

* ``dh = dy W_d``                                         (needed only on the pattern)
* ``dh_u = dh * h_g``, ``dpre = (dh * h_u + dl1 / (M * N)) * [pre > 0]``
* ``l1_on="hidden"``: ``dh`` gains ``dl1 / (M * N) * sign(h)`` before the chain rule instead, so ``dh_u = (dh + c *
  sign(h_u)) * h_g`` and ``dpre = (dh * h_u + c * |h_u|) * [pre > 0]`` with ``c = dl1 / (M * N)`` (``sign(h) =
  sign(h_u)`` where the gate fired; both are zero off the pattern, so the term stays on it)
* ``dx = dh_u W_u + dpre W_g``
* ``dW_u = dh_u^T x``, ``dW_g = dpre^T x``, ``dW_d = dy^T h``; ``db_u``, ``db_g``, ``db_d``: column sums of
  ``dh_u``, ``dpre``, ``dy``.

Every product but the gate's forward is zero off the pattern ``pre > 0``: eight of the nine run on it.

The non-gated block (``W_u`` None) is the same with ``h_u = 1``: ``h = h_g``, ``dpre = (dh + dl1 / (M * N)) *
[pre > 0]``, ``dx = dpre W_g``, and no up gradients (both L1 terms are then one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
) -> tuple[torch.Tensor, torch.Tensor, StepGrads]:
    """(y [M, K], l1 (0-dim), gradients) in float64 for x [M, K] and the output gradient dy [M, K] (``w_up=None``:
    the non-gated block). ``l1_on``: ``"gate"`` (``l1`` on h_g) or ``"hidden"`` (on h = h_g * h_u)."""
    if l1_on not in L1_TERMS:
        raise ValueError(f"hybrid_step_reference: l1_on must be one of {', '.join(map(repr, L1_TERMS))}; got {l1_on!r}")
    x, wg, wu, wd, dy = x.double(), w_gate.double(), _d(w_up), w_down.double(), dy.double()
    bg, bu, bd = _d(b_gate), _d(b_up), _d(b_down)
    M, N = x.shape[0], wg.shape[0]
    pre = x @ wg.t() + (bg if bg is not None else 0.0)
    fired = pre > 0
    h_g = torch.where(fired, pre, 0.0)
    h_u = x @ wu.t() + (bu if bu is not None else 0.0) if wu is not None else torch.ones_like(h_g)
    h = h_g * h_u
    y = h @ wd.t() + (bd if bd is not None else 0.0)
    c = dl1 / max(M * N, 1)
    dh = dy @ wd
    if l1_on == "hidden":
        l1 = h.abs().sum() / max(M * N, 1)
        dh_l1 = dh + c * torch.sign(h)  # the L1 term's gradient joins h's before the chain rule
        dh_u = dh_l1 * h_g
        dpre = torch.where(fired, dh_l1 * h_u, 0.0)
    else:
        l1 = h_g.sum() / max(M * N, 1)
        dh_u = dh * h_g
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
