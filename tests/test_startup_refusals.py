"""Bad start-up input ends in one line naming what to fix, never in a traceback: config and spec
files that cannot be read, non-integral or non-finite numbers, oversized memory, presets."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvxferd.config import load_config
from kvxferd.errors import ConfigError, SpecError
from kvxferd.layout.presets import preset
from kvxferd.layout.tomlspec import load_spec

ROOT = Path(__file__).resolve().parents[1]


def test_config_that_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory") as ei:
        load_config(tmp_path, env={})
    assert ei.value.field == "--config"


def test_config_that_is_not_utf8(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_bytes(b"\xff\xfe[server]\n")
    with pytest.raises(ConfigError, match="not UTF-8") as ei:
        load_config(p, env={})
    assert ei.value.field == "--config"


def test_top_level_key_is_not_called_a_section(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("max_inflight = 1\n")
    with pytest.raises(ConfigError, match="outside any") as ei:
        load_config(p, env={})
    assert ei.value.field == "max_inflight"


@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "1.9", "2.0"])
def test_integer_key_refuses_a_toml_float(tmp_path: Path, value: str) -> None:
    p = tmp_path / "c.toml"
    p.write_text(f"[transfer]\nmax_inflight = {value}\n")
    with pytest.raises(ConfigError, match="not an integer") as ei:
        load_config(p, env={})
    assert ei.value.field == "transfer.max_inflight"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_float_key_refuses_a_non_finite_number(value: str) -> None:
    with pytest.raises(ConfigError, match="not a finite number") as ei:
        load_config(None, env={}, overrides={"server.drain_timeout_s": value})
    assert ei.value.field == "server.drain_timeout_s"


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("server.drain_timeout_s", "-1", ">= 0"),
        ("server.engine_socket", "/tmp/" + "e" * 110, "at most 107 bytes"),
        ("server.scheduler_socket", "/tmp/" + "s" * 110, "at most 107 bytes"),
    ],
)
def test_server_keys_out_of_range_are_named(key: str, value: str, match: str) -> None:
    """Seen by the start-up helper and left for later: a negative drain time started, and an
    Engine socket path too long for sun_path failed only when the socket was created."""
    with pytest.raises(ConfigError, match=match) as ei:
        load_config(None, env={}, overrides={key: value})
    assert ei.value.field == key


def test_nixl_key_is_named() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(None, env={}, overrides={"nixl.num_threads": "-5"})
    assert ei.value.field == "nixl.num_threads"


def test_device_must_be_cpu_or_cuda_n() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(None, env={}, overrides={"pool.device": "cuda:x"})
    assert ei.value.field == "pool.device"


def test_a_device_that_is_not_visible_is_refused() -> None:
    from kvxferd.service.memory import check_device

    torch = pytest.importorskip("torch")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ConfigError, match="cannot be used") as ei:
        check_device(f"cuda:{visible}")
    assert ei.value.field == "pool.device"


def test_huge_staging_ring_is_refused_naming_the_keys() -> None:
    huge = {"transfer.staging_chunks": "100000000", "transfer.staging_chunk_bytes": str(1 << 40)}
    with pytest.raises(ConfigError, match="staging_chunk_bytes") as ei:
        load_config(None, env={}, overrides=huge)
    assert ei.value.field == "transfer.staging_chunks"


def test_staging_ring_allocation_failure_is_one_line() -> None:
    from kvxferd.service.memory import staging_ring

    # Past what the loader lets through, as a config built in code could be: torch refuses.
    cfg = load_config(None, env={})
    cfg = replace(cfg, transfer=replace(cfg.transfer, staging_chunks=1 << 30))
    cfg = replace(cfg, transfer=replace(cfg.transfer, staging_chunk_bytes=1 << 40))
    with pytest.raises(ConfigError, match="cannot allocate the staging ring") as ei:
        staging_ring(cfg)
    assert ei.value.field == "transfer.staging_chunks"


def test_pool_allocation_failure_names_the_preset() -> None:
    from kvxferd.service.memory import owned_pool

    cfg = load_config(None, env={}, overrides={"pool.preset": "dense:num_blocks=100000000000"})
    with pytest.raises(ConfigError, match="cannot allocate the pool") as ei:
        owned_pool(cfg)
    assert ei.value.field == "pool.preset"
    assert "\n" not in str(ei.value)


def test_spec_file_that_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="is a directory"):
        load_spec(tmp_path)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("dense:num_blocks=abc", "preset.num_blocks"),
        ("dense:num_blocks=0", "preset.num_blocks"),
        ("hybrid:ppl=1.5", "preset.ppl"),
        ("dense:cross_layer=maybe", "preset.cross_layer"),
        ("dense:num_blocks=1,x=2", "preset.x"),
    ],
)
def test_preset_option_errors_name_the_option(text: str, field: str) -> None:
    with pytest.raises(SpecError) as ei:
        preset(text)
    assert ei.value.field == field
    assert field.split(".")[1] in str(ei.value)


def test_preset_string_options_stay_strings() -> None:
    with pytest.raises(SpecError, match="unknown KV dtype"):  # was AttributeError on int 8
        preset("dense:num_blocks=1,dtype=8")
    assert preset("dense:num_blocks=1,num_layers=1,cross_layer=1").regions[0].name == "layers"


def test_ready_file_in_a_missing_directory(tmp_path: Path) -> None:
    from kvxferd.commands.serve import check_ready_file

    with pytest.raises(ConfigError, match="does not exist") as ei:
        check_ready_file(str(tmp_path / "nope" / "ready.json"))
    assert ei.value.field == "--ready-file"
    with pytest.raises(ConfigError, match="is a directory"):
        check_ready_file(str(tmp_path))


@pytest.mark.parametrize("case", ["config-dir", "ready-file"])
def test_serve_refuses_in_one_line_before_binding(tmp_path: Path, case: str) -> None:
    argv = ["--listen", "127.0.0.1:0", "--metrics-listen", "", "--preset", "dense:num_blocks=1"]
    if case == "config-dir":
        argv += ["--config", str(tmp_path)]
    else:
        argv += ["--ready-file", str(tmp_path / "missing" / "ready.json")]
    proc = subprocess.run(
        [sys.executable, "-m", "kvxferd", "serve", *argv],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvxferd: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "missing").exists()


# A daemon whose owned pool's VRAM torch cannot allocate. There is no GPU to exhaust here, so
# the subprocess fakes the fault: pool.device is taken as visible and KVPool.allocate raises
# the torch.OutOfMemoryError CUDA's caching allocator raises.
FAKE_VRAM_OOM = """
import sys
import torch
import kvxferd.service.memory as memory
from kvxferd.cli import main
from kvxferd.pool import KVPool

def oom(cls, spec, device="cpu"):
    raise torch.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {spec.nbytes} bytes. GPU 0 has a total"
        " capacity of 79.19 GiB of which 1.00 GiB is free.\\nOf the allocated memory ...")

memory.check_device = lambda device: None
KVPool.allocate = classmethod(oom)
raise SystemExit(main(sys.argv[1:]))
"""


def test_serve_refuses_a_vram_pool_it_cannot_allocate_in_one_line() -> None:
    argv = ["serve", "--listen", "127.0.0.1:0", "--metrics-listen", ""]
    argv += ["--preset", "dense:num_blocks=1", "--device", "cuda:0"]
    proc = subprocess.run(
        [sys.executable, "-c", FAKE_VRAM_OOM, *argv],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvxferd: error: pool.preset: "), proc.stderr
    nbytes = preset("dense:num_blocks=1").nbytes
    assert f"cannot allocate the pool's {nbytes} bytes on cuda:0" in lines[0], lines[0]
    assert "fewer blocks" in lines[0] and "free memory on cuda:0" in lines[0], lines[0]
