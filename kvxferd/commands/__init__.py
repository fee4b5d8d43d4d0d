"""The ``kvxferd`` subcommands: one small module per command, wired by :mod:`kvxferd.cli`.

A command module exposes two functions (the :class:`Command` protocol):

* ``add_parser(subparsers) -> ArgumentParser``: add its subparser and arguments;
* ``run(args) -> int``: do the work and return the exit status (0 ok, 1 refused or invalid
  request, 2 usage). It may raise :class:`~kvxferd.errors.KvxferdError` for user errors;
  :func:`kvxferd.cli.main` prints those as ``kvxferd: error: ...`` and returns 2.

This module also holds the argument types several commands share (``SPEC``, ``RANK/SIZE``,
block-ID lists). Argument errors surface as argparse usage errors (exit 2). Commands may import
any kvxferd package; nothing but :mod:`kvxferd.cli` imports this package.
"""

from __future__ import annotations

import argparse
import os
from typing import Protocol, TypeAlias

from kvxferd.blocks import DEFAULT_MAX_IDS
from kvxferd.errors import KvxferdError
from kvxferd.layout import KVCacheSpec, load_spec, preset

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class Command(Protocol):
    """What :mod:`kvxferd.cli` needs from a command module."""

    def add_parser(self, subparsers: Subparsers) -> argparse.ArgumentParser: ...

    def run(self, args: argparse.Namespace) -> int: ...


def spec_arg(text: str) -> KVCacheSpec:
    """``SPEC``: a TOML spec file (``*.toml`` or an existing path) or a preset string
    (``hybrid:ppl=34,num_blocks=64``)."""
    is_path = text.endswith(".toml") or os.sep in text or os.path.isfile(text)
    try:
        return load_spec(text) if is_path else preset(text)
    except KvxferdError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse ``type=``)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return n


def tp_arg(text: str) -> tuple[int, int]:
    """``RANK/SIZE`` (``0/1``, ``3/4``) -> ``(rank, size)`` with ``0 <= rank < size``."""
    rank_s, slash, size_s = text.partition("/")
    try:
        rank, size = int(rank_s), int(size_s)
    except ValueError:
        rank = size = -1
    if not slash or size < 1 or not 0 <= rank < size:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not RANK/SIZE with SIZE >= 1 and 0 <= RANK < SIZE (e.g. 0/2)"
        )
    return rank, size


def _id_item(item: str, budget: int) -> list[int]:
    lo_s, dash, hi_s = item.partition("-")
    try:
        lo = int(lo_s)
        hi = int(hi_s) if dash else lo
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{item!r} is not a block ID or a range like 0-9 (IDs are integers >= 0)"
        ) from None
    if lo < 0 or hi < lo:
        raise argparse.ArgumentTypeError(
            f"range {item!r} is empty or negative: write LO-HI, LO<=HI"
        )
    if hi - lo + 1 > budget:
        raise argparse.ArgumentTypeError(f"range {item!r} has more than {DEFAULT_MAX_IDS} IDs")
    return list(range(lo, hi + 1))


def block_ids_arg(text: str) -> list[list[int]]:
    """``"0,1,2;3,4"`` -> ``[[0, 1, 2], [3, 4]]``: groups split by ``;`` (in the spec's group
    order), IDs by ``,``, ``LO-HI`` an inclusive range; an empty group is written as nothing
    (``"0-3;"``). IDs are logical; duplicates and bounds are checked by the planner."""
    groups: list[list[int]] = []
    for part in text.split(";"):
        ids: list[int] = []
        for item in filter(None, (s.strip() for s in part.split(","))):
            ids.extend(_id_item(item, DEFAULT_MAX_IDS - len(ids)))
        groups.append(ids)
    return groups
