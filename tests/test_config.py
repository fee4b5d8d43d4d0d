"""Configuration: sources merge in order, bad values are refused with the key, docs agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvxferd.config import documented_keys, load_config
from kvxferd.errors import ConfigError

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_docs_list_exactly_the_keys_the_code_accepts() -> None:
    documented = set(re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \|", DOC.read_text(), re.M))
    assert documented == set(documented_keys())


def test_file_then_env_then_overrides(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[server]\nlisten = "127.0.0.1:1"\n[transfer]\nmax_inflight = 3\n')
    cfg = load_config(p, env={"KVXFERD_SERVER_LISTEN": "127.0.0.1:2"}, overrides={})
    assert cfg.server.listen == "127.0.0.1:2"
    assert cfg.transfer.max_inflight == 3
    cfg = load_config(
        p, env={}, overrides={"transfer.max_inflight": "9", "pool.prefix_caching": "on"}
    )
    assert cfg.transfer.max_inflight == 9
    assert cfg.pool.prefix_caching is True


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"server.listen": "0.0.0.0:50051"}, "server.listen"),
        ({"server.listen": "nope"}, "server.listen"),
        ({"transfer.max_inflight": "many"}, "transfer.max_inflight"),
        ({"transfer.max_inflight": "0"}, "transfer.max_inflight"),
        ({"pool.mode": "borrowed"}, "pool.mode"),
        ({"pool.tp_rank": "2", "pool.tp_size": "2"}, "pool.tp_rank"),
        ({"server.bogus": "1"}, "server.bogus"),
        ({"auth.tls_cert": "a.pem"}, "auth.tls_cert"),
        ({"log.level": "LOUD"}, "log.level"),
    ],
)
def test_bad_values_name_the_key(overrides: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(None, env={}, overrides=overrides)
    assert ei.value.field == field
    assert str(ei.value)


def test_remote_listen_is_allowed_with_a_token_or_explicit_opt_in() -> None:
    remote = {"server.listen": "0.0.0.0:1"}
    load_config(
        None,
        env={},
        overrides={**remote, "auth.token": "t", "auth.tls_cert": "c.pem"}
        | {"auth.tls_key": "k.pem"},
    )
    load_config(
        None, env={}, overrides={**remote, "auth.token": "t", "auth.allow_plaintext_token": "1"}
    )
    load_config(None, env={}, overrides={**remote, "server.allow_insecure_remote": "1"})


def test_unknown_section_in_file(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[srever]\nlisten = 1\n")
    with pytest.raises(ConfigError, match="unknown section"):
        load_config(p, env={})


def test_serve_flags_map_to_documented_keys() -> None:
    from kvxferd.commands import serve

    doc = DOC.read_text()
    for key in serve._FLAGS.values():
        assert key in documented_keys()
        assert f"`{key}`" in doc
    help_text = serve.add_parser(
        __import__("argparse").ArgumentParser().add_subparsers()
    ).format_help()
    for key in serve._FLAGS.values():
        assert key in help_text, key
    assert "docs/config.md" in help_text
