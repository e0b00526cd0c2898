"""Bringing a cluster's ranks up: fresh engines started and initialised, or a parked cluster taken over and reset.

``cluster.RankCluster`` decides which (settings, a pool, ``attach``) and owns what it gets; how each way starts its
engines is ``engine_launchers``' business; what a rank runs to initialise or reset itself, ``rankstate``'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import signal
import time
from collections.abc import Callable
from pathlib import Path

import ipyparallel as ipp
import psutil

from . import folders, forkserver, launch, owned, rankstate, records, warden, warm
from .commands import CONTROLLER_PORTS, free_port, free_ports
from .devices import threads_per_rank, usable_cores
from .engine_launchers import ENGINE_CONFIG, EngineLauncher
from .px import ClusterError, wait_for

# The controller finishes an engine's registration at the beat after the engine first answered one
# (ipyparallel/controller/heartmonitor.py, ``beat``): one to two periods after the engine is ready. ipyparallel's
# default 3 s period made every start wait that long for nothing (measured: a 4-rank start 17.8 s -> 13.8 s at 1 s;
# with forked engines, ready 1.9 s before the controller counted them at 1 s; at 250 ms, still 0.3-0.45 s of a 3.5 s
# start, hence 50 ms: 50-100 ms). It costs an idle 4-rank cluster about 3 % of a core (measured: controller 0.4 % ->
# 1.8 %, engines 1.4 % -> 3.3 %). The controller drops an engine after 600 missed beats, the same 30 s of slack the
# default gave; engines give up on a silent controller after ENGINE_CONFIG's misses, 75 s as by default.
HEARTBEAT_MS, HEARTBEAT_MISSES = 50, 600
CONTROLLER_ARGS = ["--IPController.enable_curve=True", f"--HeartMonitor.period={HEARTBEAT_MS}",
                   f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}"]
# The controller's ports come from CONTROLLER_PORTS, below the ephemeral range. Left to itself, ipyparallel 9.2 finds
# each port free, closes it, and binds it later, some in processes it forks: its heart monitor binds the heartbeat
# ports after its own start-up. Meanwhile an outgoing connection may be handed one of them; a heart monitor that cannot
# bind sends no heartbeat, so every engine gets its registration reply, is never counted, and gives up after 75 s.
CONTROLLER_SOCKETS = 24  # it listens on 18 with its default schedulers; a spare costs one bind check
# Message signing on top of CurveZMQ. With CurveZMQ on, ipyparallel's controller sets an empty Session key unless one
# is given, and then every kernel and engine that connects warns "Message signing is disabled. This is insecure and
# not recommended!". A key of each cluster's own keeps both: CurveZMQ encrypts and authenticates every connection,
# HMAC-SHA256 signs every message. The controller takes it from its environment (IPP_SESSION_KEY: never a command
# line, which every user of the node can read) and writes it into the connection files in the owner-only profile
# folder, where the engines, this kernel's client and a kernel that takes a parked cluster over read it.
SESSION_KEY = "IPP_SESSION_KEY"


# An opt-in start gate for a class on one shared node (INSTRUCTORS.md, "A class on one shared node"): with
# SHARDLAB_START_GATE naming a folder every learner can write (mode 1777), a fresh start waits for one of
# SHARDLAB_START_SLOTS (default 4) flock slots there, so that 40 learners' 160 ranks do not all import PyTorch in the
# same second. A slot is held from the controller's start until every rank is initialised; a kernel that dies lets
# go of it (the kernel closes the file), and a start that waited START_GATE_WAIT_S goes ahead anyway, saying so.
START_GATE, START_SLOTS, DEFAULT_SLOTS, START_GATE_WAIT_S = "SHARDLAB_START_GATE", "SHARDLAB_START_SLOTS", 4, 600.0


def slot_holders(paths: list[Path]) -> list[str]:
    """Who holds the flock of each of ``paths`` ("alice (pid 123)"), from /proc/locks, which every user may read."""
    inodes = {}
    for path in paths:
        with contextlib.suppress(OSError):
            inodes[os.stat(path).st_ino] = path
    holders = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()  # "1: FLOCK  ADVISORY  WRITE 4242 00:2d:1234 0 EOF" (blocked waiters: "->")
            inode = fields[5].rsplit(":", 1)[-1] if len(fields) >= 6 and fields[1] == "FLOCK" else ""
            if inode.isdigit() and int(inode) in inodes:
                try:
                    holders.append(f"{psutil.Process(int(fields[4])).username()} (pid {fields[4]})")
                except (psutil.Error, ValueError):
                    holders.append(f"pid {fields[4]}")
    return holders


@contextlib.contextmanager
def start_slot(say: Callable[[str], None] = lambda text: None, folder: str | None = None, slots: int | None = None,
               wait_s: float = START_GATE_WAIT_S, poll_s: float = 0.5):
    """Hold one of the start gate's slots while the body runs (nothing without ``$SHARDLAB_START_GATE``): wait for a
    free one, telling ``say`` whose starts it waits for; after ``wait_s``, go ahead without one. A gate folder that
    cannot be used is said once and skipped: a broken gate never stops a learner's start."""
    folder = folder or os.environ.get(START_GATE)
    if not folder:
        yield
        return
    chosen = slots if slots is not None else os.environ.get(START_SLOTS) or DEFAULT_SLOTS
    slots = int(chosen) if str(chosen).isdigit() else 0
    if slots < 1:
        raise ClusterError(f"{START_SLOTS}={chosen!r} is not a whole number of start slots, at least 1: set it to "
                           "how many clusters may start at once on this node, or unset it (4).")
    paths, held, t0, holders = [Path(folder, f"slot-{i}") for i in range(slots)], None, time.monotonic(), ""
    while held is None:
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)  # read-only is enough for flock
            except OSError as error:
                print(f"shardlab: the start gate {folder} cannot be used ({error.strerror}): starting without it.")
                yield
                return
            with contextlib.suppress(OSError):
                os.fchmod(fd, 0o644)  # a slot this user created: the other learners must open it too, whatever umask
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = fd
                break
            except BlockingIOError:
                os.close(fd)
        if held is not None:
            break
        # a holder may let go between the flock and the read of /proc/locks: keep the last holders seen by name
        holders = ", ".join(slot_holders(paths)) or holders or "processes this user cannot see"
        waited = time.monotonic() - t0
        if waited >= wait_s:
            print(f"shardlab: waited {waited:.0f} s for one of the {slots} start slot(s) in {folder} (held by "
                  f"{holders}): starting without one.")
            break
        say(f"waiting for one of the {slots} start slot(s) of this node: held by {holders}")
        time.sleep(poll_s)
    if holders and held is not None:
        print(f"shardlab: waited {time.monotonic() - t0:.0f} s for one of the {slots} start slot(s) in {folder}, "
              f"held by {holders}.")
    try:
        yield
    finally:
        if held is not None:
            os.close(held)  # closing the file lets go of the lock


