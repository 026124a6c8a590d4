"""Synthetic gated-FFN weights and inputs whose ReLU gate activations have the statistics of a sparse ReLU LLM.

Random weights give ~50% non-zeros after a ReLU; the paper's L1-regularised 1.5B model (N = 5632) keeps 24-40
non-zeros per token on average, with a heavy tail (a few tokens fire several hundred neurons), large variation
across tokens, hot neurons shared by many tokens and ~30% of the neurons dead. This module reproduces those
statistics with ordinary dense weights plus an input shift, so the real kernels (which compute ``x @ W_gate^T``
themselves) see them:

    x[m]       = [c, 1, s_m * r_m]          r_m ~ N(0, I_{K-2}),  s_m = exp(token_spread * g_m)   (token "energy")
    W_gate[n]  = [-theta_n, -dead_n, w_n]   w_n: a random unit vector,  theta_n = exp(neuron_spread * h_n) > 0
    pre[m, n]  = x[m] . W_gate[n] = s_m * z_mn - c * theta_n - dead_n,      z_mn ~ N(0, 1)

so neuron n fires for token m with probability ``Phi(-(c * theta_n) / s_m)``: log-normal token energies make the
per-token count heavy-tailed, log-normal thresholds make some neurons hot and others rare, and ``dead_n`` (1e3 for
a ``dead_fraction`` of the neurons, else 0) switches neurons off for good. The shift ``c`` (the first input
feature) is solved by bisection for the requested mean non-zeros per token, so one set of weights serves every
sparsity level (``c < 0`` reaches densities above 50% of the live neurons). ``W_up`` and ``W_down`` are plain
Gaussian (their values do not change the cost).

The mean is exact in expectation over the token distribution; a batch's realised mean varies by a few percent
(the heavy tail). Defaults (``token_spread=0.35``, ``neuron_spread=0.25``, ``dead_fraction=0.3``) at N = 5632 and
mean 30, 8192 tokens: median ~8 non-zeros per token, p90 ~80, p99 ~270, max ~750; the hottest 10% of the neurons
take ~45% of all firings (see :func:`gate_statistics`).
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["SyntheticFFN", "synthetic_ffn", "gate_statistics"]

_DEAD_OFFSET = 1e3


def resolve_device(fn: str, device: str | torch.device | int | None) -> torch.device:
    """``device`` as a torch.device; None: CUDA when available, else the CPU (so the builders run on any machine
    as called). A device torch cannot allocate on (a GPU absent or not compiled in, a bad name) is a ValueError
    naming the argument, where torch would fail later with an AssertionError or RuntimeError deep in its init."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device, int)) or isinstance(device, bool):
        raise TypeError(f"{fn}: device must be a str, torch.device or None; got {type(device).__name__}")
    try:
        resolved = torch.device(device)
        torch.empty(0, device=resolved)  # the device exists: fails here, not halfway through the build
    except (RuntimeError, AssertionError) as e:
        raise ValueError(
            f"{fn}: device={device!r} is not usable on this machine ({e}); "
            "device=None picks CUDA when available, else the CPU"
        ) from None
    return resolved


