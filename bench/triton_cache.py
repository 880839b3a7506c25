"""Compile the Triton cache a GPU run uses, here on the CPU, for sm_86 (RTX 3090) and sm_90 (H100/H200).

    python3 bench/triton_cache.py                      # -> bench/results/local/triton-cache (carried to the GPU)
    python3 bench/triton_cache.py --kernels _gemv_kernel --sm 90 --out DIR   # a subset (tests)
    python3 bench/triton_cache.py --relocate DIR       # on the GPU, before use: see below
    python3 bench/triton_cache.py --check DIR          # does this machine's Triton hit DIR? (JSON)

It records every launch `tests/kernel_compile.py` makes at Laguna XS.2 shapes and those of XS.2's
decode step at its real widths (`exercise_gpu_run`; bf16 activations by default: what
bench/gpu_check.sh runs) and compiles each with Triton's own compiler into DIR, Triton's
file cache layout, so a process on the GPU with TRITON_CACHE_DIR=DIR finds each kernel instead of
compiling it (MoE up takes 7-8 s a specialization on this CPU). What must match for a hit: Triton keys
a kernel by sha256 of (1) triton_key(): the Triton version and a hash of its compiler, backends,
language and libtriton, i.e. the same Triton wheel; (2) the kernel's source and every JIT function it
calls, its signature, constexprs and pointer/int attributes (alignment and ==1 specialization): the
same commit of kernels/; (3) the backend: `ptxas --version` of the ptxas Triton runs (bundled in the
wheel unless TRITON_PTXAS_PATH / TRITON_PTXAS_BLACKWELL_PATH say otherwise) and the arch: 90 on the
H100/H200 the device tool lends, 86 on an RTX 3090 (89 on a 4090: not compiled here; add `--sm 89`);
(4) the compile options, completed from the target; (5) every cache-invalidating TRITON_* variable
set in the environment (TRITON_DEFAULT_FP_FUSION among them: bench/triton_compile.py sets it, so this
script unsets it again before compiling, as the GPU run leaves it unset). The manifest
(`triton-cache.json` in DIR) records (1), (3) and (5); `--check` compares them with the machine it
runs on.

Triton's group files (`__grp__*.json`) hold absolute paths of their entries, and a group whose paths
are missing is a miss: `--relocate DIR` rewrites them to where DIR is now (bench/gpu_check.sh does
this first). IR stages a hit never reads (ttir, ttgir, llir, ptx, source) are dropped from the groups
to keep DIR within the device tool's 64 MiB carry; cubin and metadata stay. Triton's launcher
(`cuda_utils`, one gcc build linked against libcuda) is built on the GPU machine on first use.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_OUT = ROOT / "bench" / "results" / "local" / "triton-cache"
MANIFEST = "triton-cache.json"
KEPT_SUFFIXES = (".cubin", ".json")  # what a cache hit reads (CompiledKernel: the binary and metadata)
TARGETS = (86, 90)


def relocate(folder: Path) -> int:
    """Point every group file in `folder` at its entries' current paths, dropping entries that are
    gone (pruned IR). Returns the number of groups rewritten."""
    count = 0
    for group in folder.glob("*/__grp__*.json"):
        data = json.loads(group.read_text())
        children = {name: str(group.parent / name) for name in data.get("child_paths", {})
                    if (group.parent / name).exists()}
        group.write_text(json.dumps({"child_paths": children}))
        count += 1
    return count


def prune(folder: Path) -> None:
    """Delete the IR files a hit never reads, and Triton's leftover temporary folders."""
    for entry in folder.iterdir():
        if not entry.is_dir():
            continue
        for item in entry.iterdir():
            if item.is_dir() and item.name.startswith("tmp."):
                shutil.rmtree(item)
            elif not item.name.endswith(KEPT_SUFFIXES):
                item.unlink()
    relocate(folder)


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def entries(folder: Path) -> set[str]:
    """The cache keys (entry folders) holding a compiled kernel."""
    return {group.parent.name for group in folder.glob("*/__grp__*.json")}


def fingerprint() -> dict:
    """What of this machine's Triton enters every cache key: version, triton_key's hash, the backend
    hash (ptxas version and arch) per target, and the cache-invalidating environment."""
    import hashlib

    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.cache import triton_key

    backends = {}
    for sm in TARGETS:
        try:
            backends[str(sm)] = make_backend(GPUTarget("cuda", sm, 32)).hash()
        except Exception as e:  # noqa: BLE001 - a missing ptxas is reported, not fatal
            backends[str(sm)] = f"unavailable: {type(e).__name__}: {e}"
    return {"triton": triton.__version__, "triton_key_sha256": hashlib.sha256(triton_key().encode()).hexdigest(),
            "backend_hash": backends, "env_vars": dict(get_cache_invalidating_env_vars())}


def check(folder: Path) -> dict:
    """Whether this machine's Triton would hit `folder`: each fingerprint field compared with its manifest."""
    path = folder / MANIFEST
    if not path.exists():
        return {"usable": False, "reason": f"no {MANIFEST} in {folder}"}
    manifest = json.loads(path.read_text())
    if not manifest.get("complete"):
        return {"usable": False, "reason": f"the build of {folder} did not finish"}
    built = manifest["fingerprint"]
    here = fingerprint()
    mismatches = {k: {"cache": built[k], "here": here[k]} for k in ("triton", "triton_key_sha256", "env_vars")
                  if built[k] != here[k]}
    targets = [sm for sm in built["backend_hash"] if built["backend_hash"][sm] == here["backend_hash"].get(sm)]
    if not targets:
        mismatches["backend_hash"] = {"cache": built["backend_hash"], "here": here["backend_hash"]}
    return {"usable": not mismatches, "targets": targets, "mismatches": mismatches, "entries": len(entries(folder))}


