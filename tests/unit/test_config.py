"""Flags, config files and their one-line errors (no processes, no training)."""

from __future__ import annotations

import pytest

from open_diloco.cli import parse, run
from open_diloco.config import CkptConfig, Config, HvConfig, check_against_world
from open_diloco.errors import ConfigError
from open_diloco.optim import warmup_cosine

BASE = ["--fake-data", "--path-model", "tests/models/llama-2m-fresh"]


def config_of(*argv: str) -> Config:
    _, bound = parse([*BASE, *argv] if "--config" not in argv else list(argv))
    return bound.arguments["config"]


def test_seed_style_flags_parse():
    config = config_of(
        "--per-device-train-batch-size",
        "4",
        "--total-batch-size",
        "16",
        "--lr",
        "1e-2",
        "--metric-logger-type",
        "dummy",
        "--no-torch-compile",
        "--max-steps",
        "5",
        "--seq-length",
        "1024",
        "--precision",
        "bf16-mixed",
    )
    assert (config.per_device_train_batch_size, config.total_batch_size, config.lr) == (4, 16, 1e-2)
    assert config.torch_compile is False and config.precision == "bf16-mixed" and config.hv is None


def test_hv_flags_turn_the_galaxy_on():
    config = config_of(
        "--hv.initial-peers",
        "/ip4/127.0.0.1/tcp/1/p2p/QmA",
        "/ip4/127.0.0.1/tcp/2/p2p/QmB",
        "--hv.galaxy-size",
        "2",
        "--hv.world-rank",
        "1",
        "--hv.local-steps",
        "10",
    )
    assert config.hv is not None
    assert config.hv.initial_peers == ["/ip4/127.0.0.1/tcp/1/p2p/QmA", "/ip4/127.0.0.1/tcp/2/p2p/QmB"]
    assert (config.hv.galaxy_size, config.hv.world_rank, config.hv.local_steps) == (2, 1, 10)
    assert (config.hv.outer_lr, config.hv.outer_momentum) == (1.0, 0.0)


def test_announce_maddrs_take_dialable_addresses():
    # parsed only: nothing is dialled (203.0.113.0/24 is the documentation range)
    announced = ["/ip4/203.0.113.7/tcp/31337", "/dns/cluster.example.org/tcp/31337", "/ip6/2001:db8::1/tcp/1"]
    config = config_of("--hv.galaxy-size", "2", "--hv.announce-maddrs", *announced)
    assert config.hv.announce_maddrs == announced


