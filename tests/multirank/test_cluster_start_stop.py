"""Cluster layer on real MPI ranks: a cluster starts blocking and stops without leftovers; a notebook run again
stops its earlier cluster first, and a refused start stops nothing. Its arguments and start-up errors, without
ranks: tests/unit/test_cluster.py."""

import json
import re
import socket
import time
from pathlib import Path

import psutil
import pytest

import shardlab as sl
from shardlab.ranks.commands import CONTROLLER_PORTS, ephemeral_range


@pytest.mark.multirank
def test_cluster_starts_blocking_and_stops_without_leftovers(no_leftovers, capsys):
    with sl.RankCluster(n=2, device="cpu") as cluster:
        # Outside a notebook and a terminal (a log, a pipe), only what the start did: no line per registered rank
        # (and the fallback's one line where the engines start without a fork server: SHARDLAB_FORK_ENGINES=0).
        assert re.fullmatch(r"(Engines start without a fork server, [^\n]+\n)?started 2 CPU ranks in \d+\.\d s\n",
                            capsys.readouterr().out)
        assert [s["rank"] for s in cluster.states] == [0, 1]
        assert {s["backend"] for s in cluster.states} == {"gloo"}
        assert cluster.view.block is True
        cluster.view.execute("import sys, torch.distributed as dist; world = dist.get_world_size()")
        assert cluster.view.pull("world") == [2, 2]
        # Engines take their ids from the launcher's rank, without importing an MPI library of their own.
        cluster.view.execute("no_mpi4py = 'mpi4py' not in sys.modules")
        assert cluster.view.pull("no_mpi4py") == [True, True]
        # OpenMPI's session folder is in the profile, removed at stop, not in the temp folder (where a killed
        # mpiexec would leave it).
        cluster.view.execute("import os; session = os.environ['PMIX_SERVER_TMPDIR']")
        assert {Path(session).parent for session in cluster.view.pull("session")} == {Path(cluster.profile_dir)}
        # Connection files hold the CurveZMQ keys: owner-only, inside an owner-only profile folder.
        profile = Path(cluster.profile_dir)
        assert profile.stat().st_mode & 0o077 == 0
        connection_files = list((profile / "security").glob("ipcontroller-*.json"))
        assert connection_files
        for path in connection_files:
            assert path.stat().st_mode & 0o077 == 0, f"{path} is readable by others"
            assert json.loads(path.read_text()).get("curve_serverkey"), "CurveZMQ is off"
            assert len(json.loads(path.read_text())["key"]) == 64, "message signing is off"
            assert json.loads(path.read_text())["interface"] == "tcp://127.0.0.1"
        # And the controller really listens on loopback only, whatever its files say.
        controller = psutil.Process(next(row["pid"] for row in cluster.memory() if row["process"] == "controller"))
        listening = [c.laddr for p in [controller, *controller.children(recursive=True)]
                     for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
        assert listening and {address.ip for address in listening} == {"127.0.0.1"}, listening
        # On ports below the ephemeral range (where there is room), which no outgoing connection can be handed
        # between the moment they are found free and the moment the controller's forked processes bind them.
        if ephemeral_range()[0] > CONTROLLER_PORTS[1]:
            assert all(CONTROLLER_PORTS[0] <= address.port < CONTROLLER_PORTS[1] for address in listening), listening
        assert cluster.alive_processes()
    assert not cluster.alive_processes()
    assert not profile.exists() and not (sl.ranks.folders.registry() / f"{cluster.cluster_id}.json").exists()


@pytest.mark.multirank
def test_a_notebook_run_again_stops_its_earlier_cluster_first_and_a_refused_start_stops_nothing(no_leftovers,
                                                                                                capsys):
    """Run All twice in one kernel reaches sl.start_cluster() again: one set of ranks at a time, not two."""
    first = sl.start_cluster(n=2, device="cpu", activate=False, keep_warm=False)
    try:
        with pytest.raises(sl.ranks.devices.DeviceError):
            sl.start_cluster(n=64, device="cuda", activate=False, keep_warm=False)
        assert first.alive_processes(), "a refused request stopped the running cluster"
        capsys.readouterr()
        second = sl.start_cluster(n=2, device="cpu", activate=False, keep_warm=False)
        try:
            assert "Stopping this kernel's cluster from an earlier run (2 CPU ranks) first" in capsys.readouterr().out
            assert not first.alive_processes() and second.alive_processes()
            second.view.execute("import torch.distributed as dist; world = dist.get_world_size()")
            assert second.view.pull("world") == [2, 2]
        finally:
            second.stop()
    finally:
        first.stop()


@pytest.mark.multirank
def test_a_start_whose_heartbeat_port_was_taken_meanwhile_starts_again_with_other_ports(no_leftovers, capsys,
                                                                                        monkeypatch):
    """Two starts on one node can draw the same free port from CONTROLLER_PORTS at the same moment; the one whose
    heart monitor binds second would leave its engines waiting 75 s for heartbeats. Here the first attempt is handed
    a heartbeat port this test listens on (ipyparallel 9.2 takes its engines' ports in order: registration, control,
    mux, task, iopub, then hb_ping and hb_pong, ``IPController.init_hub``): the start says so, starts again with
    other ports, and its ranks work."""
    from shardlab.ranks import bringup

    held = socket.create_server(("127.0.0.1", 0))
    given = []

    def taken_heartbeat_port():
        args = real()
        if not given:  # the first attempt only
            ports = [int(p) for p in args[-1].split("=", 1)[1].split(",")]
            ports[5] = held.getsockname()[1]  # hb_ping
            args = [*args[:-1], f"--IPController.ports={','.join(map(str, ports))}"]
        given.append(args)
        return args

    real = bringup.controller_arguments
    monkeypatch.setattr(bringup, "controller_arguments", taken_heartbeat_port)
    if ephemeral_range()[0] <= CONTROLLER_PORTS[1]:
        pytest.skip("CONTROLLER_PORTS is not below this machine's ephemeral range: ipyparallel picks the ports")
    try:
        t0 = time.monotonic()
        with sl.RankCluster(n=2, device="cpu") as cluster:
            out = capsys.readouterr().out
            assert "A port of the controller was taken by another process meanwhile" in out, out
            assert "starting again with other ports" in out and len(given) == 2, out
            assert time.monotonic() - t0 < 60, "the taken port was noticed only when the engines gave up"
            cluster.view.execute("import torch.distributed as dist; world = dist.get_world_size()")
            assert cluster.view.pull("world") == [2, 2]
    finally:
        held.close()
