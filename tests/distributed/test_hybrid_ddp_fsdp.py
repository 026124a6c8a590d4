"""The sparse training layer under the engines users run: DDP and FSDP2 (``fully_shard``), two processes on the
CPU with the gloo backend. Each rank takes half of the batch; the gradients after one step must equal one process's
on the whole batch (the loss and the L1 term are means, so DDP's gradient average is the full-batch gradient)."""

import gc
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import loopback_env

import sparsefuse._backend
from sparsefuse.nn import SparseGatedMLP

K, N, M = 16, 48, 12


def _module(seed: int = 0, **options) -> SparseGatedMLP:
    torch.manual_seed(seed)
    # row-major down_proj: FSDP2 shards contiguous parameters only
    mlp = SparseGatedMLP(K, N, bias=True, train_method="hybrid", train_width=4, down_layout="row", **options)
    with torch.no_grad():
        mlp.gate_proj.bias.fill_(-0.4)
    return mlp


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(M, K, generator=g), torch.randn(M, K, generator=g)


def _loss(mlp_out: torch.Tensor, target: torch.Tensor, l1: torch.Tensor) -> torch.Tensor:
    return (mlp_out - target).square().mean() + 0.3 * l1


def _worker(rank: int, world: int, init: str, engine: str, out_path: str) -> None:
    # a peer that never connects fails the test in a minute, not in the default 30
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        _step(rank, world, engine, out_path)
        # the wrapped model gone before its group: a DDP reducer freed after destroy_process_group can hang its
        # process at exit (its hooks hold it in reference cycles, hence the collection)
        gc.collect()
    finally:
        dist.destroy_process_group()


