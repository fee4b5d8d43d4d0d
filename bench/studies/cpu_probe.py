"""Why does one host run the daemon's Python slower than another? What the process runs under,
and a few microbenchmarks timed as it is and with speculation controls it may change itself.

Prints the interpreter's build (version, configure flags: PGO/LTO, a debug build), the flags and
environment that slow CPython down, the CPU (model, MHz, the kernel's mitigations), the
process's speculation controls and seccomp mode (``/proc/self/status``), then times pure
Python steps, small NumPy calls and the decode daemon's host work for a 16-block pull
(``bench.host_work``'s functions) in this process. Where the kernel lets a process turn Speculative
Store Bypass (or indirect branch) speculation back on for itself (``prctl``,
``PR_SET_SPECULATION_CTRL``), each is enabled in turn and the microbenchmarks timed again,
the figures that say whether a mitigation costs the interpreter:

    python -m bench.studies.cpu_probe [--rounds 5]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import platform
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PR_GET_SPECULATION_CTRL = 52
PR_SET_SPECULATION_CTRL = 53
PR_SPEC_STORE_BYPASS = 0
PR_SPEC_INDIRECT_BRANCH = 1
PR_SPEC_PRCTL = 1 << 0
PR_SPEC_ENABLE = 1 << 1
PR_SPEC_DISABLE = 1 << 2
_BITS = (
    (1 << 0, "per-process control"),
    (1 << 1, "enabled"),
    (1 << 2, "disabled"),
    (1 << 3, "force-disabled"),
    (1 << 4, "disabled until exec"),
)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _prctl(option: int, a2: int, a3: int = 0) -> int:
    return int(_libc.prctl(option, a2, a3, 0, 0))


def speculation_state(which: int) -> int:
    """PR_GET_SPECULATION_CTRL's bits for ``which``; -1 when the kernel does not say."""
    return _prctl(PR_GET_SPECULATION_CTRL, which)


def speculation(which: int) -> str:
    got = speculation_state(which)
    if got < 0:
        return f"unknown (errno {ctypes.get_errno()})"
    if got == 0:
        return "not affected"
    return ", ".join(name for bit, name in _BITS if got & bit) + f" ({got:#x})"


def enable_speculation(which: int) -> str:
    got = _prctl(PR_SET_SPECULATION_CTRL, which, PR_SPEC_ENABLE)
    return "ok" if got == 0 else f"refused (errno {ctypes.get_errno()})"


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as err:
        return f"({err.strerror})"


def describe() -> None:
    print(f"python {sys.version.split()[0]} {platform.python_implementation()} at {sys.executable}")
    config = str(sysconfig.get_config_var("CONFIG_ARGS") or "")
    wanted = ("--enable-optimizations", "--with-lto", "--with-pydebug", "--enable-shared")
    print("  configure:", ", ".join(f for f in wanted if f in config) or "(none of PGO/LTO/debug)")
    print(
        "  Py_DEBUG:", sysconfig.get_config_var("Py_DEBUG"), "| flags dev_mode:", sys.flags.dev_mode
    )
    print("  CFLAGS:", (sysconfig.get_config_var("OPT") or "").strip())
    slow = [
        k
        for k in ("PYTHONDEVMODE", "PYTHONMALLOC", "PYTHONTRACEMALLOC", "PYTHONPROFILEIMPORTTIME")
        if os.environ.get(k)
    ]
    print("  slowing environment:", ", ".join(f"{k}={os.environ[k]}" for k in slow) or "none")
    print("  tracer / profiler set:", sys.gettrace() is not None, sys.getprofile() is not None)
    print(f"kernel {platform.release()}; cmdline: {_read('/proc/cmdline')}")
    cpu = _read("/proc/cpuinfo")
    model = next(
        (ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("model name")), "?"
    )
    mhz = [float(ln.split(":", 1)[1]) for ln in cpu.splitlines() if ln.startswith("cpu MHz")]
    lo, hi = min(mhz, default=0.0), max(mhz, default=0.0)
    print(f"cpu {model}; {os.cpu_count()} CPUs; MHz {lo:.0f}-{hi:.0f}")
    flags = next((ln for ln in cpu.splitlines() if ln.startswith("flags")), "")
    print("  hypervisor:", "hypervisor" in flags.split(), "| ssbd flag:", "ssbd" in flags.split())
    vuln = Path("/sys/devices/system/cpu/vulnerabilities")
    if vuln.is_dir():
        for p in sorted(vuln.iterdir()):
            print(f"  {p.name}: {_read(str(p))}")
    for ln in _read("/proc/self/status").splitlines():
        if ln.startswith(("Seccomp", "Speculation", "Cpus_allowed_list")):
            print(" ", ln.replace("\t", " "))
    print("  prctl store bypass:", speculation(PR_SPEC_STORE_BYPASS))
    print("  prctl indirect branch:", speculation(PR_SPEC_INDIRECT_BRANCH))


