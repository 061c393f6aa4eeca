"""scripts/wan/control.py: a running lab's link cut and healed, its loss raised and lowered, from outside the
process that holds the lab (what the chaos soak does). Needs root, as every lab does."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from scripts.wan import control
from scripts.wan.lab import Lab
from tests.conftest import REPO
from tests.wan.test_wan import needs_root

# one lab at a time: the links' delays and rates are what these tests measure
pytestmark = [pytest.mark.wan, pytest.mark.xdist_group("wan")]
PORT = 7788
ECHOES = 100
CLIENT = """
import socket, sys
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.settimeout(0.05)
got = 0
for i in range(int(sys.argv[3])):
    probe = b"E%d" % i
    sock.sendto(probe, (sys.argv[1], int(sys.argv[2])))
    try:
        while sock.recvfrom(100)[0] != probe:
            pass
        got += 1
    except socket.timeout:
        pass
print(got)
"""


def echoed(lab: Lab) -> float:
    """The share of UDP echoes from cluster 0 to the DHT's endpoint that came back."""
    out = subprocess.run(
        [*lab.exec_prefix("c0"), sys.executable, "-c", CLIENT, lab.address("dht"), str(PORT), str(ECHOES)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    return int(out.stdout.strip()) / ECHOES


@needs_root
def test_link_and_loss_controls_act_on_a_running_lab():
    with Lab(1, "lan") as lab:
        server = subprocess.Popen(
            [
                *lab.exec_prefix("dht"),
                sys.executable,
                "-m",
                "scripts.wan.probe",
                "serve",
                lab.address("dht"),
                str(PORT),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert "ready" in server.stdout.readline()
            assert echoed(lab) >= 0.97
            control.set_loss(lab.run_id, "cluster0", 20)
            time.sleep(0.6)  # the forwarder reads the file every 0.2 s
            lossy = echoed(lab)
            assert 0.4 < lossy < 0.85, lossy  # 0.8 each way: 0.64 expected
            control.set_loss(lab.run_id, "c0", None)
            time.sleep(0.6)
            assert echoed(lab) >= 0.97
            control.set_link(lab.run_id, "c0", up=False)
            assert echoed(lab) == 0
            control.set_link(lab.run_id, "c0", up=True)
            time.sleep(0.5)
            assert echoed(lab) >= 0.97
        finally:
            server.kill()
            server.wait(timeout=10)