def check_engine_ids(ids: list[int], ranks: list[int]) -> None:
    """Refuse engines whose ids are not their launcher ranks: ``%%px`` labels would be misleading."""
    if ranks != list(ids):
        raise ClusterError(f"engine ids {list(ids)} do not match launcher ranks {ranks}: %%px labels would be "
                           "misleading. Every engine should have asked for its rank as its id.")


def initialise_ranks(view, ids: list[int], timeout_s: float, start_timeout_s: float,
                     reset: dict[str, str] | None = None) -> list[dict]:
    """On every engine of ``view``: check that its id is its launcher rank, then initialise DistributedManager
    with rank 0 on loopback at a free port; every rank's state, in rank order. ``reset``: the engines are a parked
    cluster's, reset first (``rankstate.reset_rank``) with this environment of the claiming kernel."""
    # Ranks that share a core run by turns: on a busy machine engines answer late, and below every rank imports torch,
    # PhysicsNeMo and Warp, so both waits grow with the ranks per core (a flat 120 s was outlasted by 8 ranks on 2
    # cores busy with another job; a flat 30 s by 2 ranks starting beside four other clusters). Running out of time
    # here is a slow start, not a collective some rank never joined.
    cores = usable_cores()
    wait_s = max(start_timeout_s * max(1.0, len(ids) / cores), timeout_s + 60)
    slow = (f"{len(ids)} ranks share {cores} CPU core(s) here, and each imports PyTorch and PhysicsNeMo: a start "
            "this oversubscribed can outlast the wait. Start fewer ranks, or pass a longer start_timeout_s."
            if len(ids) > cores else None)
    infos = wait_for(view.apply_async(launch.detect_launch), ids, wait_s, "report its launcher rank",
                     slow or "They registered, then ran nothing: is the machine busy? Pass a longer start_timeout_s.")
    check_engine_ids(ids, [info.rank for info in infos])
    threads = threads_per_rank(len(ids))  # intra-op threads and compile workers of ranks sharing a machine's cores
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    result = (view.apply_async(rankstate.init_rank, rendezvous, timeout_s, threads) if reset is None
              else view.apply_async(rankstate.reset_rank, rendezvous, timeout_s, threads, reset))
    states = wait_for(result, ids, wait_s, "initialise DistributedManager", slow)
    return sorted(states, key=lambda state: state["rank"])


