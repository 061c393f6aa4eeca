"""Preflight checks in-process: verdicts, fixes and timeouts, without launching anything."""

from __future__ import annotations

import socket
import time

import pytest

from open_diloco.config import Config, HvConfig
from open_diloco.preflight import (
    Check,
    CheckFailed,
    Launch,
    check_dht_peers,
    check_master,
    check_outputs,
    parse_multiaddr,
    run_checks,
)

PEER = "QmXc1oLBNYWfMVjXbqVaAkGLhZ5vmjzxTqqgYkomR4HTfo"


def test_parse_multiaddr():
    assert parse_multiaddr(f"/ip4/10.0.0.1/tcp/31337/p2p/{PEER}") == ("10.0.0.1", 31337)
    assert parse_multiaddr(f"/dns4/dht.example.org/tcp/30001/p2p/{PEER}") == ("dht.example.org", 30001)
    for bad in ("/ip4/10.0.0.1/tcp/31337", f"/ip4/10.0.0.1/udp/1/quic/p2p/{PEER}", "10.0.0.1:31337"):
        with pytest.raises(CheckFailed, match="PEER_ID multiaddr"):
            parse_multiaddr(bad)


def test_every_check_runs_and_a_hung_one_times_out():
    lines: list[str] = []
    started = time.monotonic()

    def fail():
        raise CheckFailed("broken", "mend it")

    ok = run_checks(
        [
            Check("slow", lambda: time.sleep(30) or "", 0.3),
            Check("bad", fail, 1),
            Check("good", lambda: "fine", 1),
        ],
        lines.append,
    )
    assert not ok and time.monotonic() - started < 5
    assert lines[0].startswith("preflight: FAIL slow") and "no answer within 0.3 s" in lines[0]
    assert lines[1] == "preflight: FAIL bad         broken; fix: mend it"
    assert lines[2] == "preflight: PASS good        fine"
    assert lines[3].startswith("preflight: 2 of 3 checks FAILED")


def test_master_port_in_use_fails_on_node_0_and_is_reached_by_node_1():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with pytest.raises(CheckFailed, match="already in use"):
            check_master(Launch(2, 0, "127.0.0.1", port), 1, 1)
        assert "reached rendezvous" in check_master(Launch(2, 1, "127.0.0.1", port), 1, 1)


def test_unresolvable_master_fails_at_once():
    started = time.monotonic()
    with pytest.raises(CheckFailed, match="does not resolve"):
        check_master(Launch(2, 1, "no-such-host.invalid", 29500), 1, 30)
    assert time.monotonic() - started < 10


def test_dht_peers():
    config = Config(fake_data=True)
    with pytest.raises(Exception, match="galaxy off"):
        check_dht_peers(config, 1)
    assert "starts the galaxy's DHT" in check_dht_peers(config.model_copy(update={"hv": HvConfig()}), 1)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        maddr = f"/ip4/127.0.0.1/tcp/{server.getsockname()[1]}/p2p/{PEER}"
        hv = HvConfig(initial_peers=[maddr])
        assert "1 initial peer(s)" in check_dht_peers(config.model_copy(update={"hv": hv}), 1)
    with pytest.raises(CheckFailed, match="unreachable"):
        check_dht_peers(config.model_copy(update={"hv": hv}), 1)


def test_outputs_check_proves_the_paths_training_writes(tmp_path):
    config = Config(fake_data=True, metric_logger_type="jsonl", metrics_path=tmp_path / "m.jsonl")
    config.ckpt.interval, config.ckpt.path = 10, tmp_path / "ckpt"
    assert (
        check_outputs(config, Launch())
        == f"can write checkpoints in {tmp_path / 'ckpt'}, metrics to {tmp_path / 'm.jsonl'}"
    )
    assert (
        check_outputs(config, Launch(num_nodes=2, node_rank=1))
        == f"can write checkpoints in {tmp_path / 'ckpt'}"
    )
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    config.ckpt.path = blocker / "ckpt"
    with pytest.raises(
        CheckFailed, match=r"--ckpt.path .*/a_file/ckpt cannot be written \(Not a directory\)"
    ) as failed:
        check_outputs(config, Launch())
    assert "writable place" in failed.value.fix