def exercise_gpu_run() -> None:
    """The launches tests/kernel_compile.py checks, and those of XS.2's own decode step at its real widths
    (bench/roofline_kernels.py: fused qkv, o, dense MLP, MoE, router, attention) at the rows the GPU run
    steps (1, 4, 8, 16) and prefills (a chunk of 2,048 rows, and 100: a remainder not a multiple of 16)."""
    import torch

    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]
    from kernel_compile import exercise_engine
    from roofline_kernels import decode_calls, weight_calls

    exercise_engine()
    calls = [c for rows in (1, 4, 8, 16) for c in decode_calls(torch.device("cpu"), torch.bfloat16, rows,
                                                                (1024, 32768, 131072), experts=8)]
    calls += [c for rows in (100, 2048) for c in weight_calls(torch.device("cpu"), torch.bfloat16, rows, experts=8)]
    for call in calls:
        call.run()


def compile_into_cache(job) -> dict:
    """Worker: compile one (launch, sm); Triton's compile writes the cache entry itself."""
    from bench.triton_compile import compile_launch

    launch, sm = job
    try:
        kernel = compile_launch(launch, sm)
        return {"kernel": launch.kernel, "sm": sm, "ok": True, "key": kernel.hash}
    except Exception as e:  # noqa: BLE001 - report it, keep going
        return {"kernel": launch.kernel, "sm": sm, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}


def compiler_crashed(job) -> dict:
    return {"kernel": job[0].kernel, "sm": job[1], "ok": False, "error": "the compiler crashed"}


def select_launches(launches: list, kernels: list[str] | None, activations: list[str], limit: int | None) -> list:
    def activation(launch) -> str:
        return next((t for t in launch.signature.values() if t.startswith("*")), "").lstrip("*")

    kept = [launch for launch in launches if activation(launch) in activations
            and (not kernels or launch.kernel in kernels)]
    return kept[:limit] if limit else kept


def build(out: Path, sms: list[int], kernels: list[str] | None, activations: list[str], limit: int | None) -> dict:
    """Record, compile into `out`, prune, and write the manifest; returns the manifest."""
    fusion_was_set = "TRITON_DEFAULT_FP_FUSION" in os.environ
    from bench.triton_compile import compile_all, record_launches  # turns the interpreter off: first

    if not fusion_was_set:  # set by triton_compile; in the key, and the GPU run leaves it unset
        os.environ.pop("TRITON_DEFAULT_FP_FUSION", None)
    os.environ["TRITON_CACHE_DIR"] = str(out)
    start = time.perf_counter()
    launches = select_launches(record_launches(exercise_gpu_run), kernels, activations, limit)
    results = compile_all([(launch, sm) for launch in launches for sm in sms], compile_into_cache, compiler_crashed)
    prune(out)
    manifest = {"benchmark": "triton_cache", "complete": True,
                "command": " ".join(["python3", "bench/triton_cache.py", *sys.argv[1:]]),
                "fingerprint": fingerprint(), "targets": sms, "activations": activations,
                "specializations": len(launches), "compiled": sum(r["ok"] for r in results),
                "failed": [r for r in results if not r["ok"]], "entries": len(entries(out)),
                "seconds": time.perf_counter() - start, "kernels": sorted({r["kernel"] for r in results}),
                "keys": sorted(r["key"] for r in results if r["ok"])}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    manifest["bytes"] = folder_bytes(out)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help="the cache folder (created; refused if it holds "
                                                           "something other than a cache this script built)")
    p.add_argument("--sm", type=int, nargs="+", default=list(TARGETS), help="targets (86: RTX 3090, 90: H100/H200)")
    p.add_argument("--kernels", nargs="+", default=None, help="only these kernel names (default: all)")
    p.add_argument("--activations", nargs="+", default=["bf16"], help="activation dtypes kept (bf16, fp32, fp16)")
    p.add_argument("--limit", type=int, default=None, help="at most this many specializations (tests)")
    p.add_argument("--relocate", metavar="DIR", help="rewrite DIR's group files to its current path, then exit")
    p.add_argument("--check", metavar="DIR", help="print whether this machine's Triton hits DIR, then exit")
    args = p.parse_args(argv)
    if args.relocate:
        print(json.dumps({"relocated_groups": relocate(Path(args.relocate).resolve())}))
        return 0
    if args.check:
        result = check(Path(args.check).resolve())
        print(json.dumps(result))
        return 0 if result["usable"] else 1
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).exists():
        raise SystemExit(f"{out} holds files this script did not write; choose an empty or new --out")
    if out.exists():
        shutil.rmtree(out)  # a rebuild starts clean: stale kernels would only take carry space
    out.mkdir(parents=True)
    (out / MANIFEST).write_text(json.dumps({"benchmark": "triton_cache", "complete": False}))  # ours, if cut short
    manifest = build(out, args.sm, args.kernels, args.activations, args.limit)
    print(json.dumps({k: manifest[k] for k in ("specializations", "compiled", "entries", "bytes", "seconds")}))
    if manifest["bytes"] > 64 << 20:
        print(f"warning: {manifest['bytes'] / 2**20:.1f} MiB is over the device tool's 64 MiB carry", file=sys.stderr)
    return 1 if manifest["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
