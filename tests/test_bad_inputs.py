"""Every row of docs/bad-inputs.md, as a test: each public function meets each class of bad or unusual input (wrong
dtype, a mix of dtypes, wrong shape, an unsupported device, an empty batch, NaN/inf, a non-contiguous tensor, an
invalid parameter) the way the table says -- a clear error naming the argument, or torch's own behaviour. A test also
holds the table and this file to the same rows."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import sparsefuse
from sparsefuse.activations.celu.reference import torch_celu
from sparsefuse.activations.snake.reference import torch_snake
from sparsefuse.ffn.hybrid import hybrid_mlp, hybrid_relu_mlp
from sparsefuse.ffn.twell.reference import torch_relu_mlp, torch_twell_mlp
from sparsefuse.norms.rmsnorm.reference import torch_rms_norm
from sparsefuse.rotary import apply_rotary_pos_emb, torch_apply_rotary_pos_emb
from sparsefuse.sae.decode.reference import torch_sparse_decode
from sparsefuse.sae.encode.reference import torch_jumprelu_encode
from sparsefuse.sae.topk.reference import torch_topk_encode
from sparsefuse.splade.head.reference import torch_splade_pool

DOC = Path(__file__).resolve().parent.parent / "docs" / "bad-inputs.md"
M, K, N, D, S = 6, 8, 16, 12, 32


def _r(*shape, device="cpu"):
    return torch.randn(*shape, device=device)


def _sparse(m, n, device):
    return torch.relu(_r(m, n, device=device)) * (torch.rand(m, n, device=device) < 0.3)


def _dense(result) -> torch.Tensor:
    """The comparable tensor of a result: the first of a tuple, an ELL made dense, a training step's y."""
    if isinstance(result, tuple):
        result = result[1] if isinstance(result[0], torch.Tensor) and not result[0].is_floating_point() else result[0]
    if hasattr(result, "to_dense"):
        return result.to_dense()
    return result


@dataclass
class Op:
    fn: Callable[..., Any]
    make: Callable[[torch.device], list]  # valid positional arguments
    reference: Callable[[list], torch.Tensor]  # float64, dense
    shape: tuple[Callable[[list], list], type, str]  # (break the shape, exception, message pattern)
    param: tuple[dict, type, str]  # (invalid keyword, exception, message pattern)
    mixed: tuple[
        int, type | torch.dtype, str
    ]  # (argument made fp16, exception or the documented output dtype, pattern)
    kwargs: dict = field(default_factory=dict)
    batch: Callable[[list], list] | None = None  # the arguments at batch 0 (default: the first one sliced)


def _topk_decode_args(device):
    acts = _sparse(M, S, device)
    idx = torch.topk(acts, 4).indices
    return [idx, acts.gather(1, idx), _r(S, D, device=device)]


def _topk_decode_reference(a):
    idx, vals, w = a
    return torch.einsum("mk,mkd->md", vals.double(), w.double()[idx])