def record_started(record: records.Record, launcher: EngineLauncher, cluster, states: list[dict]) -> None:
    """Add to ``record`` what a cluster started on this node (the launcher's processes and their children, the
    controller's, engines that Slurm started here) and its Slurm jobs, and save it: a later start cleans up after
    a crashed kernel from it."""
    here = os.uname().nodename
    controller = getattr(getattr(cluster, "controller", None), "process", None)
    pids = [*launcher.processes(), *(owned.process_tree(controller.pid) if controller else [])]
    pids += [p for state in states if state.get("hostname") == here for p in owned.process_tree(state["pid"])]
    record.processes = sorted(set(map(tuple, record.processes)) | set(pids))
    record.jobs = sorted(set(record.jobs) | set(launcher.jobs()))
    record.save()


def controller_arguments() -> list[str]:
    """The controller's command-line options: CONTROLLER_ARGS, and its ports from CONTROLLER_PORTS where that window
    lies below the ephemeral range (else ipyparallel picks them)."""
    ports = free_ports(CONTROLLER_SOCKETS, CONTROLLER_PORTS)
    return CONTROLLER_ARGS + ([f"--IPController.ports={','.join(map(str, ports))}"] if ports else [])


def prepare(cluster_id: str, job_name: str, launcher: EngineLauncher, n: int, controller_ip: str,
            shared_dir: str | None, pool: warm.Pool | None):
    """What a fresh start needs before any process runs: (ipyparallel Cluster, the process record, the engine set's
    options). The record is saved first, and the cluster's warden started (``warden``): from here on, the cluster
    ends with the process that owns it, whatever kills that. The profile folder goes to ``shared_dir``, else the
    pool's folder, else the temp folder; in a pool, every process is marked as the pool's, since it outlives the
    kernel that starts it, and every process is marked with the cluster's id, recorded or not yet."""
    pooled = {} if pool is None else pool.marked_environment()
    profile_dir = folders.make_profile_dir(cluster_id, shared_dir or (pool and pool.folder))
    Path(profile_dir, "ipengine_config.py").write_text(ENGINE_CONFIG)
    record = records.Record.for_this_kernel(cluster_id, profile_dir, job_name, str(pool.folder) if pool else "")
    record.save()
    options = launcher.engine_set_options(profile_dir)  # a missing mpiexec says so here
    warden.start(record, os.environ | owned.marked_environment() | pooled)  # the cluster ends with its owner
    options["environment"] |= pooled | warden.marked_environment(cluster_id)
    start_fork_server(record, launcher, options)
    cluster = ipp.Cluster(engines=launcher.engine_set_class, n=n, cluster_id=cluster_id, profile_dir=profile_dir,
                          controller_ip=controller_ip, controller_args=controller_arguments(), log_level=40)
    cluster.config.LocalControllerLauncher.environment = ({"IPP_ENABLE_CURVE": "1", SESSION_KEY: secrets.token_hex(32)}
                                                          | owned.marked_environment() | pooled
                                                          | warden.marked_environment(cluster_id))
    return cluster, record, options


