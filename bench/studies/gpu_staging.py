"""GPU staging bench (issue 6): the staging kernels alone and the pipelined staged path.

Run from the repository root on a machine with CUDA GPUs (two for the GPU0 -> GPU1 rows)::

    python -m bench.studies.gpu_staging --build-only   # JIT-build the kernels, say which is active
    python -m bench.studies.gpu_staging --json out.json   # measure
    python -m bench.studies.gpu_staging --report out.json nixl.json   # one table from both

Workload (``docs/nixl.md`` §5): a Llama-3-8B-shaped cache, 32 layers x ``(4096, 2, 16, 8, 128)``
bf16 per layer (64 KiB a block), a request of 512 RANDOM blocks = 1 GiB, destination block IDs
random too. Rows (median of ``--repeat``, host wall time between device synchronisations):

* raw copy: torch ``copy_`` of 1 GiB, GPU0 -> GPU1 and GPU0 -> GPU0: the limit.
* gather / scatter alone on GPU0 (CUDA kernels vs the torch twin): per-layer, cross-layer,
  with the NHD -> HND permute. GB/s counts request bytes (HBM traffic is twice that).
* staged GPU0 -> GPU1 in one process: gather chunk k on GPU0 into a staging buffer, ``copy_``
  it to a staging buffer on GPU1, scatter it there, on three streams (gather, copy, scatter)
  so chunks overlap; chunk counts 1/4/8/16; CUDA kernels vs twin. Every configuration's bytes are
  verified once (every layer's destination blocks equal the source blocks).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from kvxferd.kernels import BackendName, HeadOrder, KVPermute, active_backend, row_bytes, twin

LAYERS = 32
NUM_BLOCKS = 4096
REQ = 512
BLOCK_SHAPE = (2, 16, 8, 128)
BLOCK_BYTES = 2 * 16 * 8 * 128 * 2
GIB = 1 << 30
REQ_BYTES = LAYERS * REQ * BLOCK_BYTES


class Impl(Protocol):
    def gather_blocks(
        self, regions: Any, block_ids: Any, out: torch.Tensor, *, permute: Any = None
    ) -> Any: ...

    def scatter_blocks(
        self, regions: Any, block_ids: Any, staging: torch.Tensor, *, permute: Any = None
    ) -> None: ...


def _sync() -> None:
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)


def _time(fn: Callable[[], object], repeat: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync()
    out = []
    for _ in range(repeat):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return out


def _gbps(nbytes: int, secs: list[float]) -> float:
    return nbytes / statistics.median(secs) / 1e9


def _rand(shape: tuple[int, ...], dev: torch.device, dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=dev)
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=dev))
    return t


def per_layer_pool(dev: torch.device) -> list[torch.Tensor]:
    """32 per-layer NHD tensors, as ``(num_blocks, 64 KiB)`` block views."""
    return [
        _rand((NUM_BLOCKS, *BLOCK_SHAPE), dev, torch.bfloat16)
        .view(torch.uint8)
        .view(NUM_BLOCKS, -1)
        for _ in range(LAYERS)
    ]


def cross_layer_pool(dev: torch.device) -> list[torch.Tensor]:
    """One cross-layer tensor (every layer of a block contiguous): one 2 MiB block view."""
    return [_rand((NUM_BLOCKS, LAYERS * BLOCK_BYTES), dev, torch.uint8)]


@dataclass
class Staged:
    """One pipelined GPU0 -> GPU1 transfer's buffers and streams (gather, copy x2, scatter)."""

    src: list[torch.Tensor]
    sids: np.ndarray
    dst: list[torch.Tensor]
    dids: np.ndarray
    st0: torch.Tensor
    st1: torch.Tensor
    streams: tuple[torch.cuda.Stream, ...]

    def run(self, impl: Impl, chunks: int) -> None:
        """Gather on GPU0, copy to GPU1, scatter on GPU1, chunk by chunk on three streams."""
        g0, c0, c1, s1 = self.streams
        d0, d1 = self.st0.device, self.st1.device
        g0.wait_stream(torch.cuda.current_stream(d0))  # after whatever the caller queued
        s1.wait_stream(torch.cuda.current_stream(d1))
        rb = row_bytes(self.src)
        bounds = np.linspace(0, len(self.sids), chunks + 1).astype(int)
        for a, b in itertools.pairwise(bounds):
            lo, hi = int(a) * rb, int(b) * rb
            with torch.cuda.stream(g0):
                impl.gather_blocks(self.src, self.sids[a:b], self.st0[lo:hi])
            gathered = torch.cuda.Event()
            gathered.record(g0)
            c0.wait_event(gathered)
            # torch runs a cross-device copy_ on the source device's current stream (c0) and
            # makes the destination device's current stream (c1) wait for it.
            with torch.cuda.stream(c0), torch.cuda.stream(c1):
                self.st1[lo:hi].copy_(self.st0[lo:hi], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(c1)
            s1.wait_event(copied)
            with torch.cuda.stream(s1):
                impl.scatter_blocks(self.dst, self.dids[a:b], self.st1[lo:hi])
        torch.cuda.current_stream(d1).wait_stream(s1)

    def verify(self) -> None:
        si, di = torch.from_numpy(self.sids), torch.from_numpy(self.dids)
        for layer, (s, d) in enumerate(zip(self.src, self.dst, strict=True)):
            if not torch.equal(s[si.to(s.device)].to(d.device), d[di.to(d.device)]):
                raise AssertionError(f"region {layer}: destination blocks differ from the source")


def _impls() -> dict[str, Impl]:
    out: dict[str, Impl] = {"twin": twin}  # type: ignore[dict-item]
    if active_backend().name is BackendName.CUDA:
        from kvxferd.kernels import cuda_ops

        out = {"cuda": cuda_ops, **out}  # type: ignore[dict-item]
    return out


class Rows:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, name: str, secs: list[float], nbytes: int = REQ_BYTES, **extra: Any) -> None:
        row = {"row": name, "gbps": _gbps(nbytes, secs), "ms": statistics.median(secs) * 1e3}
        row.update(extra)
        self.rows.append(row)
        print(f"  {name:58} {row['gbps']:8.1f} GB/s  {row['ms']:7.2f} ms", flush=True)


