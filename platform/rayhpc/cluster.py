"""The Ray connection: join a running cluster, or start a local one with token auth.

Resources are known before anything starts (local CPUs and GPUs are counted
the way Ray counts them), so bad requests fail before a cluster is started.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import math
import os
import secrets
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rayhpc import interrupt
from rayhpc.config import ConfigError
from rayhpc.slurm.private import UnsafePath, ensure_private_file, write_private

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resources:
    """What a Ray cluster offers (or a local one would offer once started)."""

    cpus: float
    gpus: float
    nodes: int
    node_cpus: float  # on the biggest node: the most one trial or worker can get
    node_gpus: float
    address: str | None  # None: a local cluster not started yet
    per_node: tuple[tuple[float, float], ...] = ()  # (CPUs, GPUs) of each node

    def fits_per_node(self, cpus: float, gpus: float = 0.0) -> list[int]:
        """How many bundles of (cpus, gpus) each node holds at once."""
        def fits(have: float, need: float) -> float:
            return math.floor(have / need + 1e-9) if need > 0 else math.inf

        return [int(min(fits(c, cpus), fits(g, gpus), 1 << 30))
                for c, g in self.per_node or [(self.node_cpus, self.node_gpus)]]

    def placeable(self, cpus: float, gpus: float = 0.0) -> int:
        """How many bundles of (cpus, gpus) the cluster's nodes hold at once (each on one node)."""
        return min(sum(self.fits_per_node(cpus, gpus)), 1 << 30)

    def describe(self) -> str:
        where = self.address or "local"
        return f"{where}: {self.nodes} node(s), {self.cpus:g} CPUs, {self.gpus:g} GPUs"


MIN_CPU_SHARE = 1 / 64


def default_cpus_per_worker(res: Resources, num_workers: int, gpu: bool) -> float:
    """The one default policy: 1 CPU per worker or, where the cluster has fewer, the largest
    power-of-two share that places them all (4 workers on a 2-CPU laptop get 0.5 each: their
    torch threads share the cores; on a cluster every worker gets a whole CPU)."""
    cpus = 1.0
    while cpus > MIN_CPU_SHARE and res.placeable(cpus, 1.0 if gpu else 0.0) < num_workers:
        cpus /= 2
    return cpus


def check_workers(res: Resources, num_workers: int, cpus_per_worker: float, gpu: bool,
                  key: str = "compute.num_workers (--num-workers)") -> None:
    """Fail at once where a placement group would wait for resources that will never come."""
    if gpu and res.gpus == 0:
        raise ConfigError(f"compute.gpu (--gpu): the cluster has no GPUs ({res.describe()})")
    fits = res.placeable(cpus_per_worker, 1.0 if gpu else 0.0)
    if fits < num_workers:
        each = f"{cpus_per_worker:g} CPU" + (" + 1 GPU" if gpu else "")
        raise ConfigError(f"{key} {num_workers}: the cluster can place {fits} "
                          f"worker(s) of {each} each ({res.describe()})")


GPU_PROBE_TIMEOUT_S = 120.0  # a worker process on a GPU node: start, import torch, ask CUDA