def test_config_file_with_flag_override(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'fake_data = true\npath_model = "tests/models/llama-2m-fresh"\nlr = 0.002\nmax_steps = 7\n'
        "[hv]\ngalaxy_size = 3\nlocal_steps = 4\n"
    )
    config = config_of("--config", str(path), "--lr", "0.01", "--hv.world-rank", "2")
    assert config.lr == 0.01 and config.max_steps == 7  # flag wins, file fills the rest
    assert (config.hv.galaxy_size, config.hv.world_rank, config.hv.local_steps) == (3, 2, 4)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bogus"], "Unknown option: --bogus"),
        (["--lr", "-1"], "--lr: Input should be greater than 0"),
        (["--precision", "fp8"], "--precision: Input should be"),
        (
            ["--total-batch-size", "10", "--per-device-train-batch-size", "4"],
            "not a multiple of --per-device",
        ),
        (
            ["--hv.galaxy-size", "2", "--hv.world-rank", "5"],
            "--hv.world-rank 5 is not below --hv.galaxy-size 2",
        ),
        (
            ["--hv.galaxy-size", "2", "--hv.world-rank", "0", "--hv.cluster-id", "site-b"],
            "--hv.cluster-id site-b names a cluster of an elastic galaxy, --hv.world-rank 0 one of a fixed",
        ),
        (
            ["--hv.local-steps", "10", "--ckpt.interval", "15"],
            "--ckpt.interval 15 is not a multiple of --hv.local-steps 10",
        ),
        (["--config", "/nonexistent.toml"], "config file /nonexistent.toml does not exist"),
        (
            ["--hv.announce-maddrs", "not-a-multiaddr"],
            "--hv.announce-maddrs 'not-a-multiaddr' is not an address others can dial",
        ),
        (
            ["--hv.announce-maddrs", "/ip4/0.0.0.0/tcp/31337"],
            "--hv.announce-maddrs '/ip4/0.0.0.0/tcp/31337' is not an address others can dial",
        ),
        (["--hv.host-maddrs", "/ip4/1.2.3.4"], "--hv.host-maddrs '/ip4/1.2.3.4' is not a valid listen"),
        (
            ["--hv.initial-peers", "/ip4/1.2.3.4/tcp/1"],
            "--hv.initial-peers '/ip4/1.2.3.4/tcp/1' is not a full",
        ),
        (["--lr", "inf"], "--lr: Input should be a finite number"),
        (["--max-grad-norm", "nan"], "--max-grad-norm: Input should be a finite number"),
        (["--adam-betas", "1.5", "0.9"], "--adam-betas: Input should be less than 1"),
        (["--seed", "-1"], "--seed: Input should be greater than or equal to 0"),
        (["--num-workers", "100000"], "--num-workers: Input should be less than or equal to 64"),
        (["--ckpt.interval", "0"], "--ckpt.interval: Input should be greater than or equal to 1"),
        (["--hv.run-id="], "--hv.run-id: String should have at least 1 character"),
        (
            ["--hv.matchmaking-time", "200"],
            "--hv.averaging-timeout 120.0 is not above --hv.matchmaking-time 200.0",
        ),
        (
            ["--hv.local-steps", "10", "--hv.fragments", "4"],
            "--hv.fragments 4 does not divide --hv.local-steps 10",
        ),
        (
            ["--hv.local-steps", "8", "--hv.fragments", "4", "--hv.sync-delay", "3"],
            "--hv.sync-delay 3 is above --hv.local-steps/--hv.fragments = 2",
        ),
        (
            ["--hv.local-steps", "8", "--hv.fragments", "2", "--hv.compression", "sparse"],
            "--hv.compression sparse does not combine with --hv.fragments or --hv.sync-delay",
        ),
        (
            ["--hv.local-steps", "8", "--hv.sync-delay", "2", "--hv.compression", "sparse"],
            "--hv.compression sparse does not combine with --hv.fragments or --hv.sync-delay",
        ),
    ],
)
def test_bad_flags_give_one_line(argv, message, capsys):
    assert run([*BASE, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("open-diloco: error:") and message in err[0], err


def test_no_data_source_is_refused(capsys):
    assert run(["--path-model", "tests/models/llama-2m-fresh"]) == 2
    assert "pass --fake-data or --dataset-path" in capsys.readouterr().err


def test_world_size_checks():
    config = config_of("--per-device-train-batch-size", "4", "--total-batch-size", "16")
    assert check_against_world(config, 1) == 4 and check_against_world(config, 2) == 2
    with pytest.raises(ConfigError, match="fewer ranks"):
        check_against_world(config, 3)


def test_warmup_cosine_schedule():
    factors = [warmup_cosine(step, 4, 20, 0.1) for step in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == pytest.approx(1.0) and factors[-1] == pytest.approx(0.1, abs=0.01)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:], strict=False))


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("run.toml", "fake_data = true\n\nlr = \n", "run.toml, line 3: Invalid value: fix the TOML syntax"),
        (
            "run.toml",
            "fake_data = true\nmax_steps = [\n",
            "run.toml, line 3: Invalid value at the end of the file",
        ),
        (
            "run.yaml",
            "fake_data: true\nlr: 0.1\n  x: : y\n",
            "run.yaml, line 3: mapping values are not allowed here",
        ),
        (
            "run.json",
            '{\n"lr": 0.1,\n}',
            "run.json, line 3: Expecting property name enclosed in double quotes",
        ),
    ],
)
def test_a_config_file_that_does_not_parse_names_the_file_and_line(tmp_path, name, text, message, capsys):
    path = tmp_path / name
    path.write_text(text)
    for argv in (["--config", str(path)], ["check-config", str(path)]):
        assert run(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"open-diloco: error: config file {tmp_path / message}" in err[0], err


def test_a_config_path_that_is_a_directory_is_refused(tmp_path, capsys):
    assert run(["--config", str(tmp_path)]) == 2
    assert f"config file {tmp_path} is not a file: check the path" in capsys.readouterr().err


def test_every_bounded_numeric_flag_shows_its_range_in_help(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    assert run(["--help"]) == 0
    lines = {
        line.split()[1]: line for line in capsys.readouterr().out.splitlines() if line.startswith("│ --")
    }
    expected = {
        "--lr": "[range: > 0]",
        "--min-lr-ratio": "[range: 0 ≤ x ≤ 1]",
        "--total-steps": "[range: ≥ 1]",  # optional fields show their range too
        "--adam-betas": "[range: each 0 ≤ x < 1]",
        "--hv.outer-momentum": "[range: 0 ≤ x < 1]",
        "--ckpt.keep": "[range: ≥ 1]",
    }
    for flag, text in expected.items():
        assert text in lines[flag], lines[flag]
    for model in (Config, HvConfig, CkptConfig):
        for name, field in model.model_fields.items():
            constrained = any(hasattr(c, attr) for c in field.metadata for attr in ("ge", "gt", "le", "lt"))
            assert not constrained or "[range: " in (field.description or ""), name


def test_an_unknown_key_in_a_config_file_names_the_file_and_key(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text("fake_data = true\n[hv]\ngalaxy_sise = 2\n")
    assert run(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"open-diloco: error: config file {path}: unknown key 'hv.galaxy_sise': keys are the flag names "
        "without `--` (see --help), `hv` and `ckpt` as tables"
    ], err


def test_client_mode_needs_initial_peers():
    with pytest.raises(ValueError, match="--hv.client-mode needs --hv.initial-peers"):
        HvConfig(client_mode=True)
    peer = "/ip4/127.0.0.1/tcp/30001/p2p/QmagjJLRAPuA3dYGRvKJLdZahHz66hHyTkNKHgg3vXnhK3"
    assert HvConfig(client_mode=True, initial_peers=[peer]).client_mode


def test_auto_client_mode_needs_initial_peers_and_replaces_client_mode():
    peer = "/ip4/127.0.0.1/tcp/30001/p2p/QmagjJLRAPuA3dYGRvKJLdZahHz66hHyTkNKHgg3vXnhK3"
    with pytest.raises(ValueError, match="--hv.auto-client-mode needs --hv.initial-peers"):
        HvConfig(auto_client_mode=True)
    with pytest.raises(ValueError, match="drop --hv.client-mode, or drop --hv.auto-client-mode"):
        HvConfig(auto_client_mode=True, client_mode=True, initial_peers=[peer])
    assert HvConfig(auto_client_mode=True, initial_peers=[peer]).auto_client_mode


def test_gc_interval_is_a_count_of_steps():
    assert Config(fake_data=True, gc_interval=0).gc_interval == 0
    with pytest.raises(ValueError, match="gc_interval"):
        Config(fake_data=True, gc_interval=-1)
