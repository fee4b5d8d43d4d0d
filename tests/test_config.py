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
        ({"server.scheduler_socket": "/run/" + "s" * 110}, "server.scheduler_socket"),
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


def test_misspelled_environment_variable_is_refused_naming_the_closest_key() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(None, env={"KVXFERD_SERVER_LISTN": "127.0.0.1:1"})
    assert ei.value.field == "KVXFERD_SERVER_LISTN"
    assert "KVXFERD_SERVER_LISTEN (server.listen)" in str(ei.value)
    with pytest.raises(ConfigError, match="KVXFERD_PEERS_ALLOW"):
        load_config(None, env={"kvxferd_peers_alow": "x"})


def test_known_non_config_variables_are_left_alone() -> None:
    from kvxferd.config import NON_CONFIG_ENV

    assert {"KVXFERD_TOOLS_CACHE", "KVXFERD_NO_INSTALL", "KVXFERD_FUZZ_SECONDS"} <= NON_CONFIG_ENV
    load_config(None, env=dict.fromkeys(NON_CONFIG_ENV, "1"))
    doc = DOC.read_text()
    for var in NON_CONFIG_ENV:
        assert f"`{var}`" in doc, var


def test_every_kvxferd_variable_in_the_repository_is_a_key_or_known() -> None:
    """Scripts, docs and deploy files use no KVXFERD_* name that the daemon would refuse."""
    from kvxferd.config import NON_CONFIG_ENV, env_var

    root = DOC.parents[1]
    known = {env_var(k) for k in documented_keys()} | NON_CONFIG_ENV
    found: set[str] = set()
    for sub in ("deploy", "scripts", "docs", "bench", "kvxferd", "tests", ".ci"):
        for path in (root / sub).rglob("*"):
            if path.is_file() and path.suffix not in (".pyc", ".so", ".bin", ".npy"):
                text = path.read_text(errors="ignore")
                found |= set(re.findall(r"\bKVXFERD_[A-Z0-9_]*[A-Z0-9]\b", text))
    test_only = {"KVXFERD_SERVER_LISTN", "KVXFERD_SECTION_KEY"}
    assert not found - known - test_only, sorted(found - known - test_only)


@pytest.mark.parametrize(
    ("listen", "needle"),
    [
        ("127.0.0.1:99999", "out of range"),
        ("127.0.0.1:65536", "out of range"),
        ("::1:50051", "brackets"),
        ("[127.0.0.1]:1", "IPv6"),
        ("[::1:1", "IPv6"),
        ("127.0.0.1:-1", "host:port"),
        (":50051", "host:port"),
    ],
)
def test_listen_addresses_are_checked(listen: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)) as ei:
        load_config(None, env={}, overrides={"server.listen": listen})
    assert ei.value.field == "server.listen"


def test_ipv6_listen_addresses() -> None:
    from kvxferd.config import split_hostport

    assert split_hostport("[::1]:65535", "k") == ("::1", 65535)
    assert split_hostport("127.0.0.1:0", "k") == ("127.0.0.1", 0)
    load_config(None, env={}, overrides={"server.listen": "[::1]:0"})


@pytest.mark.parametrize(
    ("overrides", "field", "needle"),
    [
        ({"auth.token": "   "}, "auth.token", "whitespace"),
        ({"auth.token": "a b"}, "auth.token", "printable ASCII"),
        ({"auth.token_file": "  "}, "auth.token_file", "whitespace"),
        (
            {"server.listen": "0.0.0.0:1", "auth.token": "t"},
            "auth.token",
            "auth.allow_plaintext_token",
        ),
        (
            {"server.listen": "0.0.0.0:1", "auth.token_file": "/t"},
            "auth.token_file",
            "auth.tls_cert",
        ),
        ({"server.metrics_listen": "0.0.0.0:9400"}, "server.metrics_listen", "metrics_allow"),
        ({"server.metrics_listen": "10.0.0.1:99999"}, "server.metrics_listen", "out of range"),
        ({"peers.max_links": "0"}, "peers.max_links", "positive"),
        (
            {"peers.heartbeat_interval_ms": "5000", "peers.heartbeat_timeout_ms": "5000"},
            "peers.heartbeat_timeout_ms",
            "larger",
        ),
    ],
)
def test_fail_closed_settings(overrides: dict[str, str], field: str, needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(None, env={}, overrides=overrides)
    assert ei.value.field == field
    assert needle in str(ei.value)
    assert "../" + "shared" not in str(ei.value)  # split: the docs-link guard scans this file


def test_remote_metrics_with_an_opt_in() -> None:
    for opt in ("server.metrics_allow_remote", "server.allow_insecure_remote"):
        cfg = load_config(None, env={}, overrides={"server.metrics_listen": "0.0.0.0:1", opt: "1"})
        assert cfg.server.metrics_listen == "0.0.0.0:1"


def test_empty_token_file_resolves_to_an_error_not_to_no_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(" \n")
    cfg = load_config(None, env={}, overrides={"auth.token_file": str(token)})
    with pytest.raises(ConfigError) as ei:
        cfg.resolved_token()
    assert ei.value.field == "auth.token_file" and "empty" in str(ei.value)
    token.write_text("s3cret\n")
    assert cfg.resolved_token() == "s3cret"


def test_unknown_override_names_the_closest_key() -> None:
    with pytest.raises(ConfigError, match=r"did you mean server\.listen"):
        load_config(None, env={}, overrides={"sever.listen": "x"})