def check_gpus_usable(gpus: float, key: str) -> None:
    """Before a job trains on GPUs: one task given `gpus` GPU(s) asks torch on a GPU node whether it can
    use them, so that a torch that cannot (a CPU build, a too-old driver) is one `ConfigError` naming the
    build, not a job that trains on the CPU or fails inside its workers."""
    import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

    from rayhpc.devices import cuda_unusable  # torch: about 1.5 s to import, only where something trains

    probe = ray.remote(num_cpus=0, num_gpus=min(gpus, 1.0))(cuda_unusable)
    ref = probe.remote(f"{key} {gpus:g}")
    try:
        problem = ray.get(ref, timeout=GPU_PROBE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        raise ConfigError(f"{key} {gpus:g}: no task given {min(gpus, 1.0):g} GPU started within "
                          f"{GPU_PROBE_TIMEOUT_S:g} s ({_current().describe()})") from None
    if problem is not None:
        raise ConfigError(problem)


def resolve_address(address: str | None) -> str | None:
    """`--address`, else `RAY_ADDRESS`, else the user's own cluster on this machine (`rayhpc up`), else
    None (start a local cluster). Never a cluster found anywhere else (Ray's own default)."""
    if address or os.environ.get("RAY_ADDRESS"):
        return address or os.environ.get("RAY_ADDRESS")
    from rayhpc.up import connection

    try:
        found = connection.find()
    except UnsafePath as exc:
        raise ConfigError(f"{connection.path()}: {exc}") from None
    if found is not None:
        _user_cluster[:] = [found]
    return found


_user_cluster: list[str] = []  # the address of the user's cluster (`rayhpc up`), once found


def use_token_if_present() -> None:
    """Send this user's Ray token when joining a cluster, as a local `ray.init()` does when starting one.

    Ray reads RAY_AUTH_MODE once, when it is imported; a client without it is refused by a
    token-protected cluster (such as the local one a sweep starts). Call before importing ray.
    A token file that exists but cannot be read is a `ConfigError` (Ray would fail on every call).
    """
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        with open(path):
            present = True
    except FileNotFoundError:
        present = False
    except OSError as exc:
        key = "RAY_AUTH_TOKEN_PATH" if "RAY_AUTH_TOKEN_PATH" in os.environ else "the Ray token"
        raise ConfigError(f"{key} {path}: cannot read it ({exc.strerror}); it must be a file of yours, "
                          f"mode 0600") from None
    if "RAY_AUTH_MODE" in os.environ:
        return
    if os.environ.get("RAY_AUTH_TOKEN") or present:
        os.environ["RAY_AUTH_MODE"] = "token"


def private_local_token() -> None:
    """The token a local `ray.init()` uses, ~/.ray/auth_token, readable by this user only: created here
    (exclusively, 0600, in a 0700 folder) when missing, since Ray would write it world-readable, and
    narrowed to 0600 when Ray already did."""
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    path = Path.home() / ".ray" / "auth_token"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    try:  # the token as Ray's own generate_new_authentication_token() makes it
        write_private(path, secrets.token_hex(32), replace=False)
    except FileExistsError:
        ensure_private_file(path)


def local_cpus() -> int:
    """CPUs a local Ray started here will offer: RAY_OVERRIDE_RESOURCES' (Ray's own override, which it honours
    over what it is told), else those this process may use: affinity mask, capped by a cgroup v2 quota if any."""
    override = json.loads(os.environ.get("RAY_OVERRIDE_RESOURCES") or "{}").get("CPU")
    if override is not None:
        return max(1, int(override))
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus


def local_gpus() -> float:
    """The GPUs a local Ray started here will offer: RAY_OVERRIDE_RESOURCES' (Ray's own override of what a
    node has) or the machine's by the driver, as Ray counts them. Not torch's count: a torch that cannot use
    the GPUs would hide them, and the job would run on the CPU of a GPU node without a word."""
    override = json.loads(os.environ.get("RAY_OVERRIDE_RESOURCES") or "{}").get("GPU")
    if override is not None:
        return float(override)
    from rayhpc.devices import node_gpus  # torch: about 1.5 s to import, only where something trains

    return node_gpus()


def probe(address: str | None) -> Resources:
    """The resources of the cluster at `address`, connecting to it; of this machine if None.

    Connecting to an existing cluster starts nothing; a local cluster is only
    described here and started by `connect`.
    """
    import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

    if ray.is_initialized():
        return _current()
    if address is None:
        cpus, gpus = local_cpus(), local_gpus()
        return Resources(cpus=cpus, gpus=gpus, nodes=1, node_cpus=cpus, node_gpus=gpus, address=None,
                         per_node=((cpus, gpus),))
    return connect(address)


def connect(address: str | None, **init_kwargs) -> Resources:
    """Join the cluster at `address`, or start a local one (token auth on); idempotent."""
    import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

    if ray.is_initialized():
        return _current()
    # A local cluster started by ray.init() has token auth on by default in Ray 2.60
    # (token in ~/.ray/auth_token, generated if absent), so on a shared machine no
    # other user can submit code to it. RAY_AUTH_MODE is read when ray is imported,
    # so it cannot be switched on from here (see use_token_if_present); rayhpc never
    # switches it off.
    try:
        if address is None:
            ctx = start_local(logging_level=logging.WARNING, **{"include_dashboard": dashboard_installed(),
                                                                **init_kwargs})
        else:
            private_ray_tmpdir()
            ctx = ray.init(address=address, logging_level=logging.WARNING, **init_kwargs)
            if address in _user_cluster:
                joined_user_cluster()
    except (OSError, RuntimeError, ValueError) as exc:  # OSError: also a too-long RAY_TMPDIR socket path
        what = f"address (--address) {address}: cannot connect to" if address else "cannot start"
        raise ConfigError(f"{what} a Ray cluster: {exc}".splitlines()[0]) from None
    interrupt.install()  # ray.init makes SIGTERM exit at once; ours stops the job as Ctrl-C does
    res = _current()
    dashboard = getattr(ctx, "dashboard_url", None)
    started = f"started local Ray at {res.address} in {_local_temp[-1]}" if address is None else \
        f"joined your cluster (rayhpc up) at {address}" if address in _user_cluster else f"joined Ray at {address}"
    # the dashboard asks for the cluster's token once per browser: `ray get-auth-token` prints it
    log.info(f"ray: {started} ({res.nodes} node(s), {res.cpus:g} CPUs, {res.gpus:g} GPUs)"
             + (f"; dashboard http://{dashboard} (token: `ray get-auth-token`)" if dashboard else ""))
    return res


def joined_user_cluster() -> None:
    """This job runs on the user's cluster: `rayhpc down` stops it first (it is registered), and its stop
    line then says that the cluster went away rather than which signal came."""
    from rayhpc.up import connection

    entry = connection.register_job()
    atexit.register(entry.unlink, missing_ok=True)
    held_by = (connection.read() or {}).get("pid")

    def went_away() -> str | None:
        info = connection.read()
        if info is None or info.get("stopping") or info.get("pid") != held_by:
            return "your cluster (rayhpc up) went away (rayhpc down)"
        return None

    interrupt.explain(went_away)


def dashboard_installed() -> bool:
    """Whether Ray's dashboard packages (`ray[default]`) are here: `ray.init(include_dashboard=True)` without
    them is an exception, and images with only `ray[train,tune]` are common on GPU clusters. Ray itself
    decides so by importing this module of its own (`ray._private.utils.get_dashboard_dependency_error`)."""
    try:
        import ray.dashboard.optional_deps  # noqa: F401
    except ImportError as exc:
        log.warning(f"ray: dashboard off: Ray's dashboard packages are missing ({exc}); pip install 'ray[default]' "
                    "for the dashboard and its metrics (docs/monitoring.md)")
        return False
    return True


_local_temp: list[Path] = []  # the private temp folder of the local Ray this process started


def local_temp() -> Path:
    """The private temp folder of the local Ray this process started."""
    return _local_temp[-1]


def private_ray_tmpdir() -> None:
    """RAY_TMPDIR, for this process and the Ray processes it starts, in a new 0700 folder of this user's.

    Ray Tune and Train take file locks (checkpoint and experiment syncing) in `<RAY_TMPDIR or /tmp>/
    _ray_lockfiles`, one folder for every user of the machine: where another user made it first (0700),
    every resume fails with PermissionError; where they made it 0777, they can hold the lock of a path of
    ours and stall the job. Ray reads RAY_TMPDIR at each lock (and for its default temp folder, which the
    platform never uses: every Ray it starts gets a private one). The folder is made inside the RAY_TMPDIR
    the user set, if any, and removed at exit."""
    if _ray_tmpdir:
        return
    folder = tempfile.mkdtemp(prefix="rayhpc-tmp-", dir=os.environ.get("RAY_TMPDIR") or None)
    _ray_tmpdir.append(folder)
    os.environ["RAY_TMPDIR"] = folder
    atexit.register(shutil.rmtree, folder, True)


_ray_tmpdir: list[str] = []  # this process's private RAY_TMPDIR, once made


def start_local(**init_kwargs):
    """Start a Ray of this process's own on this machine and connect to it; returns `ray.init`'s context.

    Never Ray's default: `ray.init()` joins the cluster that `<tmp>/ray/ray_current_cluster` names, a
    folder Ray makes 0777 where any user can start a head or write that file first, and would hand it the
    token, the task's code and data. So: `address="local"` (always a new cluster), its sockets, logs and
    session files inside a new folder of a random name made 0700 (`tempfile.mkdtemp`), and its GCS on a port
    chosen here, which the processes Ray starts are told as RAY_ADDRESS: Ray's state API in a worker (Ray
    Train's placement-group cleaner) otherwise looks for "the" cluster in `<tmp>/ray` and among every
    user's processes. The folder goes when the process disconnects (`disconnect`) or exits."""
    import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

    private_local_token()
    private_ray_tmpdir()
    for attempt in range(3):  # the port is free when chosen; another process may take it before the GCS does
        temp = Path(tempfile.mkdtemp(prefix="rayhpc-"))
        port = free_port()
        try:
            with environment(RAY_GCS_SERVER_PORT=str(port), RAY_ADDRESS=f"127.0.0.1:{port}"), agent_port_chosen():
                # in a folder of its own inside ours: Ray makes its temp dir 0777, ours stays 0700; the dashboard
                # on a free port, not Ray's 8265 (one port for every Ray on the node)
                ctx = ray.init(address="local", _temp_dir=str(temp / "ray"),
                               **{"dashboard_port": free_port(), **init_kwargs})
        except Exception:
            shutil.rmtree(temp, ignore_errors=True)
            if attempt == 2 or ray.is_initialized():
                raise
            continue
        atexit.unregister(disconnect)
        atexit.register(disconnect)  # once; Ray stops before its folder goes, whichever exit handler runs first
        _local_temp.append(temp)
        return ctx


@contextlib.contextmanager
def agent_port_chosen():
    """Inside: the Ray a `ray.init` starts gives its dashboard agent a port of the system's choosing, not Ray's
    fixed 52365. Where any other Ray on the node (another user's, or the user's own cluster) holds 52365, the
    agent retries it with a growing back-off for seconds (4-5 s of every job's start, measured) and then
    runs without its HTTP server. `ray start` takes --dashboard-agent-listen-port (the Slurm startup sets
    it); `ray.init` has no argument for it, so the default of its private `RayParams` is changed here, for
    this call only (0: the agent binds a free port and reports it, as Ray supports)."""
    from ray._private import parameter  # private: the only place the agent's port can be set for ray.init

    init = parameter.RayParams.__init__

    @functools.wraps(init)
    def with_free_agent_port(self, *args, **kwargs):
        kwargs.setdefault("dashboard_agent_listen_port", 0)
        init(self, *args, **kwargs)

    parameter.RayParams.__init__ = with_free_agent_port
    try:
        yield
    finally:
        parameter.RayParams.__init__ = init


def disconnect() -> None:
    """Leave Ray; a local Ray this process started stops, and its private folder is removed."""
    import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

    ray.shutdown()
    remove_local_temp()


def remove_local_temp() -> None:
    """Remove the private folder of the local Ray this process started (once its processes are gone)."""
    while _local_temp:
        shutil.rmtree(_local_temp.pop(), ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def environment(**values: str):
    """`values` in os.environ inside (what processes started inside inherit), as before outside."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _current() -> Resources:
    import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

    alive = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    return Resources(
        cpus=sum(r.get("CPU", 0.0) for r in alive), gpus=sum(r.get("GPU", 0.0) for r in alive), nodes=len(alive),
        node_cpus=max((r.get("CPU", 0.0) for r in alive), default=0.0),
        node_gpus=max((r.get("GPU", 0.0) for r in alive), default=0.0),
        address=ray.get_runtime_context().gcs_address,
        per_node=tuple((r.get("CPU", 0.0), r.get("GPU", 0.0)) for r in alive),
    )
