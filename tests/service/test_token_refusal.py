"""kvxferd/service/auth.py ``token_refusal``: what a caller's ``authorization`` says, whatever it
holds. The sockets' JSON metadata can carry a lone surrogate, which once raised
UnicodeEncodeError and answered INTERNAL (a helper's hostile-input review)."""

from __future__ import annotations

from kvxferd.service.auth import token_refusal


def test_the_right_token_passes_and_any_other_is_refused_saying_which() -> None:
    assert token_refusal([("authorization", "Bearer s3cret")], b"Bearer s3cret", "M") is None
    assert token_refusal([("authorization", b"Bearer s3cret")], b"Bearer s3cret", "M") is None
    for value in ("Bearer nope", "\ud800", "Bearer \udcff", b"\xff\xfe"):
        why = token_refusal([("authorization", value)], b"Bearer s3cret", "Scheduler/M")
        assert why is not None and why.startswith("wrong token for Scheduler/M")
    why = token_refusal([("x-other", "Bearer s3cret")], b"Bearer s3cret", "M")
    assert why is not None and why.startswith("missing token")
