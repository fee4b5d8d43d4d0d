"""The handshake protocol version and the compatibility digest.

The digest covers exactly what must be identical on both peers whatever their TP sizes, so a
handshake can refuse a peer whose digest differs before decoding the rest of its payload: every
compatible pair has equal digests (the converse does not hold: TP sizes, KV heads per rank and
``ppl`` are checked by :func:`kvxferd.peers.compat.check_compatible`, which lists every
mismatch).
"""

from __future__ import annotations

import hashlib
import json

from kvxferd.layout.spec import KVCacheSpec
from kvxferd.peers._shapes import invariant_shape, layout_family

# History, one line per bump:
#   1: first protocol: spec regions/groups, TP rank/size, prefix caching, compat digest.
#   2: kernel block sizes may differ (pulls re-block): the digest no longer covers them.
PROTOCOL_VERSION = 2

DIGEST_HEX_CHARS = 16


def compat_digest(
    spec: KVCacheSpec,
    *,
    protocol_version: int = PROTOCOL_VERSION,
    include_layout: bool = True,
) -> str:
    """A short hash (16 hex chars) of the fields two peers' specs must share byte for byte.

    Covered: the protocol version, the model fingerprint; per group (in order) its kind; per
    region (in order) its name, group index, dtype,
    layout (only its family when ``include_layout`` is false, i.e. when NHD <-> HND conversion
    is configured) and its TP-invariant inner shape: the shape without the block dim and, for
    attention, without the KV-heads dim (heads per rank legitimately differ under
    heterogeneous TP) and without the tokens-per-block dim. Not covered, because they may
    differ: block counts, memory type, block stride, kernel and logical block sizes (``ppl``;
    pulls re-block between kernel block sizes that tile, docs/domain.md §5), KV heads per rank.
    """
    payload = {
        "v": protocol_version,
        "model": spec.model,
        "groups": [g.kind.value for g in spec.groups],
        "regions": [
            [
                r.name,
                r.group,
                r.dtype.value,
                r.layout.value if include_layout else layout_family(r.layout),
                list(invariant_shape(r, with_tokens=False)),
            ]
            for r in spec.regions
        ],
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:DIGEST_HEX_CHARS]