def raw_rows(out: Rows, repeat: int) -> None:
    d0 = torch.device("cuda:0")
    a = _rand((GIB,), d0, torch.uint8)
    if torch.cuda.device_count() > 1:
        b1 = torch.empty(GIB, dtype=torch.uint8, device="cuda:1")
        b1.copy_(a)  # enables peer access, warms the path
        out.add("raw copy_ GPU0->GPU1 (1 GiB)", _time(lambda: b1.copy_(a), repeat), GIB)
    b0 = torch.empty_like(a)
    out.add("raw copy_ GPU0->GPU0 (1 GiB)", _time(lambda: b0.copy_(a), repeat), GIB)


def kernel_rows(
    out: Rows, pool: str, src: list[torch.Tensor], ids: tuple[np.ndarray, np.ndarray], repeat: int
) -> None:
    sids, dids = ids
    st0 = torch.empty(REQ_BYTES, dtype=torch.uint8, device=src[0].device)
    perm = KVPermute(HeadOrder.NHD, 16, 8, 256)
    for iname, impl in _impls().items():

        def gather(impl: Impl = impl) -> None:
            impl.gather_blocks(src, sids, st0)

        def gather_perm(impl: Impl = impl) -> None:
            impl.gather_blocks(src, sids, st0, permute=perm)

        def scatter(impl: Impl = impl) -> None:
            impl.scatter_blocks(src, dids, st0)

        out.add(f"gather GPU0 {pool} [{iname}]", _time(gather, repeat))
        out.add(f"gather GPU0 {pool} +NHD->HND [{iname}]", _time(gather_perm, repeat))
        out.add(f"scatter GPU0 {pool} [{iname}]", _time(scatter, repeat))


def staged_rows(out: Rows, pool: str, job: Staged, chunk_list: list[int], repeat: int) -> None:
    for iname, impl in _impls().items():
        for chunks in chunk_list:
            for d in job.dst:
                d.zero_()
            _sync()

            def go(impl: Impl = impl, chunks: int = chunks) -> None:
                job.run(impl, chunks)

            go()
            _sync()
            job.verify()
            out.add(
                f"staged GPU0->GPU1 {pool} {chunks:>2} chunks [{iname}]",
                _time(go, repeat),
                chunks=chunks,
                pair="0->1",
            )


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    ndev = torch.cuda.device_count()
    out = Rows()
    print(f"devices: {[torch.cuda.get_device_name(i) for i in range(ndev)]}")
    print(active_backend().describe())
    raw_rows(out, args.repeat)
    torch.cuda.empty_cache()
    sids = rng.choice(NUM_BLOCKS, REQ, replace=False).astype(np.int64)
    dids = rng.choice(NUM_BLOCKS, REQ, replace=False).astype(np.int64)
    d0 = torch.device("cuda:0")
    for pool, make in (("per-layer", per_layer_pool), ("cross-layer", cross_layer_pool)):
        src = make(d0)
        kernel_rows(out, pool, src, (sids, dids), args.repeat)
        if ndev > 1:
            d1 = torch.device("cuda:1")
            job = Staged(
                src,
                sids,
                make(d1),
                dids,
                torch.empty(REQ_BYTES, dtype=torch.uint8, device=d0),
                torch.empty(REQ_BYTES, dtype=torch.uint8, device=d1),
                tuple(torch.cuda.Stream(d) for d in (d0, d0, d1, d1)),
            )
            staged_rows(out, pool, job, args.chunks if pool == "per-layer" else [8], args.repeat)
            del job
        del src
        torch.cuda.empty_cache()
    return {
        "request_bytes": REQ_BYTES,
        "repeat": args.repeat,
        "devices": [torch.cuda.get_device_name(i) for i in range(ndev)],
        "backend": active_backend().describe(),
        "rows": out.rows,
    }