def start_fork_server(record: records.Record, launcher: EngineLauncher, options: dict) -> None:
    """Engines forked from a parent that imported PyTorch and PhysicsNeMo once (``forkserver``), where they can be:
    the server is started (recorded: it stops with the cluster) and the launcher runs each rank's stub instead of
    the engine; Slurm's engines, on other nodes, ask a server their node's first stub starts. Else today's start, said
    in one line."""
    if (why := forkserver.why_not(record.profile_dir, launcher.on_other_nodes)) is not None:
        print(f"Engines start without a fork server, each importing PyTorch itself: {why}.")
        return
    if not launcher.on_other_nodes:
        launcher.fork_server = server = forkserver.start(record.profile_dir, os.environ | options["environment"])
        record.processes = sorted(set(map(tuple, record.processes)) | {server})
        record.save()
    options["engine_cmd"] = [*forkserver.stub_command(record.profile_dir, launcher.on_other_nodes), "-m",
                             "ipyparallel.engine"]


class PortTaken(ClusterError):
    """A port the controller was given was listened on by another process before the controller could: another start
    on this node drew it from CONTROLLER_PORTS at the same moment (``free_ports`` checks a port, then the controller
    binds it). ``RankCluster.start`` starts again with other ports."""


def controller_log(cluster: ipp.Cluster) -> list[str]:
    try:
        return Path(cluster.controller.output_file).read_text(errors="replace").strip().splitlines()
    except (AttributeError, OSError):
        return []


def check_controller_ports(cluster: ipp.Cluster) -> None:
    """Raise PortTaken once the controller's log says a port it was given is in use (a process it forks, its heart
    monitor, binds its ports after the controller has started; the engines then wait 75 s for heartbeats)."""
    if taken := [line.strip() for line in controller_log(cluster) if "Address already in use" in line]:
        raise PortTaken(f"A port of the controller was taken by another process meanwhile ({taken[-1]})")


def controller_trouble(cluster: ipp.Cluster, lines: int = 12) -> str | None:
    """What went wrong on the controller's side of a failed start, if anything (else None): it exited (how), or one
    of the processes it forks failed (a traceback in its log: a heart monitor that could not bind its port leaves every
    engine waiting for a heartbeat until it gives up, and what the engines' launcher says names no cause)."""
    controller = cluster.controller
    process = getattr(controller, "process", None)
    try:
        alive = process is not None and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        alive = False
    log = controller_log(cluster)
    if alive:
        if not (starts := [i for i, line in enumerate(log) if line.startswith("Traceback")]):
            return None
        trace = log[starts[-1]:]
        end = next((i for i, line in enumerate(trace) if i and line and not line.startswith(" ")), len(trace) - 1)
        return "A process of the controller failed; its log says:\n" + "\n".join(trace[:end + 1][-lines:])
    code = (controller.stop_data or {}).get("exit_code")
    how = ("exited" if code is None else f"was killed by signal {-code} ({signal.strsignal(-code)})" if code < 0
           else f"exited with code {code}")
    ends = "\n".join(log[-lines:] or ["-"])
    return f"The controller (pid {getattr(process, 'pid', '?')}) {how} during the start; its log ends:\n{ends}"


def bring_up(cluster: ipp.Cluster, launcher: EngineLauncher, record: records.Record, n: int, options: dict,
             timeout_s: float, start_timeout_s: float, say: Callable[[str], None] = lambda text: None):
    """Start ``cluster``'s controller and ``n`` engines, wait for them to register and initialise every rank, adding
    each process to ``record`` as soon as it exists (the cluster's warden stops them all if this kernel dies):
    (Client, blocking view, every rank's state, timings). ``say`` is told how far the start is, in a few words."""
    with start_slot(say):  # the class's start gate, where one is set up: else nothing
        return _bring_up(cluster, launcher, record, n, options, timeout_s, start_timeout_s, say)


