"""Pairing one group's local and remote block IDs 1:1 by token position (docs/domain.md §5).

Rules, per group (local = the reader, decode side):

* **Attention, equal ppl** (prefix caching on or off): ``len(local) <= len(remote)`` or the
  request is refused; the local side holds the uncached **tail**, so keep the **last**
  ``len(local)`` remote logical IDs (end-trim), then expand both with the shared ppl.
* **Attention, different ppl**: refused when prefix caching is on (per request this silently
  corrupts data; the handshake refuses it too). Otherwise both lists start at token 0: expand
  each side with its **own** ppl and keep the **first** ``min`` kernel blocks of each, provided
  the counts differ by less than one logical block (``max(ppl)`` kernel blocks); a larger
  difference is refused. (Keeping each side's *last* logical blocks instead would pair
  tokens 384-767 with 0-639 in the 640-token example.)
* Pairing kernel blocks 1:1 needs **equal kernel block sizes** (in tokens); otherwise refused.
* **State groups** (Mamba): never expanded, never cut token-wise; states pair element-wise.
  Equal lengths pair in order. With prefix caching on, a shorter local list pairs with the
  **last** ``len(local)`` remote states (the decode side already holds the states of its
  cached prefix and needs the latest ones: the same end-alignment as attention). Any other
  length difference is refused.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvxferd.blocks.expand import expand_group
from kvxferd.blocks.ranges import Int64Array
from kvxferd.errors import InvalidRequest, SpecError
from kvxferd.layout.spec import KVGroup


def _tail(arr: Int64Array, n: int) -> Int64Array:
    """The last ``n`` elements (``n == 0`` gives an empty array, unlike ``arr[-0:]``)."""
    return arr[arr.shape[0] - n :]


def pair_group(
    local_group: KVGroup,
    remote_group: KVGroup,
    local_logical_ids: npt.ArrayLike,
    remote_logical_ids: npt.ArrayLike,
    *,
    prefix_caching: bool,
    field: str = "",
) -> tuple[Int64Array, Int64Array]:
    """Pair one group's IDs; returns ``(local_kernel_ids, remote_kernel_ids)``, equal length.

    Inputs are validated logical IDs, shape ``(n_local,)`` and ``(n_remote,)``. Outputs are
    int64 kernel IDs, shape ``(k,)`` each, where element ``i`` of both covers the same token
    positions (attention) or the same state (state groups). ``field`` (``groups[1]``) prefixes
    error fields. Raises :class:`InvalidRequest` (or :class:`SpecError` for unpairable groups).
    """
    local = np.asarray(local_logical_ids, dtype=np.int64).reshape(-1)
    remote = np.asarray(remote_logical_ids, dtype=np.int64).reshape(-1)
    n_l, n_r = local.shape[0], remote.shape[0]
    if local_group.kind != remote_group.kind:
        raise SpecError(
            f"group kinds differ: local {local_group.name!r} is {local_group.kind.value},"
            f" remote {remote_group.name!r} is {remote_group.kind.value}",
            field=field or "groups",
            fix="both peers must serve the same model with the same KV cache groups",
        )

    if local_group.kind.is_state:
        if n_l == n_r:
            return local.copy(), remote.copy()
        if prefix_caching and n_l < n_r:
            return local.copy(), _tail(remote, n_l).copy()
        why = (
            "more local than remote states"
            if n_l > n_r
            else "a shorter local list only pairs with prefix caching on"
        )
        raise InvalidRequest(
            f"state group {local_group.name!r}: {n_l} local states cannot pair with {n_r}"
            f" remote states ({why})",
            field=f"{field}.local_block_ids" if field else "local_block_ids",
            fix="pass one local state per remote state",
        )

    if local_group.kernel_block_size != remote_group.kernel_block_size:
        raise SpecError(
            f"group {local_group.name!r}: kernel block sizes differ (local"
            f" {local_group.kernel_block_size}, remote {remote_group.kernel_block_size} tokens);"
            " this pairing is 1:1 by kernel block",
            field=field or "groups",
            fix="pair groups whose kernel block sizes differ at the chunk"
            " (kvxferd.blocks.reblock.pair_chunks; plan_pull does)",
        )
    ppl_l, ppl_r = local_group.ppl, remote_group.ppl

    if ppl_l == ppl_r:
        if n_l > n_r:
            raise InvalidRequest(
                f"group {local_group.name!r}: {n_l} local blocks but the remote exported only"
                f" {n_r}; the local side may hold fewer blocks (a cached prefix), never more",
                field=f"{field}.local_block_ids" if field else "local_block_ids",
                fix="pass at most as many local block IDs as remote block IDs",
            )
        return expand_group(local_group, local), expand_group(remote_group, _tail(remote, n_l))

    if prefix_caching:
        raise InvalidRequest(
            f"group {local_group.name!r}: kernel blocks per logical block differ (local ppl"
            f" {ppl_l}, remote ppl {ppl_r}) while prefix caching is on; the cached prefix"
            " cannot be aligned and the transfer would corrupt data",
            field=field or "groups",
            fix="disable prefix caching on both peers, or give them equal logical block sizes",
        )
    k_l, k_r = n_l * ppl_l, n_r * ppl_r
    slack = max(ppl_l, ppl_r)
    if abs(k_l - k_r) >= slack:
        raise InvalidRequest(
            f"group {local_group.name!r}: {n_l} local logical blocks = {k_l} kernel blocks"
            f" (ppl {ppl_l}) vs {n_r} remote logical blocks = {k_r} kernel blocks (ppl {ppl_r});"
            f" they differ by {abs(k_l - k_r)}, at least one logical block ({slack})",
            field=field or "groups",
            fix="pass block lists that cover the same prompt on both sides",
        )
    k = min(k_l, k_r)
    return expand_group(local_group, local)[:k], expand_group(remote_group, remote)[:k]
