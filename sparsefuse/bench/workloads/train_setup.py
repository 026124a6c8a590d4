"""What the ``train`` workload's single-GPU and distributed modes (:mod:`.train`, :mod:`.train_dist`) share: the
model grid and the training step (see :mod:`.train` for what they measure)."""

from __future__ import annotations

import torch

MODEL_SHAPE: str | dict = "SparseLM-1.5B"  # a synthetic_llama shape: the paper's (tests use a tiny dict)
LAYERS = (28, 8)  # full depth, and a depth where compiling is affordable
SPARSITIES: tuple[float | None, ...] = (30.0, None)
BATCHES: list[tuple[int, int]] = [(4, 2048)]
L1_COEFFICIENT = 2e-5  # the TwELL paper's
QUICK = ((8,), (30.0,), [(4, 2048)])


class Trainer:
    """A model, its AdamW and (optionally) its compiled forward: one training step per call. ``forward``: the
    module the step calls, when it is not ``model`` itself (a ``DistributedDataParallel`` around it); the L1 term is
    read from ``model``'s layers either way. ``single_thread_backward``: the backward runs on the calling thread
    (``torch.autograd.set_multithreading_enabled(False)``) instead of autograd's per-GPU worker thread."""

    def __init__(
        self,
        model: torch.nn.Module,
        compiled: bool,
        l1: bool,
        forward: torch.nn.Module | None = None,
        single_thread_backward: bool = False,
    ) -> None:
        self.model = model.train()
        self.forward, self.compile_on_first_step = forward if forward is not None else model, compiled
        params = list(self.forward.parameters())
        # fused (one multi-tensor kernel per step): for plain CUDA tensors, and for FSDP2's sharded DTensors where
        # DTensor runs the fused kernel shard by shard (torch >= 2.6); the foreach implementation costs ~70-100 ms
        # of host time per step on DTensors at the 1.5B shape, enough to leave the GPU idle
        fused = all(p.is_cuda for p in params) and (
            all(type(p) is torch.nn.Parameter for p in params) or _torch_at_least(2, 6)
        )
        self.optimizer = torch.optim.AdamW(params, lr=0.0, fused=fused)
        self.l1 = l1
        self.single_thread_backward = single_thread_backward

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        from ...integrations.transformers import l1_loss

        loss = self.forward(input_ids=ids, labels=ids).loss
        if self.compile_on_first_step:  # one eager step first, as the docs tell users: auto's choices settle
            self.forward, self.compile_on_first_step = torch.compile(self.model), False
        if self.l1:
            loss = loss + L1_COEFFICIENT * l1_loss(self.model)
        with torch.autograd.set_multithreading_enabled(not self.single_thread_backward):
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        return loss.detach()


def _torch_at_least(major: int, minor: int) -> bool:
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    return version >= (major, minor)
