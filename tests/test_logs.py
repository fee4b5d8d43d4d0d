"""Text logs: caller-controlled values cannot forge lines or fields."""

from __future__ import annotations

import ast
import io
import logging
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.logs import _TextFormatter, escape, kv


def render(msg: str, **fields: object) -> str:
    record = logging.LogRecord("kvxferd.t", logging.INFO, __file__, 1, msg, None, None)
    record.kv = fields
    return _TextFormatter().format(record)


@given(st.text(), st.text())
def test_one_event_is_one_line(msg: str, value: str) -> None:
    line = render(msg, request_id=value)
    assert len(line.splitlines()) == 1 and "\x00" not in line


def unescape(text: str) -> str:
    named = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\"}

    def one(m: re.Match[str]) -> str:
        e = m.group(1)
        return named.get(e) or chr(int(e[1:], 16))

    return re.sub(r"\\(x[0-9a-f]{2}|u[0-9a-f]{4}|[nrt\\])", one, text)


@given(st.text())
def test_escape_is_unambiguous(text: str) -> None:
    escaped = escape(text)
    assert unescape(escaped) == text
    assert not any(c in escaped for c in "\n\r\x00\x85\u2028\u2029")


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("a\nb", "a\\nb"),
        ("nul\x00", "nul\\x00"),
        ("x y=z", '"x y=z"'),
        ('q"', '"q\\""'),
        ("", '""'),
        ("line\u2028sep", "line\\u2028sep"),
    ],
)
def test_values_are_escaped_and_quoted(value: str, shown: str) -> None:
    assert render("held", request_id=value).endswith(f" request_id={shown}")


def test_traceback_lines_are_indented() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_TextFormatter())
    log = logging.getLogger("kvxferd.test_logs")
    log.addHandler(handler)
    log.propagate = False
    try:
        raise ValueError("boom\nINJECTED")
    except ValueError:
        log.exception("failed", extra=kv(request_id="r"))
    finally:
        log.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("failed request_id=r")
    assert all(line.startswith("    | ") for line in lines[1:]), lines


_LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
# kvxferd.vllm runs inside vLLM's process and logs through vLLM's handlers, which print the
# message alone: there the values belong in the message.
_OWN_HANDLERS_ONLY = ("vllm",)


def _printf_style_log_calls(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if not (isinstance(node.func.value, ast.Name) and node.func.value.id in ("log", "logger")):
            continue
        method = node.func.attr
        if method not in _LEVELS and method != "log":
            continue
        args = node.args[1:] if method == "log" else node.args
        if not args:
            continue
        msg = args[0]
        text = msg.value if isinstance(msg, ast.Constant) and isinstance(msg.value, str) else ""
        if len(args) > 1 or "event=" in text or isinstance(msg, ast.JoinedStr):
            found.append(f"{path}:{node.lineno}: {ast.unparse(node)[:100]}")
    return found


def test_kvxferd_logs_a_fixed_message_with_its_values_as_fields() -> None:
    """One structured style: ``log.info("pull done", extra=kv(...))``, never values formatted
    into the message (printf arguments, f-strings, ``event=...`` text), which arrive as one
    unqueryable string in the JSON stream."""
    root = Path(__file__).resolve().parents[1] / "kvxferd"
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in _OWN_HANDLERS_ONLY or rel.parts[0] == "v1":
            continue
        found += _printf_style_log_calls(path)
    assert not found, "pass the values as extra=kv(...) fields instead:\n" + "\n".join(found)