OPS: dict[str, Op] = {
    "snake": Op(
        sparsefuse.snake,
        lambda dev: [_r(2, 3, 10, device=dev), torch.rand(3, device=dev) + 0.3],
        lambda a: torch_snake(a[0].double(), a[1].double()),
        (lambda a: [a[0], a[1][:2]], ValueError, r"alpha must have shape \[3\] or \[1, 3, 1\]"),
        ({"eps": "tiny"}, TypeError, "eps must be a Python float"),
        (1, torch.float32, ""),  # documented: alpha in any float dtype, output in x's
    ),
    "celu": Op(
        sparsefuse.celu,
        lambda dev: [_r(4, 10, device=dev)],
        lambda a: torch_celu(a[0].double()),
        (lambda a: [a[0].reshape(-1)[:0].reshape(0, 0, 0)], None, ""),  # any shape is valid: see the table
        ({"alpha": 0.0}, ValueError, "alpha must be non-zero"),
        (0, torch.float16, ""),  # one tensor: no mix possible (fp16 in, fp16 out)
    ),
    "sparse_decode": Op(
        sparsefuse.sparse_decode,
        lambda dev: [_sparse(M, S, dev), _r(S, D, device=dev)],
        lambda a: torch_sparse_decode(a[0].double(), a[1].double()),
        (lambda a: [a[0][:, :-1], a[1]], ValueError, "disagree on d_sae"),
        ({"method": "csr"}, ValueError, "method must be one of"),
        (1, TypeError, "feature_acts and W_dec must have the same dtype"),
    ),
    "topk_decode": Op(
        sparsefuse.topk_decode,
        _topk_decode_args,
        _topk_decode_reference,
        (lambda a: [a[0][:, :3], a[1], a[2]], TypeError, "top_indices must be int32/int64 with top_acts' shape"),
        ({"check_indices": True}, ValueError, r"top_indices must lie in \[0, 32\)"),  # with an id out of range
        (2, TypeError, "top_acts and W_dec must have the same dtype"),
        batch=lambda a: [a[0][:0], a[1][:0], a[2]],
    ),
    "jumprelu_encode": Op(
        sparsefuse.jumprelu_encode,
        lambda dev: [_r(M, D, device=dev), _r(D, S, device=dev), _r(S, device=dev), torch.rand(S, device=dev)],
        lambda a: torch_jumprelu_encode(*[t.double() for t in a]),
        (lambda a: [a[0][:, :-1], *a[1:]], ValueError, r"expected x \[\.\.\., d_in\], W_enc \[d_in, d_sae\]"),
        ({"max_l0": 0}, ValueError, "max_l0 must be a positive int"),
        (1, torch.float32, ""),  # documented: W_enc cast to x's dtype per tile
        kwargs={"max_l0": S},
    ),
    "topk_encode": Op(
        sparsefuse.topk_encode,
        lambda dev: [_r(M, D, device=dev), _r(D, S, device=dev), _r(S, device=dev), 4],
        lambda a: torch_topk_encode(a[0].double(), a[1].double(), a[2].double(), a[3])[1],
        (lambda a: [a[0][:, :-1], *a[1:]], ValueError, r"expected x \[\.\.\., d_in\], W_enc \[d_in, d_sae\]"),
        ({"activation": "gelu"}, ValueError, "activation must be one of"),
        (1, torch.float32, ""),
    ),
    "splade_pool": Op(
        sparsefuse.splade_pool,
        lambda dev: [_r(2, 5, D, device=dev), _r(S, D, device=dev), _r(S, device=dev)],
        lambda a: torch_splade_pool(a[0].double(), a[1].double(), a[2].double()),
        (lambda a: [a[0][..., :-1], *a[1:]], ValueError, r"weight must be \[vocab_size, hidden_size=11\]"),
        ({"pooling": "mean"}, ValueError, "pooling must be"),
        (1, TypeError, "hidden and weight must have the same dtype"),
    ),
    "twell_mlp": Op(
        sparsefuse.twell_mlp,
        lambda dev: [_r(M, K, device=dev), _r(N, K, device=dev), _r(N, K, device=dev), _r(K, N, device=dev)],
        lambda a: torch_twell_mlp(*[t.double() for t in a]),
        (lambda a: [a[0][:, :-1], *a[1:]], ValueError, r"x must be \[\.\.\., hidden_size=8\]"),
        ({"method": "sparse"}, ValueError, "method must be one of"),
        (1, TypeError, "w_gate must have x's dtype"),
    ),
    "twell_relu_mlp": Op(
        sparsefuse.twell_relu_mlp,
        lambda dev: [_r(M, K, device=dev), _r(N, K, device=dev), _r(K, N, device=dev)],
        lambda a: torch_relu_mlp(*[t.double() for t in a]),
        (lambda a: [a[0][:, :-1], *a[1:]], ValueError, r"x must be \[\.\.\., hidden_size=8\]"),
        ({"method": "auto"}, ValueError, "method must be 'twell' or 'dense'"),
        (1, TypeError, "w_up must have x's dtype"),
    ),
    "hybrid_mlp": Op(
        hybrid_mlp,
        lambda dev: [_r(M, K, device=dev), _r(N, K, device=dev), _r(N, K, device=dev), _r(K, N, device=dev)],
        lambda a: torch_twell_mlp(*[t.double() for t in a]),
        (lambda a: [a[0][:, :-1], *a[1:]], ValueError, r"x must be \[\.\.\., hidden_size=8\]"),
        ({"layout": "csr"}, ValueError, "layout must be one of"),
        (1, TypeError, "w_gate must have x's dtype"),
    ),
    "hybrid_relu_mlp": Op(
        hybrid_relu_mlp,
        lambda dev: [_r(M, K, device=dev), _r(N, K, device=dev), _r(K, N, device=dev)],
        lambda a: torch_relu_mlp(*[t.double() for t in a]),
        (lambda a: [a[0][:, :-1], *a[1:]], ValueError, r"x must be \[\.\.\., hidden_size=8\]"),
        ({"layout": "hybrid"}, ValueError, "layout must be 'auto', 'block' or 'dense'"),
        (1, TypeError, "w_up must have x's dtype"),
    ),
    "rms_norm": Op(
        lambda x, w, **kw: sparsefuse.rms_norm(x, x.shape[-1], w, **kw),
        lambda dev: [_r(M, K, device=dev), _r(K, device=dev)],
        lambda a: torch_rms_norm(a[0].double(), a[1].double(), torch.finfo(torch.float32).eps),
        (lambda a: [a[0], a[1][:-1]], ValueError, r"weight must have normalized_shape \[8\]"),
        ({"eps": -1.0}, ValueError, "eps must be >= 0"),
        (1, torch.float32, ""),  # documented: the promoted dtype, as LlamaRMSNorm's weight * normed
    ),
    "apply_rotary_pos_emb": Op(
        apply_rotary_pos_emb,
        lambda dev: [
            _r(2, 3, 4, K, device=dev),
            _r(2, 1, 4, K, device=dev),
            _r(1, 4, K, device=dev),
            _r(1, 4, K, device=dev),
        ],
        lambda a: torch_apply_rotary_pos_emb(*[t.double() for t in a])[0],
        (lambda a: [a[0][..., :-1], a[1][..., :-1], a[2][..., :-1], a[3][..., :-1]], ValueError, "must be even"),
        ({"unsqueeze_dim": 3}, ValueError, "unsqueeze_dim must be 1"),
        (1, TypeError, "k must have q's dtype"),
        batch=lambda a: [a[0][:0], a[1][:0], *a[2:]],
    ),
}
CLASSES = ("dtype", "mixed dtypes", "shape", "device", "empty batch", "NaN / inf", "non-contiguous", "parameter")


