"""Compile-only worker for tests/test_compiles_for_sm90.py: ``python _sm90_compile.py SPECS.pkl OUT.json CLAIMS``.

Every worker reads the same specs and compiles those it claims first (an exclusive file per spec under the folder
CLAIMS): compile times range from a fraction of a second to tens, so fixed shares would leave one worker finishing
long after the other.

It runs in a fresh process *without* TRITON_INTERPRET, because ``@triton.jit`` decides at import time whether a
function is interpreted: only a fresh import gives JITFunctions whose callees are JITFunctions too (and takes the
package's compiled-path branches, e.g. the inline-PTX SFU helpers). Nothing here touches a GPU or the CUDA driver.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import pickle
import re
import sys
import time
from typing import Any

SM90 = ("cuda", 90, 32)  # H100: compute capability 9.0, warp size 32

# ptxas -v (which Triton always passes) reports registers and spills; TRITON's n_regs/n_spills need the driver.
_REGS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _resolve(value: Any) -> Any:
    """Constexpr arguments that were JIT functions travel as ("__jit__", module, name) (see the recorder)."""
    if isinstance(value, tuple) and len(value) == 3 and value[0] == "__jit__":
        return _kernel(value[1], value[2])
    return value


def _kernel(module: str, name: str) -> Any:
    fn = getattr(importlib.import_module(module), name)
    while not hasattr(fn, "arg_names") or hasattr(fn, "configs"):  # unwrap autotune/heuristics wrappers
        fn = fn.fn
    return fn


def compile_one(spec: dict[str, Any]) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = _kernel(spec["module"], spec["name"])
    constexprs = {path: _resolve(v) for path, v in spec["constexprs"].items()}
    src = ASTSource(fn=kernel, signature=spec["signature"], constexprs=constexprs, attrs=spec["attrs"])
    log = io.StringIO()
    start = time.perf_counter()
    result: dict[str, Any] = {"key": spec["key"], "name": spec["name"]}
    try:
        with contextlib.redirect_stdout(log):  # the ptxas log (dump_ptxas_log) and, on failure, Triton's PTX dump
            triton.compile(src, target=GPUTarget(*SM90), options=spec["options"])
    except Exception as e:  # noqa: BLE001 -- any compile failure is the finding to report
        result["error"] = f"{type(e).__name__}: {e}"[:4000]
    result["seconds"] = round(time.perf_counter() - start, 2)
    text = log.getvalue()
    if (regs := _REGS.findall(text)) and (spills := _SPILLS.findall(text)):
        result["regs"] = int(regs[-1])
        result["spill_stores"], result["spill_loads"] = (int(s) for s in spills[-1])
    return result


def gpu_variants(spec: dict[str, Any], every_config: bool) -> list[dict[str, Any]]:
    """An autotuned kernel's recorded launch ran the interpreter's single config (small tiles that no GPU run
    takes): one spec per GPU config instead, each config's meta-parameters and warps/stages put in -- every config
    for the first spec of a (kernel, argument types, constexprs), only the first config for the specs that differ
    from it only in alignment attributes (a config that compiles with one alignment compiles with another; each
    alignment still compiles once). Imported here, without TRITON_INTERPRET, the autotuner holds the GPU configs.
    Other kernels: the spec itself."""
    configs = getattr(getattr(importlib.import_module(spec["module"]), spec["name"]), "configs", None)
    if not configs:
        return [spec]
    configs = configs if every_config else configs[:1]
    names = _kernel(spec["module"], spec["name"]).arg_names
    variants = []
    for config in configs:
        constexprs = dict(spec["constexprs"])
        constexprs.update({(names.index(k),): v for k, v in config.kwargs.items()})
        options = dict(spec["options"], num_warps=config.num_warps, num_stages=config.num_stages)
        key = f"{spec['key']} config {sorted(config.kwargs.items())} w{config.num_warps} s{config.num_stages}"
        variants.append(dict(spec, constexprs=constexprs, options=options, key=key))
    return variants


def _claim(claims: str, index: int) -> bool:
    """True for the one worker that creates ``claims/index`` first."""
    try:
        os.close(os.open(os.path.join(claims, str(index)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def main(spec_path: str, out_path: str, claims: str) -> None:
    from triton import knobs

    knobs.nvidia.dump_ptxas_log = True
    with open(spec_path, "rb") as f:
        specs = pickle.load(f)
    first_of_kind = {}
    for i, spec in enumerate(specs):
        kind = repr((spec["module"], spec["name"], spec["signature"], sorted(spec["constexprs"].items())))
        first_of_kind.setdefault(kind, i)
    firsts = set(first_of_kind.values())
    results = [
        compile_one(variant)
        for i, spec in enumerate(specs)
        if _claim(claims, i)
        for variant in gpu_variants(spec, every_config=i in firsts)
    ]
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
