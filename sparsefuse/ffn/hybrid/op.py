"""The training step of the gated ReLU block on the Hybrid format, as two ``torch.library`` ops (forward, backward)
joined by a registered autograd rule.

What the forward keeps for the backward is sparse: x, the gate and up activations on the gate's pattern in the
:class:`~sparsefuse.sparse.Hybrid` layout (ELL of ``width`` slots per token plus whole backup rows for the tokens
that overflow it), and no [M, N] tensor.

Products, and what runs them now (see :mod:`.reference` for the formulas):

=====================  ===============================================  ==========================================
product                on the pattern                                   runs on
=====================  ===============================================  ==========================================
gate ``x W_g^T``       dense (it finds the pattern)                     cuBLAS
up ``x W_u^T``         sampled where ``h_g > 0``                        cuBLAS, then gathered (a sampled kernel:
                                                                        to do)
down ``h W_d^T``       sparse rows                                      the core's gather-accumulate kernel; backup
                                                                        rows on cuBLAS
``dh = dy W_d``        sampled                                          cuBLAS, then gathered (to do)
``dx``                 sparse rows                                      the core's gather-accumulate kernel (x2)
``dW_u, dW_g, dW_d``   transposed sparse                                cuBLAS on the scattered [M, N] (to do)
=====================  ===============================================  ==========================================

Exactness: a token over ``width`` non-zeros is kept whole in the backup; when more tokens overflow than the backup
holds, the format is rebuilt with a backup that holds them all (reading how many spilled is this version's one
host sync per call; the counter :data:`REBUILDS` says how often a rebuild was needed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..._backend import empty_layout_like, on_tensor_device
from ...sparse import ELL, dense_to_hybrid, sparse_matmul, torch_sparse_matmul
from ..twell.reference import gate_activation

REBUILDS = {"calls": 0, "rebuilt": 0}  # forward calls, and those whose backup had to grow (every layer of this process)


def _l1_dtype(dtype: torch.dtype) -> torch.dtype:
    """The L1 term is summed in float32 at least (float64 for float64 inputs)."""
    return torch.promote_types(dtype, torch.float32)


def _slots_used(counts: torch.Tensor, width: int) -> torch.Tensor:
    """[M, width] bool: the ELL slots holding a value of a row that fits (an overflowed row lives in the backup)."""
    fits = counts <= width
    return (torch.arange(width, device=counts.device)[None, :] < counts[:, None]) & fits[:, None]


def _fitting(values: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor, n_cols: int) -> ELL:
    """The ELL of the rows that fit (overflowed rows' counts set to 0: their products come from the backup)."""
    return ELL(values, indices, counts.masked_fill(counts > values.shape[1], 0), n_cols)


def _product(sparse: ELL, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sparse @ weight`` [M, n_out]: the core's gather-accumulate kernel (float64, for gradient checks: the torch
    reference)."""
    if weight.dtype == torch.float64:
        return torch_sparse_matmul(sparse, weight).to(dtype)
    return sparse_matmul(sparse, weight, out_dtype=dtype)


def _backup_destinations(rows: torch.Tensor, garbage: int) -> torch.Tensor:
    """int64 destination row of each backup row: its matrix row, or ``garbage`` for an unused one."""
    return torch.where(rows >= 0, rows, garbage).long()


def _scatter(values: torch.Tensor, indices: torch.Tensor, backup: torch.Tensor, rows: torch.Tensor, n_cols: int):
    """Dense [M, N] from ELL values (zero in unused slots) and whole backup rows (``rows`` -1: unused)."""
    M = values.shape[0]
    dense = values.new_zeros(M + 1, n_cols)  # row M takes the unused backup rows
    dense[:M].scatter_add_(1, indices.long(), values)  # unused slots add 0 to column 0: exact, order-free
    if backup.shape[0]:
        dense.index_copy_(0, _backup_destinations(rows, M), backup)  # overflowed rows hold no ELL values
    return dense[:M]


def _rows_of(dense: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``dense[rows]`` for the used backup rows; unused ones (-1) read row 0, or zeros when there is no row."""
    if dense.shape[0] == 0:
        return dense.new_zeros(rows.shape[0], dense.shape[1])
    return dense[rows.clamp(min=0).long()]


def _add_rows(out: torch.Tensor, rows: torch.Tensor, part: torch.Tensor) -> None:
    """``out[rows[s]] += part[s]`` for the used backup rows (unused ones hold zeros and add them to row 0)."""
    if part.shape[0] and out.shape[0]:  # (no rows: nothing to add to, and row 0 does not exist)
        out.index_add_(0, rows.clamp(min=0).long(), part.to(out.dtype))


@torch.library.custom_op("sparsefuse::hybrid_mlp_fwd", mutates_args=())
@on_tensor_device
def hybrid_mlp_fwd_op(
    x2: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    b_up: torch.Tensor | None,
    w_down_t: torch.Tensor,
    b_down: torch.Tensor | None,
    width: int,
    backup_rows: int,
    hidden_l1: bool = False,
    activation: str = "relu",
    threshold: float = 0.0,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]:
    """x2 [M, K]; w_gate, w_up, w_down_t [N, K]. Returns y [M, K], l1 (0-dim, float32 or float64: the gate's mean
    per element; ``hidden_l1``: |h|'s, h = h_g * h_u, from the Hybrid parts), the saved Hybrid parts -- gate values,
    up values, indices [M, width] (int32), counts [M] (int32), gate backup, up backup [R, N], backup rows [R]
    (int32) -- and the gate's firing count per neuron [N] (int32). ``activation``, ``threshold``: the gate
    (``hybrid_mlp``'s): FATReLU's values above the threshold are the format's non-zeros; dReLU's up values are
    relu'd (the gate's firing is kept)."""
    M, N = x2.shape[0], w_gate.shape[0]
    pre = F.linear(x2, w_gate, b_gate)
    h_gate = gate_activation(pre, threshold)  # (checked: non-zero for FATReLU only)
    hybrid = dense_to_hybrid(h_gate, width, backup_rows)
    REBUILDS["calls"] += 1
    if M and backup_rows < M:
        spilled = int(hybrid.spilled())  # this version's one host sync
        if spilled:
            REBUILDS["rebuilt"] += 1
            hybrid = dense_to_hybrid(h_gate, width, backup_rows + spilled)
    ell, rows = hybrid.ell, hybrid.backup_rows
    used = _slots_used(ell.counts, width)
    pre_up = F.linear(x2, w_up, b_up)
    if activation == "drelu":
        pre_up = torch.relu(pre_up)
    g_vals = torch.where(used, ell.values, 0)
    u_vals = torch.where(used, pre_up.gather(1, ell.indices.long()), 0)
    valid = (rows >= 0)[:, None]
    g_backup = hybrid.backup
    u_backup = torch.where(valid, _rows_of(pre_up, rows), 0)
    h_vals, h_backup = g_vals * u_vals, g_backup * u_backup
    y = _product(_fitting(h_vals, ell.indices, ell.counts, N), w_down_t, x2.dtype)
    _add_rows(y, rows, F.linear(h_backup, w_down_t.t()))
    if b_down is not None:
        y = y + b_down
    if hidden_l1:  # the ELL slots of the rows that fit (zero elsewhere) and the backup rows: every fired pair once
        sums = h_vals.abs().sum(dtype=_l1_dtype(x2.dtype)) + h_backup.abs().sum(dtype=_l1_dtype(x2.dtype))
        l1 = sums / max(M * N, 1)
    else:
        l1 = h_gate.sum(dtype=_l1_dtype(x2.dtype)) / max(M * N, 1)
    fired = torch.zeros(N + 1, dtype=torch.int32, device=x2.device)
    fired.scatter_add_(0, torch.where(used, ell.indices, N).flatten().long(), used.flatten().to(torch.int32))
    neuron_counts = fired[:N] + (g_backup != 0).sum(0, dtype=torch.int32)
    return y, l1, g_vals, u_vals, ell.indices, ell.counts, g_backup, u_backup, rows, neuron_counts


@hybrid_mlp_fwd_op.register_fake
def _(x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down, width, backup_rows, hidden_l1=False, activation="relu",
      threshold=0.0):  # fmt: skip
    M, N = x2.shape[0], w_gate.shape[0]
    R = torch.library.get_ctx().new_dynamic_size()  # grows when more rows overflow than the backup holds
    slots = x2.new_empty(M, width)
    index = lambda *shape: torch.empty(*shape, dtype=torch.int32, device=x2.device)  # noqa: E731
    return (
        x2.new_empty(M, w_down_t.shape[1]),
        torch.empty((), dtype=_l1_dtype(x2.dtype), device=x2.device),
        slots,
        torch.empty_like(slots),
        index(M, width),
        index(M),
        x2.new_empty(R, N),
        x2.new_empty(R, N),
        index(R),
        index(N),
    )


@torch.library.custom_op("sparsefuse::hybrid_mlp_bwd", mutates_args=())
@on_tensor_device
def hybrid_mlp_bwd_op(
    dy: torch.Tensor,
    dl1: torch.Tensor,
    x2: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down_t: torch.Tensor,
    g_vals: torch.Tensor,
    u_vals: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    g_backup: torch.Tensor,
    u_backup: torch.Tensor,
    rows: torch.Tensor,
    hidden_l1: bool = False,
    activation: str = "relu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dx [M, K], dw_gate, dw_up, dw_down_t [N, K], db_gate, db_up [N], db_down [K]) of the forward's
    outputs' gradients dy [M, K] and dl1 (0-dim; ``hidden_l1``: the forward's term was on h; ``activation``: the
    forward's gate -- dReLU's up values are relu'd, so dh_u is zero where they are)."""
    M, N = x2.shape[0], w_gate.shape[0]
    dy = dy.to(x2.dtype)
    dh = F.linear(dy, w_down_t)  # [M, N]: dy W_d
    used = _slots_used(counts, g_vals.shape[1])
    valid = (rows >= 0)[:, None]
    dh_vals = torch.where(used, dh.gather(1, indices.long()), 0)
    dh_backup = torch.where(valid, _rows_of(dh, rows), 0)
    l1_grad = (dl1.to(_l1_dtype(x2.dtype)) / max(M * N, 1)).to(x2.dtype)
    if hidden_l1:  # |h|'s gradient joins h's (sign(h) = sign(h_u) where the gate fired; 0 elsewhere)
        dh_vals = dh_vals + l1_grad * torch.sign(u_vals)
        dh_backup = dh_backup + l1_grad * torch.sign(u_backup)
        l1_grad = torch.zeros_like(l1_grad)
    g_up_vals, g_up_backup = g_vals, g_backup  # dh_u = dh * h_g (dReLU: times relu's slope, up > 0)
    if activation == "drelu":
        g_up_vals, g_up_backup = torch.where(u_vals > 0, g_vals, 0), torch.where(u_backup > 0, g_backup, 0)
    du_vals, du_backup = dh_vals * g_up_vals, dh_backup * g_up_backup
    dpre_vals = torch.where(used, dh_vals * u_vals + l1_grad, 0)  # stored gate values are the fired ones
    dpre_backup = torch.where(g_backup != 0, dh_backup * u_backup + l1_grad, 0)
    dx = _product(_fitting(du_vals, indices, counts, N), w_up, x2.dtype)
    dx = dx + _product(_fitting(dpre_vals, indices, counts, N), w_gate, x2.dtype)
    _add_rows(dx, rows, F.linear(du_backup, w_up.t()) + F.linear(dpre_backup, w_gate.t()))
    du = _scatter(du_vals, indices, du_backup, rows, N)
    dpre = _scatter(dpre_vals, indices, dpre_backup, rows, N)
    h = _scatter(g_vals * u_vals, indices, g_backup * u_backup, rows, N)
    # each weight's gradient in that weight's layout, as the fake says (a row-major w_down's, w_down_t = w_down.t(),
    # is then written as the weight is laid out)
    return (
        dx,
        torch.mm(dpre.t(), x2, out=empty_layout_like(w_gate)),
        torch.mm(du.t(), x2, out=empty_layout_like(w_up)),
        torch.mm(h.t(), dy, out=empty_layout_like(w_down_t)),
        dpre.sum(0, dtype=torch.float32).to(x2.dtype),
        du.sum(0, dtype=torch.float32).to(x2.dtype),
        dy.sum(0, dtype=torch.float32).to(x2.dtype),
    )


@hybrid_mlp_bwd_op.register_fake
def _(dy, dl1, x2, w_gate, w_up, w_down_t, g_vals, u_vals, indices, counts, g_backup, u_backup, rows, hidden_l1=False,
      activation="relu"):  # fmt: skip
    N, K = w_gate.shape
    return (
        torch.empty_like(x2),
        empty_layout_like(w_gate),
        empty_layout_like(w_up),
        empty_layout_like(w_down_t),
        x2.new_empty(N),
        x2.new_empty(N),
        x2.new_empty(w_down_t.shape[1]),
    )


def _setup_context(ctx, inputs, output) -> None:
    x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down, width, backup_rows, *flags = inputs
    _, _, g_vals, u_vals, indices, counts, g_backup, u_backup, rows, _ = output
    ctx.save_for_backward(x2, w_gate, w_up, w_down_t, g_vals, u_vals, indices, counts, g_backup, u_backup, rows)
    ctx.has_bias = (b_gate is not None, b_up is not None, b_down is not None)
    ctx.hidden_l1 = bool(flags and flags[0])
    ctx.activation = flags[1] if len(flags) > 1 else "relu"


def _backward(ctx, dy, dl1, *unused):
    dx, dwg, dwu, dwd, dbg, dbu, dbd = hybrid_mlp_bwd_op(dy, dl1, *ctx.saved_tensors, ctx.hidden_l1, ctx.activation)
    has_g, has_u, has_d = ctx.has_bias
    grads = (dx, dwg, dbg if has_g else None, dwu, dbu if has_u else None, dwd, dbd if has_d else None)
    return *grads, None, None, None, None, None


hybrid_mlp_fwd_op.register_autograd(_backward, setup_context=_setup_context)