def _bring_up(cluster, launcher, record, n, options, timeout_s, start_timeout_s, say):
    t0 = time.perf_counter()
    say(f"starting {n} ranks: the controller")
    try:
        cluster.start_controller_sync()
    except BaseException:
        check_controller_ports(cluster)
        raise
    cluster.start_engines_sync(n=n, **options)
    launcher.started(cluster.engines.values())
    record_started(record, launcher, cluster, [])
    client = cluster.connect_client_sync()
    try:
        launcher.wait_for_engines(client, start_timeout_s, lambda count: say(f"starting {n} ranks: {count} of {n} "
                                                                             "registered"),
                                  lambda: check_controller_ports(cluster))
        say(f"starting {n} ranks: {n} of {n} registered; each imports PyTorch and PhysicsNeMo and joins the "
            "process group")
        record_started(record, launcher, cluster, [])
        registered = time.perf_counter() - t0
        view = client[:]
        view.block = True
        states = initialise_ranks(view, list(client.ids), timeout_s, start_timeout_s)
        record_started(record, launcher, cluster, states)
    except BaseException as error:
        client.close()
        if isinstance(error, ClusterError) and not isinstance(error, PortTaken) and (
                trouble := controller_trouble(cluster)) is not None:
            raise ClusterError(f"{error}\n{trouble}") from None
        raise
    return client, view, states, {"engines registered": registered,
                                  "DistributedManager ready": time.perf_counter() - t0 - registered}


def take_over(record: records.Record, n: int, timeout_s: float):
    """Connect to the parked cluster ``record`` names and reset its ``n`` ranks to a fresh start's state (an empty
    namespace, then ``rankstate.reset_rank`` with this kernel's environment): (ipyparallel Cluster, Client, blocking
    view, every rank's state, timings). Raises if a rank does not come back within ``warm.RESET_TIMEOUT_S``."""
    t0 = time.perf_counter()
    # Only to connect and to be stopped: ipyparallel 9.2's Cluster.from_file cannot load back the engine launcher
    # class it saved ("module:Class"), and the record lists every process to stop anyway.
    cluster = ipp.Cluster(profile_dir=record.profile_dir, cluster_id=record.cluster_id, shutdown_atexit=False)
    client = ipp.Client(profile_dir=record.profile_dir, cluster_id=record.cluster_id, timeout=warm.RESET_TIMEOUT_S)
    try:
        client.wait_for_engines(n, timeout=warm.RESET_TIMEOUT_S, interactive=False)
        registered = time.perf_counter() - t0
        view = client[:]
        view.block = True
        ids = list(client.ids)
        wait_for(view.execute("%reset -f", block=False), ids, warm.RESET_TIMEOUT_S, "empty its namespace")
        states = initialise_ranks(view, ids, timeout_s, warm.RESET_TIMEOUT_S, reset=warm.kernel_environment())
    except BaseException:
        client.close()
        raise
    return cluster, client, view, states, {"engines registered": registered,
                                           "DistributedManager ready": time.perf_counter() - t0 - registered}


def release_for_parking(client) -> bool:
    """Before a cluster is parked: on every rank, empty the namespace and give back what a waiting rank need not hold
    (``rankstate.park_rank``: process groups, cached GPU blocks, freed heap). False if a rank did not finish within
    ``warm.RESET_TIMEOUT_S`` or failed: such a cluster is stopped, not parked."""
    view, ids = client[:], list(client.ids)
    try:
        wait_for(view.execute("%reset -f", block=False), ids, warm.RESET_TIMEOUT_S, "empty its namespace")
        wait_for(view.apply_async(rankstate.park_rank), ids, warm.RESET_TIMEOUT_S, "give its memory back")
    except Exception:  # whatever went wrong, a rank that cannot tidy up is not worth keeping
        return False
    return True


def idle_and_alive(client, n: int, states: list[dict]) -> bool:
    """Whether a cluster may be parked: all ``n`` ranks registered, none busy, every engine process alive."""
    try:
        # Cells block until every rank answered: only one given up on (cell_timeout_s) is still outstanding.
        idle = sorted(client.ids) == list(range(n)) and not client.outstanding
    except Exception:  # a cluster that cannot say is not worth keeping
        return False
    return idle and all(psutil.pid_exists(state["pid"]) for state in states)