def _call(op: Op, args: list, **kw):
    return op.fn(*args, **{**op.kwargs, **kw})


def _check(name: str, cls: str, device: torch.device) -> None:
    op = OPS[name]
    torch.manual_seed(0)
    args = op.make(device)
    if cls == "dtype":
        bad = list(args)
        j = 1 if name == "topk_decode" else 0
        bad[j] = bad[j].long()
        with pytest.raises(TypeError, match="must have a floating dtype"):
            _call(op, bad)
    elif cls == "mixed dtypes":
        j, expected, pattern = op.mixed
        mixed = list(args)
        mixed[j] = mixed[j].half()
        if isinstance(expected, type):
            with pytest.raises(expected, match=pattern):
                _call(op, mixed)
        else:
            assert _dense(_call(op, mixed)).dtype in (expected, torch.int64)
    elif cls == "shape":
        breaker, exc, pattern = op.shape
        if exc is None:  # every shape is valid: an empty 3-d tensor comes back as one
            assert _dense(_call(op, breaker(args))).shape == (0, 0, 0)
        else:
            with pytest.raises(exc, match=pattern):
                _call(op, breaker(args))
    elif cls == "device":
        meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in args]
        with pytest.raises(ValueError, match="is on meta"):
            _call(op, meta)
    elif cls == "empty batch":
        empty = op.batch(args) if op.batch else [args[0][:0], *args[1:]]
        assert _dense(_call(op, empty)).shape[0] == 0
    elif cls == "NaN / inf":
        j = 1 if name == "topk_decode" else 0
        poisoned = list(args)
        t = poisoned[j].clone()
        t.view(-1)[0], t.view(-1)[t.numel() // 2] = float("nan"), float("inf")
        poisoned[j] = t
        ours, ref = _dense(_call(op, poisoned)).double().cpu(), op.reference(poisoned).cpu()
        if ref.shape != ours.shape:  # an ELL's dense form has the reference's shape; topk acts too
            ref = ref.reshape(ours.shape)
        assert torch.equal(torch.isnan(ours), torch.isnan(ref)), (ours, ref)
        assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    elif cls == "non-contiguous":
        j = 1 if name == "topk_decode" else 0
        strided = list(args)
        wide = torch.stack([args[j], args[j]], dim=-1).flatten(-2)  # each value twice, side by side
        strided[j] = wide[..., ::2]  # the same values at stride 2
        assert not strided[j].is_contiguous()
        # (the same values: equal up to the rounding of whichever method auto picks on each call)
        torch.testing.assert_close(_dense(_call(op, strided)), _dense(_call(op, args)))
    elif cls == "parameter":
        kw, exc, pattern = op.param
        bad = list(args)
        if name == "topk_decode":
            bad[0] = bad[0].clone()
            bad[0][0, 0] = S
        with pytest.raises(exc, match=pattern):
            _call(op, bad, **kw)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("name", list(OPS))
def test_bad_input(name, cls, device):
    _check(name, cls, device)


def _doc_rows() -> set[tuple[str, str]]:
    rows = set()
    for line in DOC.read_text().splitlines():
        match = re.match(r"^\| `(\w+)` \| ([^|]+?) \|", line)
        if match:
            rows.add((match.group(1), match.group(2).strip()))
    return rows


def test_the_table_and_the_tests_hold_the_same_rows():
    tested = {(name, cls) for name in OPS for cls in CLASSES}
    documented = _doc_rows()
    assert documented == tested, (sorted(documented - tested), sorted(tested - documented))


def test_zero_size_feature_dimensions(device):
    """A zero-size feature dimension (d_sae, d_in, hidden or k = 0) is a valid, empty sum: zeros of the right shape
    (docs/bad-inputs.md, "Zero-size dimensions")."""
    z = lambda *s: torch.zeros(*s, device=device)  # noqa: E731
    r = lambda *s: torch.randn(*s, device=device)  # noqa: E731
    for out, shape in [
        (sparsefuse.sparse_decode(z(3, 0), r(0, 8), method="fixed", max_l0=4), (3, 8)),
        (sparsefuse.sparse_decode(z(3, 0), r(0, 8)), (3, 8)),
        (sparsefuse.topk_decode(torch.zeros(3, 0, dtype=torch.long, device=device), z(3, 0), r(5, 8)), (3, 8)),
        (sparsefuse.jumprelu_encode(z(3, 0), z(0, 6), z(6), z(6) + 1, max_l0=4).to_dense(), (3, 6)),
        (sparsefuse.twell_mlp(z(3, 0), z(4, 0), z(4, 0), z(0, 4)), (3, 0)),
        (hybrid_mlp(r(3, 5), z(0, 5), z(0, 5), z(5, 0), layout="block").y, (3, 5)),
    ]:
        assert out.shape == shape and not bool(out.float().any()), (out.shape, shape)