def _hermite_nodes(n: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes and weights of E[f(g)], g ~ N(0, 1) (probabilists' Gauss-Hermite)."""
    import numpy as np

    nodes, weights = np.polynomial.hermite_e.hermegauss(n)
    return torch.from_numpy(nodes), torch.from_numpy(weights / weights.sum())


@dataclasses.dataclass
class SyntheticFFN:
    """Weights of a gated FFN in ``nn.Linear`` layouts (``w_down`` stored column-major, as sparsefuse prefers) and
    the per-neuron parameters of the generator; :meth:`make_input` draws tokens for a target sparsity."""

    w_gate: torch.Tensor  # [N, K]
    w_up: torch.Tensor  # [N, K]
    w_down: torch.Tensor  # [K, N], strides (1, K)
    theta: torch.Tensor  # [N] float64 (CPU), thresholds of the live neurons
    dead: torch.Tensor  # [N] bool (CPU)
    token_spread: float
    seed: int

    @property
    def hidden_size(self) -> int:
        return self.w_gate.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.w_gate.shape[0]

    def expected_nnz(self, shift: float) -> float:
        """Expected mean non-zeros per token for input shift ``c``: ``n_live * E[Phi(-c * theta / s)]`` over the
        live neurons' thresholds and the log-normal token energies (Gauss-Hermite quadrature over log s)."""
        nodes, weights = _hermite_nodes()
        theta = self.theta[~self.dead]  # [n_live]
        scale = torch.exp(self.token_spread * nodes)  # [Q] token energies at the quadrature nodes
        p = torch.special.ndtr(-(shift * theta[None, :]) / scale[:, None])  # [Q, n_live]
        return float((weights[:, None] * p).sum())

    def solve_shift(self, mean_nnz: float) -> float:
        """The input shift ``c`` giving ``mean_nnz`` expected non-zeros per token (bisection; decreasing in c)."""
        n_live = int((~self.dead).sum())
        if not 0 < mean_nnz < n_live:
            raise ValueError(f"SyntheticFFN: mean_nnz must be in (0, {n_live}) (the live neurons); got {mean_nnz}")
        lo, hi = -50.0, 50.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if self.expected_nnz(mid) > mean_nnz else (lo, mid)
        return 0.5 * (lo + hi)

    def make_input(self, M: int, mean_nnz: float, *, seed: int | None = None) -> torch.Tensor:
        """x [M, K] in the weights' dtype/device whose gate fires ~``mean_nnz`` neurons per token on average."""
        K = self.hidden_size
        device, dtype = self.w_gate.device, self.w_gate.dtype
        g = torch.Generator(device="cpu").manual_seed(self.seed + 7 if seed is None else seed)
        token_scale = torch.exp(self.token_spread * torch.randn(M, generator=g, dtype=torch.float64))
        shift = self.solve_shift(mean_nnz)
        gd = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
        x = torch.randn(M, K, generator=gd, device=device, dtype=torch.float32)
        x[:, 2:] *= token_scale.to(device=device, dtype=torch.float32)[:, None]
        x[:, 0] = shift
        x[:, 1] = 1.0
        return x.to(dtype)


def synthetic_ffn(
    hidden_size: int,
    intermediate_size: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
    seed: int = 0,
    token_spread: float = 0.35,
    neuron_spread: float = 0.25,
    dead_fraction: float = 0.3,
) -> SyntheticFFN:
    """Weights for :class:`SyntheticFFN` (see the module docstring for the construction and the defaults) on
    ``device`` (None: CUDA when available, else the CPU)."""
    device = resolve_device("synthetic_ffn", device)
    K, N = hidden_size, intermediate_size
    if K < 3 or N < 1:
        raise ValueError(
            f"synthetic_ffn: need hidden_size >= 3 (two shift features) and intermediate_size >= 1; got {K}, {N}"
        )
    if not 0.0 <= dead_fraction < 1.0:
        raise ValueError(f"synthetic_ffn: dead_fraction must be in [0, 1); got {dead_fraction}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    theta = torch.exp(neuron_spread * torch.randn(N, generator=g, dtype=torch.float64))
    dead = torch.rand(N, generator=g) < dead_fraction
    gd = torch.Generator(device=device).manual_seed(seed + 3)
    w_gate = torch.randn(N, K, generator=gd, device=device, dtype=torch.float32)
    w_gate[:, 2:] /= w_gate[:, 2:].norm(dim=1, keepdim=True)  # z = r . w ~ N(0, 1) for r ~ N(0, I)
    w_gate[:, 0] = -theta.to(device=device, dtype=torch.float32)
    w_gate[:, 1] = -_DEAD_OFFSET * dead.to(device=device, dtype=torch.float32)
    w_up = torch.randn(N, K, generator=gd, device=device, dtype=torch.float32) / K**0.5
    w_down_t = torch.randn(N, K, generator=gd, device=device, dtype=torch.float32) / N**0.5  # row n = W_down[:, n]
    return SyntheticFFN(w_gate.to(dtype), w_up.to(dtype), w_down_t.to(dtype).t(), theta, dead, token_spread, seed)


def gate_statistics(counts: torch.Tensor) -> dict[str, float]:
    """Summary of per-token non-zeros from TwELL counts [M, n_tiles] (or per-token counts [M]): mean, median,
    p90, p99, max, and the fraction of tokens above 4x the mean."""
    per_token = (counts.sum(dim=1) if counts.dim() == 2 else counts).double().cpu()
    if per_token.numel() == 0:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "frac_above_4x_mean": 0.0}
    mean = float(per_token.mean())
    q = torch.quantile(per_token, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    return {
        "mean": mean,
        "median": float(q[0]),
        "p90": float(q[1]),
        "p99": float(q[2]),
        "max": float(per_token.max()),
        "frac_above_4x_mean": float((per_token > 4 * mean).double().mean()),
    }
