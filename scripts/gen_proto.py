#!/usr/bin/env python3
"""Regenerate the Python code of the wire contract from ``proto/kvxferd/v1/*.proto``.

Writes, for every ``proto/kvxferd/v1/<name>.proto``, into ``<out>/kvxferd/v1/``:

* ``<name>_pb2.py`` and ``<name>_pb2.pyi`` (messages; stubs by mypy-protobuf),
* ``<name>_pb2_grpc.py`` and ``<name>_pb2_grpc.pyi`` (only for files that declare a service).

Usage::

    python scripts/gen_proto.py             # regenerate in place (repo root), then check in
    python scripts/gen_proto.py --out DIR   # write the tree under DIR (CI diffs it, see
                                            # scripts/check_proto.sh)
    python scripts/gen_proto.py --pins      # print the pinned generator requirements

Run it with an interpreter that has the pins (``pip install $(python scripts/gen_proto.py
--pins)`` into a virtualenv of their own: grpcio-tools 1.66.2 wants protobuf < 6, which the
project's dev environment does not hold); scripts/check_proto.sh makes and caches one.

The output is deterministic for a given grpcio-tools (which bundles protoc) and mypy-protobuf
version, so both are pinned below; the script refuses to run with other versions, because the
checked-in code would then drift for no reason. In place, stale generated files (of a deleted
proto) are removed; the hand-written ``kvxferd/v1/__init__.py`` is never touched.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from importlib import metadata
from pathlib import Path

# Bump together, regenerate, and raise the runtime floors in pyproject.toml to match: the
# generated code refuses to import under grpcio < GRPCIO_TOOLS and protobuf < the protoc
# version grpcio-tools bundles (see the header of any *_pb2.py).
PINNED = {
    "grpcio-tools": "1.66.2",
    "mypy-protobuf": "3.7.0",
}

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE = Path("kvxferd") / "v1"
GENERATED_GLOBS = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py", "*_pb2_grpc.pyi")
_SERVICE_RE = re.compile(r"^\s*service\s+\w+\s*\{", re.MULTILINE)


def fail(message: str) -> None:
    print(f"gen_proto: error: {message}", file=sys.stderr)
    raise SystemExit(1)


def check_versions() -> None:
    wrong = []
    for dist, want in PINNED.items():
        try:
            have = metadata.version(dist)
        except metadata.PackageNotFoundError:
            have = "not installed"
        if have != want:
            wrong.append(f"{dist} {have} (need {want})")
    if wrong:
        pins = " ".join(f"{d}=={v}" for d, v in PINNED.items())
        fail(
            "code generators at the wrong version: "
            + ", ".join(wrong)
            + f". Install the pinned ones: python -m pip install {pins}"
        )


def plugin(name: str) -> str:
    """Absolute path of a protoc plugin installed with this interpreter's packages."""
    for folder in (Path(sysconfig.get_path("scripts")), Path(sys.executable).parent):
        candidate = folder / name
        if candidate.is_file():
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        fail(f"{name} not found; it comes with mypy-protobuf=={PINNED['mypy-protobuf']}")
    return str(found)


def proto_files() -> list[Path]:
    files = sorted((PROTO_ROOT / PACKAGE).glob("*.proto"))
    if not files:
        fail(f"no .proto files under {PROTO_ROOT / PACKAGE}")
    return files


def generate(out: Path) -> list[Path]:
    """Run protoc into ``out``; return the generated files relative to ``out``, sorted."""
    import grpc_tools  # type: ignore[import-untyped]  # late: check_versions() explains

    protos = proto_files()
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--plugin=protoc-gen-mypy={plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *(str(p.relative_to(PROTO_ROOT)) for p in protos),
    ]
    run = subprocess.run(cmd, cwd=PROTO_ROOT, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        fail(f"protoc failed (exit {run.returncode}):\n{run.stdout}{run.stderr}")
    # grpc_tools writes a *_pb2_grpc module even for files without a service: drop those.
    for proto in protos:
        if not _SERVICE_RE.search(proto.read_text(encoding="utf-8")):
            for suffix in ("_pb2_grpc.py", "_pb2_grpc.pyi"):
                (out / PACKAGE / f"{proto.stem}{suffix}").unlink(missing_ok=True)
    return sorted(p.relative_to(out) for g in GENERATED_GLOBS for p in (out / PACKAGE).glob(g))


def existing(root: Path) -> list[Path]:
    return sorted(p for g in GENERATED_GLOBS for p in (root / PACKAGE).glob(g))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        help="write the generated tree under this folder instead of the repository root",
    )
    parser.add_argument(
        "--check-tools",
        action="store_true",
        help="only check that the pinned generators are installed (exit 1 if not)",
    )
    parser.add_argument(
        "--pins", action="store_true", help="print the pinned generator requirements and exit"
    )
    args = parser.parse_args(argv)
    if args.pins:
        print(" ".join(f"{d}=={v}" for d, v in PINNED.items()))
        return 0
    check_versions()
    if args.check_tools:
        return 0
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for stale in existing(args.out):
            stale.unlink()
        files = generate(args.out)
        print(f"gen_proto: wrote {len(files)} files under {args.out / PACKAGE}")
        return 0
    with tempfile.TemporaryDirectory(prefix="kvxferd-proto-") as tmp:
        files = generate(Path(tmp))
        for stale in existing(ROOT):
            stale.unlink()
        (ROOT / PACKAGE).mkdir(parents=True, exist_ok=True)
        for rel in files:
            shutil.copyfile(Path(tmp) / rel, ROOT / rel)
    print(f"gen_proto: regenerated {len(files)} files in {PACKAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
