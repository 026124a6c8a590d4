"""Where a decode step's sparse FFN spends its time: ``python -m benchmarks.lab.decode_probe [K N LAYERS]`` (GPU).

``LAYERS`` synthetic gated FFNs (distinct weights, together far past L2: each layer streams from DRAM, as in a
model) at hidden ``K`` and FFN width ``N`` (default the SparseLM-1.5B shape, 2048 x 5632 x 28), bf16, ~30 gate
non-zeros per token, heavy-tailed. For 1, 8 and 32 tokens, one CUDA graph runs every layer of:

* ``dense``    LlamaMLP's three GEMMs (cuBLAS): the dense peer
* ``twell``    ``twell_mlp(method="twell")``: the gate kernel and the up/down kernel
* ``gate``     the gate kernel alone (the first launch)
* ``up/down``  the up/down kernel alone, on the gate's recorded output (the second launch)

Each line gives microseconds per layer, the bytes the step must read at least (the gate's weights, and the fired
rows of up and down for the union of the batch's tokens), and the share of the copy bandwidth that reaching that
floor in that time would take.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.nn.functional as F

from sparsefuse.ffn.synthetic import synthetic_ffn
from sparsefuse.ffn.twell import launch
from sparsefuse.ffn.twell.launch import auto_tile, launch_gate, launch_mlp, launch_up_down

MEAN_NNZ = 30.0
COMPRESSION = 8
TILES = (None, 16, 32, 128)  # auto's tile, then others: whether a narrower tile streams the gate faster
SPLITS = (None, 4, 8, 16, 32)  # the up/down kernel's programs per token: auto's, then fewer (less to reduce)


def graph_us(fn, layers: int, reps: int = 50) -> float:
    """Microseconds per layer of ``fn(layer)`` over every layer, replayed from one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(layers):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps / layers)
    return best


def copy_bytes_per_s() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 2 * a.numel() * 10 / (start.elapsed_time(end) * 1e-3)


def probe(M: int, ffns: list, bw: float, tile: int | None = None, splits: int | None = None) -> str:
    """One line: the four rows at M tokens (see the module docstring), the TwELL tile ``tile`` and the up/down
    kernel's ``splits`` per token (default: auto's)."""
    planned = launch._up_down_plan
    if splits is not None:
        launch._up_down_plan = lambda *a: dataclasses.replace(planned(*a), n_splits=min(splits, a[2]))
    layers, (N, K) = len(ffns), ffns[0].w_gate.shape
    xs = [f.make_input(M, MEAN_NNZ, seed=100 + i) for i, f in enumerate(ffns)]
    w = [(f.w_gate, f.w_up, f.w_down.t()) for f in ffns]  # w_down_t [N, K], rows contiguous
    tile = tile or auto_tile(M, N, COMPRESSION)
    gates = [launch_gate(xs[i], w[i][0], None, tile, COMPRESSION, True) for i in range(layers)]
    fired = [(xs[i] @ w[i][0].t() > 0) for i in range(layers)]
    nnz = sum(int(f.sum()) for f in fired) / (layers * M)
    union = sum(int(f.any(0).sum()) for f in fired) / layers
    floor = (N * K + 2 * union * K) * 2  # bytes per layer: the gate, then the union's up and down rows

    def dense(i):
        x = xs[i]
        F.linear(F.relu(F.linear(x, w[i][0])) * F.linear(x, w[i][1]), w[i][2].t())

    def twell(i):
        launch_mlp(xs[i], w[i][0], None, w[i][1], None, w[i][2], None, tile, COMPRESSION, "twell", False)

    def gate(i):
        launch_gate(xs[i], w[i][0], None, tile, COMPRESSION, True)

    def up_down(i):
        v, ix, c, pre = gates[i]
        launch_up_down(v, ix, c, xs[i], w[i][0], None, w[i][1], None, w[i][2], None, tile, COMPRESSION, pre)

    try:
        fns = dict(dense=dense, twell=twell, gate=gate, up_down=up_down)
        times = {name: graph_us(fn, layers) for name, fn in fns.items()}
    finally:
        launch._up_down_plan = planned
    floor_us = floor / bw * 1e6
    return (
        f"M={M:2d} tile={tile} splits={splits or 'auto'} nnz/token={nnz:.1f} union={union:.0f}"
        + f" floor {floor / 1e6:.1f} MB = {floor_us:.1f} us"
        + " | "
        + "  ".join(f"{k} {v:.1f} us" for k, v in times.items())
        + f" | twell {times['dense'] / times['twell']:.2f}x dense, {floor_us / times['twell']:.0%} of floor;"
        f" gate alone {N * K * 2 / bw * 1e6 / times['gate']:.0%} of its floor"
    )


def main(K: int = 2048, N: int = 5632, layers: int = 28) -> None:
    bw = copy_bytes_per_s()
    print(f"copy {bw / 1e12:.2f} TB/s  K={K} N={N} layers={layers}  {torch.cuda.get_device_name()}", flush=True)
    ffns = [synthetic_ffn(K, N, device="cuda", seed=i) for i in range(layers)]
    for M in (1, 8, 32):
        for tile in TILES:
            print(probe(M, ffns, bw, tile), flush=True)
        for splits in SPLITS[1:]:
            print(probe(M, ffns, bw, None, splits), flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