def report(paths: list[Path]) -> None:
    """One table from the staging and NIXL JSON files: GB/s and ratios to the raw copies."""
    rows: list[dict[str, Any]] = []
    for p in paths:
        if p.exists():
            rows.extend(json.loads(p.read_text())["rows"])
        else:
            print(f"(missing: {p})")
    raw = {r["row"]: r["gbps"] for r in rows if r["row"].startswith("raw copy_")}
    link = raw.get("raw copy_ GPU0->GPU1 (1 GiB)")
    local = raw.get("raw copy_ GPU0->GPU0 (1 GiB)")
    naive = {r.get("pair"): r["gbps"] for r in rows if "per (layer, block)" in r["row"]}
    print(f"\n{'row':62} {'GB/s':>8} {'x raw':>6} {'x naive':>7}")
    for r in rows:
        same = "GPU0->GPU0" in r["row"] or "GPU0 " in r["row"] or r.get("pair") == "0->0"
        base = local if same else link
        ratio = f"{r['gbps'] / base:6.2f}" if base else "     -"
        nv = naive.get(r.get("pair")) if r.get("pair") else None
        xn = f"{r['gbps'] / nv:7.1f}" if nv else "      -"
        print(f"{r['row']:62} {r['gbps']:8.1f} {ratio} {xn}")
    print("x raw: against the GPU0->GPU0 copy for same-GPU rows, else the GPU0->GPU1 copy")


_PROBE_CPP = (
    "#include <torch/library.h>\n"
    "void boom_cu();\n"
    "void boom_fmt();\n"
    'void boom_cpp() { TORCH_CHECK(false, "probe: thrown from g++-compiled code"); }\n'
    "TORCH_LIBRARY(kvxprobe, m) {\n"
    '  m.def("cpp() -> ()", &boom_cpp);\n'
    '  m.def("cu() -> ()", &boom_cu);\n'
    '  m.def("fmt() -> ()", &boom_fmt);\n'
    "}\n"
)
_PROBE_CU = (
    "#include <c10/util/Exception.h>\n"
    'void boom_cu() { TORCH_CHECK(false, "probe: thrown from nvcc-compiled host code"); }\n'
    'void boom_fmt() { TORCH_CHECK(false, "probe: a number ", static_cast<int64_t>(42)); }\n'
)


def _probe_child(build: str, which: str) -> None:
    from torch.utils.cpp_extension import load_inline

    load_inline(
        "kvxprobe", [_PROBE_CPP], [_PROBE_CU], is_python_module=False, build_directory=build
    )
    try:
        getattr(torch.ops.kvxprobe, which)()
    except RuntimeError as exc:
        print("raised RuntimeError:", str(exc).splitlines()[0])


def probe_exceptions() -> None:
    """Does a TORCH_CHECK thrown from a JIT-built extension reach Python on this machine? Each
    probe runs in its own process, since the answer may be a crash."""
    import tempfile

    build = tempfile.mkdtemp(prefix="kvxprobe-")
    for which in ("cpp", "cu", "fmt"):
        code = (
            "from bench.studies.gpu_staging import _probe_child; "
            f"_probe_child({build!r}, {which!r})"
        )
        res = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False
        )
        last = (res.stdout.strip().splitlines() or ["(no output)"])[-1]
        print(f"exception probe [{which}]: rc={res.returncode} {last}", flush=True)
        if res.returncode:
            print(res.stderr.strip()[-800:], flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--probe-exceptions", action="store_true")
    ap.add_argument("--report", type=Path, nargs="+")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.report:
        report(args.report)
        return 0
    if args.probe_exceptions:
        probe_exceptions()
        return 0
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to measure")
        return 1
    t0 = time.monotonic()
    b = active_backend(verbose=args.build_only)
    print(f"{b.describe()} (ready in {time.monotonic() - t0:.1f} s)", flush=True)
    if args.build_only:
        return 0 if b.name is BackendName.CUDA else 1
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    print(smi.stdout.strip())
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
