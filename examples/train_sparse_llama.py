"""Train a small ReLU Llama from scratch with an L1 penalty on its gate activations, on a corpus every machine has:
the Python standard library's own source files, as bytes (vocabulary 256, no tokenizer, no download).

    python examples/train_sparse_llama.py --size tiny --out runs/tiny     # a CPU smoke run (CI runs it)
    python examples/train_sparse_llama.py --size small --out runs/small   # a GPU run whose numbers mean something
    torchrun --nproc_per_node 2 examples/train_sparse_llama.py --distributed --size small --out runs/ddp
    torchrun --nproc_per_node 2 examples/train_sparse_llama.py --distributed --engine fsdp2 --size small --out runs/fsdp

With ``--distributed`` (launched by ``torchrun``) the model is wrapped in ``DistributedDataParallel`` (NCCL on GPUs,
gloo on CPUs), or with ``--engine fsdp2`` sharded by FSDP2 (``fully_shard`` per run of 3 decoder layers kept
gathered from forward to backward, then the root; the MLPs keep ``down_proj.weight`` row-major, as FSDP2 shards
contiguous parameters only), and each process trains on its share of the same global batch, so a run on P processes
follows the single-process run (same initialisation, batches and updates up to rounding); the logged loss and
sparsity are averaged over the processes, and process 0 writes the files.

Each run trains the same model from the same initialisation and batches once with no L1 and once per coefficient of
``--l1`` (comma-separated; each ramped in linearly over the first half of the steps), and writes to ``--out`` (after
each training, so a run cut short keeps what it finished):

* ``log.csv``: per step and run, the loss, the mean and p99 gate non-zeros per token (all layers), the step time;
* ``curves.png``: loss and non-zeros per token against the step, both runs;
* ``model-l1.pt``: the last L1 run's ``state_dict`` and config (a model whose sparsity was learned, for the
  inference benchmarks).

The MLPs are patched with :func:`sparsefuse.integrations.transformers.patch_llama` (``--train-method`` dense or
hybrid, ``--cuda-graph`` to replay the hybrid step from CUDA graphs); the L1 term is
:func:`sparsefuse.integrations.transformers.l1_loss`: each layer's per-element mean of its gate activations, summed
over layers, or with ``--l1-on hidden`` the TwELL paper's eq. 2, the per-element mean of |h| (h = gate * up)
averaged over layers, whose default coefficient is the paper's 2e-5 in its released code's per-token normalisation:
2e-5 * intermediate size per element (docs/training.md, "The L1 term").
"""

from __future__ import annotations

import argparse
import csv
import math
import sysconfig
import time
from pathlib import Path

import torch

# The paper's recommended coefficient, on the released code's per-token term (|h| summed over the N neurons, divided
# by the tokens M); the per-element term here takes it times N.
PAPER_L1_PER_TOKEN = 2e-5

SIZES = {
    # hidden, intermediate, layers, heads, context, batch, steps, learning rate, corpus bytes (the small run reads
    # the whole standard library: 10-30 MB of .py files, by Python version; 2000 steps of 32 x 512 bytes see 33 MB)
    "tiny": dict(hidden=64, inter=256, layers=2, heads=4, ctx=64, batch=8, steps=40, lr=3e-3, data=1 << 20),
    "small": dict(hidden=512, inter=1408, layers=8, heads=8, ctx=512, batch=32, steps=2000, lr=1e-3, data=1 << 27),
}


def _positive(text: str) -> int:
    """An argument that must be a positive integer (argparse names the option when this raises)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {value}")
    return value


def stdlib_bytes(limit: int) -> torch.Tensor:
    """Up to ``limit`` bytes of the standard library's ``.py`` files, in a fixed (sorted) order, as uint8."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    if not chunks:
        raise RuntimeError(f"no .py files found under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8)


def build_model(
    cfg: dict,
    device: torch.device,
    train_method: str,
    seed: int,
    down_layout: str = "column",
    cuda_graph: bool | None = None,
    l1_on: str = "gate",
) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparsefuse.integrations.transformers import patch_llama, patched_mlps

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=cfg["hidden"],
        intermediate_size=cfg["inter"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["heads"],
        max_position_embeddings=cfg["ctx"],
        hidden_act="relu",
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(device)
    model = patch_llama(model, train_method=train_method, down_layout=down_layout, train_cuda_graph=cuda_graph)
    for _, mlp in patched_mlps(model):
        mlp.l1_on = l1_on  # what each layer's L1 term is taken on: its gate activations or its hidden h
    return model


def _shard(model: torch.nn.Module, engine: str, device: torch.device) -> torch.nn.Module:
    """``model`` under the engine (``ddp`` or ``fsdp2``) over the process group already up."""
    import torch.distributed as dist

    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # 100 MB buckets and gradients kept as views of them: fewer all-reduces and no copies into the buckets, host
        # work the sparse step's backward cannot hide (docs/training.md, "Several GPUs")
        return DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=100,
            gradient_as_bucket_view=True,
        )
    from torch.distributed.device_mesh import DeviceMesh

    from sparsefuse.integrations.transformers import shard_llama_fsdp2

    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)  # on CPUs: left to itself it would take a GPU
    # units of 3 decoder layers kept gathered from forward to backward (docs/training.md, "Several GPUs")
    return shard_llama_fsdp2(model, mesh=mesh)


