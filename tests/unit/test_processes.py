"""Ending process trees by PID: nothing left running, and no hivemind socket file left in the file system (a
killed p2pd and its hivemind clients cannot remove theirs, and hundreds of them piled up in /tmp)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from open_diloco.processes import (
    descendants,
    descendants_of,
    end_tree,
    hivemind_socket_files,
    kill_tree,
    remove_socket_files,
    unix_socket_files,
    wait_gone,
)

# binds a unix socket file named as hivemind names them, starts a child that binds another, prints both PIDs
# and waits to be ended; IGNORE_TERM makes both ignore SIGTERM, as a process stuck in a C call does
TREE = """
import json, os, signal, socket, subprocess, sys, time
where, depth = sys.argv[1], int(sys.argv[2])  # argv[3]: this script
if os.environ.get("IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
server = socket.socket(socket.AF_UNIX)
server.bind(f"{where}/hivemind-p2pd-{depth}.sock")
server.listen()
pids = [os.getpid()]
if depth == 0:
    child = subprocess.Popen([sys.executable, "-c", sys.argv[3], where, "1"], stdout=-1, text=True)
    pids += json.loads(child.stdout.readline())
print(json.dumps(pids), flush=True)
time.sleep(120)
"""


def start_tree(where: Path, ignore_term: bool = False) -> tuple[subprocess.Popen, list[int]]:
    env = {**os.environ, **({"IGNORE_TERM": "1"} if ignore_term else {})}
    root = subprocess.Popen(
        [sys.executable, "-c", TREE, str(where), "0", TREE], stdout=subprocess.PIPE, text=True, env=env
    )
    return root, json.loads(root.stdout.readline())


@pytest.mark.parametrize("end", ["kill_tree", "end_tree"])
def test_ending_a_tree_leaves_no_process_and_no_socket_file(tmp_path, end):
    root, pids = start_tree(tmp_path, ignore_term=end == "end_tree")  # end_tree must fall back to SIGKILL
    try:
        expected = {str(tmp_path / f"hivemind-p2pd-{depth}.sock") for depth in (0, 1)}
        assert unix_socket_files(pids) == hivemind_socket_files(pids) == expected
        left = kill_tree(root.pid) if end == "kill_tree" else end_tree(root.pid, grace=0.5)
        root.wait(timeout=10)
    finally:
        for pid in wait_gone(pids, 0):
            os.kill(pid, 9)
    assert not left and not wait_gone(pids, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_socket_file_a_living_process_listens_on_is_kept(tmp_path):
    path = tmp_path / "hivemind-p2pclient-alive.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        server.listen()
        remove_socket_files({str(path), str(tmp_path / "gone.sock")}, [os.getpid()])
        assert path.exists()


def test_only_hivemind_files_count_as_a_trees_own(tmp_path):
    # multiprocessing's listener, say, is inherited by forks: a child that held it says nothing of its owner
    with socket.socket(socket.AF_UNIX) as inherited, socket.socket(socket.AF_UNIX) as own:
        inherited.bind(str(tmp_path / "listener-abc"))
        own.bind(str(tmp_path / "hivemind-p2pd-x.sock"))
        inherited.listen()
        own.listen()
        assert hivemind_socket_files([os.getpid()]) == {str(tmp_path / "hivemind-p2pd-x.sock")}


def test_the_descendants_of_several_roots_come_from_one_pass(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    trees = [start_tree(tmp_path / "a"), start_tree(tmp_path / "b")]
    try:
        roots = {root.pid for root, _ in trees}
        assert descendants_of(roots) == {pid for _, pids in trees for pid in pids[1:]}
        assert descendants_of({trees[0][0].pid}) == set(descendants(trees[0][0].pid)) == {trees[0][1][1]}
        assert descendants_of({trees[0][1][1]}) == set()  # a leaf
    finally:
        for root, _ in trees:
            kill_tree(root.pid)
            root.wait(timeout=10)