@dataclass(frozen=True)
class _Row:
    a: int
    b: int


def _loop() -> None:
    s = 0
    for i in range(2000):
        s += i & 7
    assert s > 0


def _calls() -> None:
    def f(x: int) -> int:
        return x + 1

    y = 0
    for _ in range(500):
        y = f(y)


def _objects() -> None:
    rows = [_Row(i, i + 1) for i in range(200)]
    assert len({r.a for r in rows}) == 200


def _dicts() -> None:
    d: dict[str, int] = {}
    for i in range(300):
        d[f"k{i & 31}"] = i


_A = np.arange(512, dtype=np.int64)


def _numpy() -> None:
    for _ in range(20):
        b = _A * 3 + 1
        np.flatnonzero(np.diff(b) != 3)


def _host_work() -> Callable[[], None]:
    """One 16-block pull's plan_pull and decision on the llama-shaped pool (bench.host_work's
    first two steps; its KERNEL preparation needs the test fakes, left out)."""
    import random

    from kvxferd.blocks import plan_pull
    from kvxferd.layout.presets import preset
    from kvxferd.layout.spec import MemoryType

    spec = preset("dense:num_blocks=600").with_memory(MemoryType.VRAM)
    n = spec.num_kernel_blocks(0)
    rng = random.Random(1)
    pairs = [(rng.sample(range(n), 16), rng.sample(range(n), 16)) for _ in range(64)]
    k = [0]

    def one() -> None:
        lo, re = pairs[k[0] % len(pairs)]
        k[0] += 1
        plan_pull(spec, spec, [lo], [re], prefix_caching=True)

    return one


def time_us(fn: Callable[[], None], calls: int = 400) -> float:
    for _ in range(50):
        fn()
    xs = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs) * 1e6


def bench(rounds: int) -> dict[str, float]:
    cases: dict[str, Callable[[], None]] = {
        "loop 2000 adds": _loop,
        "500 calls": _calls,
        "200 dataclasses": _objects,
        "300 dict stores": _dicts,
        "20 x 3 numpy ops": _numpy,
        "plan_pull 16 blocks": _host_work(),
    }
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, fn in cases.items():
            us = time_us(fn)
            best[name] = min(best.get(name, us), us)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    describe()
    runs = {"as started": bench(args.rounds)}
    for name, which in (
        ("store bypass", PR_SPEC_STORE_BYPASS),
        ("indirect branch", PR_SPEC_INDIRECT_BRANCH),
    ):
        state = speculation_state(which)
        if state > 0 and state & PR_SPEC_PRCTL and state & PR_SPEC_DISABLE:
            got = enable_speculation(which)
            print(f"enable {name} speculation: {got} -> {speculation(which)}")
            if got == "ok":
                runs[f"+ {name} on"] = bench(args.rounds)
    names = list(runs)
    print("\nbest of rounds, median us per call: " + " | ".join(names))
    for case in runs[names[0]]:
        print(f"  {case:22s} " + " | ".join(f"{runs[n][case]:8.1f}" for n in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
