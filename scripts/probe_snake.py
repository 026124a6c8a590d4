"""GPU probe for the Snake kernels (issue 2's open misses). Run on a GPU: ``python3 scripts/probe_snake.py``.

1. Backward: time ``snake_bwd_kernel`` over (BLOCK_T, num_warps) and the ways of finishing alpha's gradient (in the
   kernel by the channel's last program, or partials plus torch's sum), and with the alpha reduction compiled out,
   against a same-run 3-stream ceiling (``torch.add(g, x, out=)`` reads two
   tensors and writes one, like the backward). Registers and spills per variant.
2. Short-row forwards (1x1024x236, 1x512x1888, where we trail torch.compile by 0.1-0.3 us): per-kernel device
   times from the profiler for sparsefuse and Inductor, and the best flat and row kernel configs.

All timings are CUDA-graph replays over input sets rotated beyond L2, median of several replays.
"""

from __future__ import annotations

import statistics
import sys

import torch
import triton

import sparsefuse
import sparsefuse.activations.snake as S

L2_BYTES = 64 << 20


def graph_time_us(fn, n_sets: int, reps: int = 15) -> float:
    """Median us per call of ``fn(i)`` for i over n_sets, captured in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(n_sets):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    calls = max(n_sets, 20)
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % n_sets)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def probe_backward() -> None:
    print("== backward kernel alone (GB/s of 3E bytes/element; % of the same-run 3-stream add)")
    variants = [  # (block, warps, alpha finish or None for no alpha grad)
        (2048, 4, S.ALPHA_LAST_ARRIVER), (2048, 4, S.ALPHA_PARTIALS), (2048, 4, None),
    ]
    for dtype in (torch.bfloat16, torch.float32):
        for B, C, T in [(8, 512, 16384), (1, 256, 15104), (4, 64, 1888)]:
            n = B * C * T
            e = torch.tensor([], dtype=dtype).element_size()
            n_sets = max(2, -(-2 * L2_BYTES // (3 * n * e)))
            sets = [(torch.randn(B, C, T, device="cuda", dtype=dtype), torch.randn(B, C, T, device="cuda", dtype=dtype))
                    for _ in range(n_sets)]  # fmt: skip
            outs = [torch.empty(B, C, T, device="cuda", dtype=dtype) for _ in range(n_sets)]
            alpha = torch.rand(C, device="cuda") + 0.5
            floor_bytes = 3 * n * e
            t_add = graph_time_us(lambda i: torch.add(sets[i][0], sets[i][1], out=outs[i]), n_sets)
            ceiling = floor_bytes / t_add / 1e3
            print(f"{str(dtype):15s} [{B},{C},{T}] 3-stream add {t_add:8.1f} us {ceiling:6.0f} GB/s")
            for block, warps, finish in variants:
                n_tb = triton.cdiv(T, block)
                n_programs = B * C * n_tb
                ga = torch.empty(C, device="cuda")
                part = torch.empty(n_programs, device="cuda")
                arr = torch.zeros(C, dtype=torch.int32, device="cuda")
                compiled = []

                def run(i):
                    if finish is not None and finish.value == S.ALPHA_LAST_ARRIVER.value:
                        arr.zero_()
                    xx, gg = sets[i]
                    k = S.snake_bwd_kernel[S._row_grid(B * C, n_tb)](
                        gg, xx, alpha, outs[i], ga, part, arr, B * n_tb, B * C, S.ROWS_PER_SLICE, C,
                        *S.division_magic(C), T, C * T, T, C * T, T, 1e-9,
                        BLOCK_T=block, SIN_MODE=0, WIDE_INDEX=False, NEED_ALPHA_GRAD=finish is not None,
                        ALPHA_FINISH=(finish or S.ALPHA_DIRECT).value, num_warps=warps)
                    if finish is not None and finish.value == S.ALPHA_PARTIALS.value:
                        torch.sum(part.view(B, C, n_tb), dim=(0, 2), out=ga)
                    if not compiled:
                        compiled.append(k)

                t = graph_time_us(run, n_sets)
                k = compiled[0]
                name = {None: "no-alpha", 1: "last-arriver", 2: "partials+sum"}[finish if finish is None else finish.value]
                tag = f"{block}/{warps} {name}"
                print(f"    {tag:24s} {t:8.1f} us {floor_bytes / t / 1e3:6.0f} GB/s {100 * t_add / t:5.1f}%  "
                      f"regs {k.n_regs} spills {k.n_spills}")
            # the launcher as the library runs it (config rule + memset + kernel)
            cfg = S._backward_config(T)
            n_programs = B * C * triton.cdiv(T, cfg[0])
            t = graph_time_us(lambda i: S._snake_backward(sets[i][1], sets[i][0], alpha, 1e-9, False, True), n_sets)
            print(f"    library {cfg} finish {S._alpha_finish(n_programs, C)}  {t:8.1f} us "
                  f"{floor_bytes / t / 1e3:6.0f} GB/s {100 * t_add / t:5.1f}%")
            sys.stdout.flush()


def probe_small_forward() -> None:
    """Short rows: the flat kernel (channel by multiply-shift, full blocks) against the row kernel (masked tails)."""
    from torch.profiler import ProfilerActivity, profile

    def eager(x, a):
        return x + (a + 1e-9).reciprocal() * torch.sin(a * x).pow(2)

    for dtype in (torch.float32, torch.bfloat16):
        for B, C, T in [(1, 1024, 236), (1, 512, 1888), (1, 256, 3000), (4, 256, 1888)]:
            print(f"== small forward {B}x{C}x{T} {dtype}")
            n_sets = 64
            xs = [torch.randn(B, C, T, device="cuda", dtype=dtype) for _ in range(n_sets)]
            alpha = torch.rand(1, C, 1, device="cuda") + 0.5
            a1 = alpha.reshape(C).contiguous()
            torch._dynamo.reset()
            compiled_fn = torch.compile(eager)
            ys = [torch.empty_like(xs[0]) for _ in range(n_sets)]
            print(f"  sparsefuse.snake  {graph_time_us(lambda i: sparsefuse.snake(xs[i], alpha), n_sets):6.2f} us")
            print(f"  torch.compile     {graph_time_us(lambda i: compiled_fn(xs[i], alpha.to(dtype)), n_sets):6.2f} us")
            print(f"  x.clone()         {graph_time_us(lambda i: xs[i].clone(), n_sets):6.2f} us")
            n = B * C * T
            flat = S.snake_fwd_flat_kernel
            best = min(
                (graph_time_us(lambda i: flat[(triton.cdiv(n, block),)](
                    xs[i], a1, ys[i], n, C, *S.division_magic(T), *S.division_magic(C), 1e-9,
                    BLOCK=block, VECTOR=4, RUN_SHARES_CHANNEL=T % 4 == 0, SIN_MODE=0, num_warps=warps), n_sets), block, warps)
                for block, warps in [(256, 2), (512, 4), (1024, 4), (1024, 8), (2048, 8)]
            )  # fmt: skip
            print(f"  flat best         {best[0]:6.2f} us at {best[1]}/{best[2]}")
            row = S.snake_fwd_kernel
            best = min(
                (graph_time_us(lambda i: row[S._row_grid(B * C, triton.cdiv(T, block))](
                    xs[i], a1, ys[i], B * C, S.ROWS_PER_SLICE, C, *S.division_magic(C), T, C * T, T, 1e-9, BLOCK_T=block, SIN_MODE=0, WIDE_INDEX=False,
                    num_warps=warps), n_sets), block, warps)
                for block, warps in [(256, 2), (512, 4), (1024, 4), (2048, 4), (2048, 8)]
            )  # fmt: skip
            print(f"  row best          {best[0]:6.2f} us at {best[1]}/{best[2]}")
            for name, fn in [("sparsefuse", lambda x: sparsefuse.snake(x, alpha)),
                             ("compile", lambda x: compiled_fn(x, alpha.to(dtype)))]:  # fmt: skip
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for i in range(n_sets):
                        fn(xs[i])
                    torch.cuda.synchronize()
                for evt in prof.key_averages():
                    total = getattr(evt, "self_device_time_total", 0) or getattr(evt, "self_cuda_time_total", 0)
                    if total:
                        print(f"  profile {name:10s} {evt.key[:50]:50s} x{evt.count} avg {total / evt.count:6.2f} us")
            sys.stdout.flush()


def probe_forward_configs(shapes=None, dtypes=(torch.float32, torch.bfloat16), extra_modes=False) -> None:
    """Every bench shape: the library's forward against torch.compile and a same-size copy, and each row and flat
    kernel configuration (sine mode as the library picks it), to set the forward's dispatch rule. Every variant
    allocates its output inside the graph, as the library, torch.compile and clone do (the graph's pool then hands
    each call the same block)."""
    from torch._inductor.utils import run_and_get_code

    from sparsefuse.bench.workloads.activations import SNAKE_SHAPES, eager_snake

    row_cfgs = [(256, 2), (512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8), (8192, 16), (4096, 4)]
    flat_cfgs = [(256, 2), (512, 2), (512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8)]
    for dtype in dtypes:
        modes = [S._sin_mode(dtype, False)] + ([S.SIN_HARDWARE.value] if extra_modes and dtype == torch.float32 else [])
        for B, C, T in shapes or SNAKE_SHAPES:
            n = B * C * T
            e = torch.tensor([], dtype=dtype).element_size()
            n_sets = max(2, -(-4 * L2_BYTES // (2 * n * e)))
            xs = [torch.randn(B, C, T, device="cuda", dtype=dtype) for _ in range(n_sets)]
            alpha = torch.empty(1, C, 1, device="cuda").uniform_(0.5, 2.0)
            a1 = alpha.reshape(C).contiguous()
            torch._dynamo.reset()
            compiled_fn = torch.compile(eager_snake)
            t_lib = graph_time_us(lambda i: sparsefuse.snake(xs[i], alpha), n_sets)
            t_cmp = graph_time_us(lambda i: compiled_fn(xs[i], alpha), n_sets)
            t_copy = graph_time_us(lambda i: xs[i].clone(), n_sets)
            gbs = 2 * n * e / 1e3
            print(f"== fwd {B}x{C}x{T} {str(dtype)[6:]}: library {t_lib:7.2f} us ({gbs / t_lib:5.0f} GB/s) "
                  f"compile {t_cmp:7.2f} clone {t_copy:7.2f}  compile/lib {t_cmp / t_lib:.3f}x  clone/lib {t_copy / t_lib:.3f}")
            if n <= 1 << 22:  # Inductor's kernel and launch for the short shapes
                _, code = run_and_get_code(compiled_fn, xs[0], alpha)
                for line in code[0].splitlines():
                    if any(k in line for k in ("triton_meta", "@triton_heuristics", "XBLOCK :", "xnumel =", "tl.load",
                                               "grid=", ".run(")):  # fmt: skip
                        print("   inductor:", line.strip()[:160])
            row = S.snake_fwd_kernel
            magic = S.division_magic(C)
            results = []
            for mode in modes:
                tag = "" if mode == modes[0] else " hw"
                for block, warps in row_cfgs:
                    if block > max(256, triton.next_power_of_2(T)):
                        continue
                    t = graph_time_us(lambda i: row[S._row_grid(B * C, triton.cdiv(T, block))](
                        xs[i], a1, torch.empty_like(xs[i]), B * C, S.ROWS_PER_SLICE, C, *magic, T, C * T, T, 1e-9,
                        BLOCK_T=block, SIN_MODE=mode, WIDE_INDEX=False, num_warps=warps), n_sets)  # fmt: skip
                    results.append((t, f"row {block}/{warps}{tag}"))
                if n < 2**31 - 8192:
                    flat = S.snake_fwd_flat_kernel
                    for block, warps in flat_cfgs:
                        t = graph_time_us(lambda i: flat[(triton.cdiv(n, block),)](
                            xs[i], a1, torch.empty_like(xs[i]), n, C, *S.division_magic(T), *magic, 1e-9,
                            BLOCK=block, VECTOR=16 // e, RUN_SHARES_CHANNEL=T % (16 // e) == 0, SIN_MODE=mode,
                            num_warps=warps),
                            n_sets)  # fmt: skip
                        results.append((t, f"flat {block}/{warps}{tag}"))
            results.sort()
            print("   " + "  ".join(f"{name} {t:.2f}" for t, name in results))
            sys.stdout.flush()


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    which = sys.argv[1:] or ["bwd", "small", "fwd"]
    if "bwd" in which:
        probe_backward()
    if "small" in which:
        probe_small_forward()
    if "fwd" in which:
        probe_forward_configs()
    if "fwd-short" in which:  # the shapes where torch.compile was ahead, with the SFU sine tried on fp32 too
        probe_forward_configs([(1, 1024, 236), (1, 128, 60416), (1, 64, 120832)], extra_modes=True)