def _full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole ``state_dict`` (FSDP2's shards gathered: a collective, every process calls it)."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


def _world() -> tuple[int, int]:
    """(rank, world size): (0, 1) unless a process group is up."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _world_group():
    import torch.distributed as dist

    return dist.group.WORLD


def _mean_over_processes(values: list[float], device: torch.device) -> list[float]:
    rank, world = _world()
    if world == 1:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / world).tolist()


def train(cfg: dict, data: torch.Tensor, l1: float, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """One run; returns its log rows (every process returns the same, averaged over processes)."""
    from sparsefuse.integrations.transformers import l1_loss, sparsity_report

    rank, world = _world()
    if cfg["batch"] % world:
        raise ValueError(f"--distributed: the batch ({cfg['batch']}) must divide among {world} processes")
    layout = "row" if args.distributed and args.engine == "fsdp2" else "column"
    replay = {"auto": None, "on": True, "off": False}[args.cuda_graph]
    model = build_model(
        cfg, device, args.train_method, args.seed, down_layout=layout, cuda_graph=replay, l1_on=args.l1_on
    )
    # the paper's eq. 2 averages its layers' terms; the gate term is summed over them, as l1_loss does by default
    layers = "mean" if args.l1_on == "hidden" else "sum"
    inner = model
    if args.distributed:
        model = _shard(model, args.engine, device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed + 1)  # same batches for both runs
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    rows = []
    for step in range(cfg["steps"]):
        starts = torch.randint(0, data.numel() - cfg["ctx"] - 1, (cfg["batch"],), generator=gen)
        starts = starts[rank::world]  # this process's share of the global batch
        ids = torch.stack([data[s : s + cfg["ctx"]] for s in starts.tolist()]).long().to(device)
        lr_scale = min(1.0, (step + 1) / max(1, cfg["steps"] // 20))  # short warm-up
        for group in opt.param_groups:
            group["lr"] = cfg["lr"] * lr_scale
        coef = l1 * min(1.0, step / max(1, cfg["steps"] // 2))
        t0 = time.perf_counter()
        with autocast:
            out = model(ids, labels=ids)
            loss = out.loss + coef * l1_loss(inner, layers=layers)
        opt.zero_grad(set_to_none=True)
        # DDP's and FSDP2's hooks run their Python in the backward faster on this thread than on autograd's GPU
        # worker thread (docs/training.md, "Several GPUs")
        with torch.autograd.set_multithreading_enabled(not args.distributed):
            loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        if step % args.log_every == 0 or step == cfg["steps"] - 1:
            # over every process's tokens (each layer's p99 is the global batch's, not a mean of the processes')
            report = sparsity_report(inner, group=_world_group() if args.distributed else None)
            mean = sum(float(r["mean_nnz"]) for r in report.values()) / len(report)
            p99 = max(float(r["p99_nnz"]) for r in report.values())
            step_loss, mean, p99, seconds = _mean_over_processes([float(out.loss.detach()), mean, p99, seconds], device)
            rows.append(
                dict(
                    l1=l1,
                    step=step,
                    loss=step_loss,
                    mean_nnz=mean,
                    p99_nnz=p99,
                    nnz_fraction=mean / cfg["inter"],
                    step_ms=1e3 * seconds,
                )
            )
            if rank == 0:
                print(
                    f"l1={l1:g} step {step:5d} loss {step_loss:.4f} nnz/token {mean:7.1f} "
                    f"({100 * mean / cfg['inter']:.1f}%) {1e3 * seconds:.0f} ms",
                    flush=True,
                )
    if l1 > 0:
        state = _full_state_dict(inner)
        if rank == 0:
            torch.save({"config": inner.config.to_dict(), "state_dict": state}, args.out / "model-l1.pt")
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_nnz) = plt.subplots(1, 2, figsize=(11, 4))
    for l1 in sorted({r["l1"] for r in rows}):
        run = [r for r in rows if r["l1"] == l1]
        label = "L1 = 0" if l1 == 0 else f"L1 = {l1:g} (ramped)"
        ax_loss.plot([r["step"] for r in run], [r["loss"] for r in run], label=label)
        ax_nnz.plot([r["step"] for r in run], [100 * r["nnz_fraction"] for r in run], label=label)
    ax_loss.set(xlabel="step", ylabel="next-byte cross-entropy", title="loss")
    ax_nnz.set(xlabel="step", ylabel="gate non-zeros per token, % of neurons", title="sparsity", yscale="log")
    for ax in (ax_loss, ax_nnz):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("ReLU Llama on the Python standard library's source (bytes), with and without L1")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument(
        "--l1",
        type=lambda text: [float(v) for v in text.split(",")],
        default=None,
        help="L1 coefficients of the per-element term, comma-separated: one run each (default 0.3 on the gate; with "
        f"--l1-on hidden the paper's {PAPER_L1_PER_TOKEN:g} per token, i.e. {PAPER_L1_PER_TOKEN:g} * intermediate "
        "size per element)",
    )
    parser.add_argument(
        "--l1-on",
        choices=("gate", "hidden"),
        default="gate",
        help="the L1 term: the gate activations' (summed over layers) or the paper's eq. 2 on h = gate * up "
        "(averaged over layers)",
    )
    parser.add_argument("--train-method", choices=("dense", "hybrid"), default="dense")
    parser.add_argument(
        "--cuda-graph",
        choices=("auto", "on", "off"),
        default="auto",
        help="with --train-method hybrid: replay each layer's step from CUDA graphs (patch_llama's train_cuda_graph: "
        "auto = where the host would pace the step)",
    )
    parser.add_argument("--steps", type=_positive, default=None, help="override the size's step count")
    parser.add_argument(
        "--batch", type=_positive, default=None, help="override the size's sequences per step (the global batch)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("runs/train_sparse_llama"))
    parser.add_argument(
        "--distributed", action="store_true", help="DistributedDataParallel over the processes torchrun started"
    )
    parser.add_argument(
        "--engine",
        choices=("ddp", "fsdp2"),
        default="ddp",
        help="with --distributed: DistributedDataParallel (default) or FSDP2's fully_shard",
    )
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default=None, help="default: cuda when a GPU is visible, else cpu"
    )
    args = parser.parse_args(argv)
    cfg = dict(SIZES[args.size])
    if args.steps is not None:
        cfg["steps"] = args.steps
    if args.batch is not None:
        cfg["batch"] = args.batch
    if args.l1 is None:
        args.l1 = [0.3] if args.l1_on == "gate" else [PAPER_L1_PER_TOKEN * cfg["inter"]]
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.distributed:
        import os

        import torch.distributed as dist

        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        code = _run(cfg, args, device)
        if args.distributed:
            # every process done (process 0 writes the files last) before any tears the group down: gloo can
            # abort a process that closes its connections while a peer still holds them
            dist.barrier()
        return code
    finally:
        if args.distributed:
            import torch.distributed as dist

            dist.destroy_process_group()


def _run(cfg: dict, args: argparse.Namespace, device: torch.device) -> int:
    data = stdlib_bytes(limit=cfg["data"])
    rows = []
    for l1 in (0.0, *args.l1):
        rows += train(cfg, data, l1, args, device)
        if _world()[0] == 0:
            _write(rows, args.out)
    if _world()[0] != 0:
        return 0 if all(math.isfinite(r["loss"]) for r in rows) else 1
    dense = [r for r in rows if r["l1"] == 0.0][-1]
    print(f"final: L1=0 loss {dense['loss']:.4f}, {100 * dense['nnz_fraction']:.1f}% firing")
    for l1 in args.l1:
        sparse = [r for r in rows if r["l1"] == l1][-1]
        print(
            f"       L1={l1:g} loss {sparse['loss']:.4f} ({100 * (sparse['loss'] / dense['loss'] - 1):+.1f}%), "
            f"{100 * sparse['nnz_fraction']:.1f}% firing"
        )
    return 0 if all(math.isfinite(r["loss"]) for r in rows) else 1


def _write(rows: list[dict], out: Path) -> None:
    """log.csv and curves.png of the runs so far."""
    with (out / "log.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    try:
        plot(rows, out / "curves.png")
    except ImportError:
        print("matplotlib is not installed: no plot")


if __name__ == "__main__":
    raise SystemExit(main())