def _step(rank: int, world: int, engine: str, out_path: str) -> None:
    """One step of the wrapped module on this rank's half of the batch; rank 0 saves the (whole) gradients."""
    mlp = _module()
    x, target = _batch()
    part = slice(rank * M // world, (rank + 1) * M // world)
    if engine == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(mlp)
        y = model(x[part])
    else:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        # a CPU mesh: left to itself, fully_shard would move the parameters to a visible GPU
        model = fully_shard(mlp, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
        y = model(x[part])
    _loss(y, target[part], mlp.last_l1).backward()
    grads = {}
    for name, p in mlp.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):  # FSDP2 shards parameters and gradients as DTensors
            g = g.full_tensor()
        grads[name] = g.detach().clone()
    if rank == 0:
        torch.save(grads, out_path)


def _run_processes(fn, args: tuple, nprocs: int, seconds: float) -> None:
    """``mp.spawn`` with a deadline: processes still running after ``seconds`` are killed and the test fails."""
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + seconds
    while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{nprocs} gloo processes still running after {seconds} s")


def _skip_without_fsdp2() -> None:
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch >= 2.6")
    from torch.distributed import fsdp

    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard")


def _one_process_step() -> tuple[SparseGatedMLP, torch.Tensor, torch.Tensor]:
    """The module after one step on the whole batch in this process (its gradients are the reference), the batch."""
    mlp = _module()
    x, target = _batch()
    _loss(mlp(x), target, mlp.last_l1).backward()
    return mlp, x, target


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_two_processes_match_one(engine, tmp_path, monkeypatch):
    if engine == "fsdp2":
        _skip_without_fsdp2()
    mlp, x, target = _one_process_step()
    single = {name: p.grad for name, p in mlp.named_parameters()}
    out_path = str(tmp_path / "grads.pt")
    init = f"file://{tmp_path / 'rendezvous'}"
    for name, value in loopback_env().items():  # the spawned processes start from this environment
        monkeypatch.setenv(name, value)
    _run_processes(_worker, (2, init, engine, out_path), nprocs=2, seconds=300)
    distributed = torch.load(out_path)
    assert distributed.keys() == single.keys()
    for name, g in single.items():
        torch.testing.assert_close(distributed[name], g, rtol=1e-5, atol=1e-6, msg=name)


def _graph_steps_worker(rank: int, world: int, init: str, out_path: str) -> None:
    """Four FSDP2 steps of a module asked to replay its step from CUDA graphs (the interpreter's stand-in for them
    on the CPU); rank 0 saves the last step's gradients and how many captures were taken."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        from sparsefuse import planning
        from sparsefuse.ffn.hybrid import graphed

        # the block step (the one that replays) at this small layer's firing
        with planning(hybrid_mlp={"dense_above": 1.0}):
            mlp = _module(train_cuda_graph=True)
            model = fully_shard(mlp, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"), reshard_after_forward=False)
            x, target = _batch()
            part = slice(rank * M // world, (rank + 1) * M // world)
            for _ in range(4):
                for p in mlp.parameters():
                    p.grad = None
                _loss(model(x[part]), target[part], mlp.last_l1).backward()
            grads = {name: p.grad.full_tensor().detach().clone() for name, p in mlp.named_parameters()}
            if rank == 0:
                # keyed by the gathered gate weight (a Parameter FSDP2 keeps, its storage moved), not the sharded one
                moves = max(layer.moves for layer in graphed._LAYERS.values())
                events = {k: graphed.GRAPH_EVENTS[k] for k in ("capture", "copied replay")}
                torch.save({"grads": grads, "events": events, "moves": moves}, out_path)
        gc.collect()
    finally:
        dist.destroy_process_group()


# The CPU stand-in for CUDA graphs replays interpreted Triton kernels; in the GPU suite (no TRITON_INTERPRET) CPU
# tensors run the torch reference, which captures nothing. On GPUs the bench's FSDP2 rows at the 1.5B shape, whose
# FFN steps are replayed by default, cover the same replay (their notes say "weights copied in").
@pytest.mark.skipif(
    not sparsefuse._backend.INTERPRET, reason="the CPU stand-in for CUDA graphs needs TRITON_INTERPRET=1"
)
def test_fsdp2_regathered_weights_replay_copies(tmp_path, monkeypatch):
    """FSDP2 gathers a unit's weights into fresh storage every step: a module asked for CUDA graphs captures in place
    once or twice, then once more reading copies of its weights, which its later steps replay; the gradients equal
    one process's."""
    _skip_without_fsdp2()
    mlp, _, _ = _one_process_step()
    for name, value in loopback_env().items():
        monkeypatch.setenv(name, value)
    out_path = str(tmp_path / "grads.pt")
    _run_processes(_graph_steps_worker, (2, f"file://{tmp_path / 'rendezvous'}", out_path), nprocs=2, seconds=300)
    saved = torch.load(out_path)
    from sparsefuse.ffn.hybrid.choice import TrainKnobs

    events = saved["events"]
    # captured in place, then once more reading the copied weights
    assert saved["moves"] > TrainKnobs().move_limit and 2 <= events["capture"] <= 3
    assert events["copied replay"] >= 1  # the last step replayed the copied capture
    for name, p in mlp.named_parameters():
        torch.testing.assert_close(saved["grads"][name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def _report_worker(rank: int, world: int, init: str, out_path: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        from sparsefuse.ffn.hybrid import sparsity_stats

        tokens, neurons = _rank_counts(rank)
        stats = sparsity_stats(tokens, neurons, group=dist.group.WORLD)
        if rank == 0:
            torch.save({k: v.clone() for k, v in stats.items()}, out_path)
    finally:
        dist.destroy_process_group()


def _rank_counts(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's token counts (ranks of different lengths, rank 1's heavier) and neuron counts (each rank firing
    a different half of the neurons: no neuron is dead over both)."""
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 10 + 90 * rank, (7 + 5 * rank,), generator=g, dtype=torch.int32)
    neurons = torch.zeros(8, dtype=torch.int32)
    neurons[rank * 4 : rank * 4 + 4] = 3
    return tokens, neurons


def test_sparsity_report_over_ranks_is_the_global_batchs(tmp_path, monkeypatch):
    """With ``group``, two processes' statistics are those of their batches put together: the p99 and max from every
    token, the dead fraction from the summed neuron counts (each rank alone sees half of the neurons dead)."""
    from sparsefuse.ffn.hybrid import sparsity_stats

    for name, value in loopback_env().items():
        monkeypatch.setenv(name, value)
    out_path = str(tmp_path / "stats.pt")
    _run_processes(_report_worker, (2, f"file://{tmp_path / 'rendezvous'}", out_path), nprocs=2, seconds=120)
    (t0, n0), (t1, n1) = _rank_counts(0), _rank_counts(1)
    expected = sparsity_stats(torch.cat([t0, t1]), n0 + n1)
    got = torch.load(out_path)
    assert got.keys() == expected.keys() and float(got["dead_fraction"]) == 0.0
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, msg=key)
    assert float(sparsity_stats(t0, n0)["dead_fraction"]) == 0.5
