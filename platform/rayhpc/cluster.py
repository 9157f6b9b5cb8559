"""The Ray connection: join a running cluster, or start a local one with token auth.

Resources are known before anything starts (local CPUs and GPUs are counted
the way Ray counts them), so bad requests fail before a cluster is started.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import secrets
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from rayhpc import interrupt, processes, ray_start
from rayhpc.config import ConfigError
from rayhpc.private import OWN_TMPDIR_BASE, UnsafePath, check_trusted, private_tmpdir, write_private

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


def resolve_address(address: str | None, same_environment: bool = True) -> str | None:
    """`--address`, else `RAY_ADDRESS`, else the user's own cluster on this machine (`rayhpc up`), else
    None (start a local cluster). Never a cluster found anywhere else (Ray's own default). A `ConfigError`
    where the user's cluster runs another Python environment than this process (`same_environment`: a job's
    workers would run the cluster's)."""
    if address or os.environ.get("RAY_ADDRESS"):
        return address or os.environ.get("RAY_ADDRESS")
    from rayhpc import user_cluster

    try:
        found = user_cluster.find(same_environment)
    except UnsafePath as exc:
        raise ConfigError(f"{user_cluster.path()}: {exc}") from None
    except user_cluster.OtherEnvironment as exc:
        raise ConfigError(str(exc)) from None
    if found is not None:
        address, token = found
        use_token(token)  # the cluster's own, named by its connection file
        _user_cluster[:] = [address]
        return address
    return None


_user_cluster: list[str] = []  # the address of the user's cluster (`rayhpc up`), once found


def use_token_if_present() -> None:
    """Send a token when joining a cluster this process did not start (`--address`, RAY_ADDRESS), as Ray's own
    clients do: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or Ray's ~/.ray/auth_token, the one a cluster the user
    started with `ray start` has. The clusters the platform starts have a token of their own each (a local
    Ray: `start_local`; `rayhpc up`: its connection file names it; a Slurm job: its folder).

    Ray reads RAY_AUTH_MODE once, when it is imported; a client without it is refused by a
    token-protected cluster. Call before importing ray. A token file that exists but cannot be read is a
    `ConfigError` (Ray would fail on every call).
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


def use_token(path: Path | str) -> None:
    """From now on this process (and every process it starts) sends the token in `path`, that of a cluster
    the platform started, and no other: RAY_AUTH_TOKEN would win over the file, so it goes."""
    os.environ.pop("RAY_AUTH_TOKEN", None)
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(path))
    if "ray" in sys.modules:
        # private: Ray caches its token mode (RayConfig) and the token itself (its C++ loader) once per process;
        # Ray's own `_enable_token_auth` and `ray get-auth-token` refresh them the same way
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


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
    # Every cluster the platform starts has token auth on and a token of its own (start_local, `rayhpc up`, a
    # Slurm job); rayhpc never switches it off.
    try:
        if address is None:
            ctx = start_local(logging_level=logging.WARNING, **{"include_dashboard": dashboard_installed(),
                                                                **init_kwargs})
        else:
            private_tmpdir()
            with working_folder_of_workers():
                ctx = ray.init(address=address, logging_level=logging.WARNING, **init_kwargs)
            if address in _user_cluster:
                joined_user_cluster()
    except (OSError, RuntimeError, ValueError) as exc:  # OSError: also a too-long RAY_TMPDIR socket path
        what = f"address (--address) {address}: cannot connect to" if address else "cannot start"
        raise ConfigError(f"{what} a Ray cluster: {exc}".splitlines()[0]) from None
    interrupt.install()  # ray.init makes SIGTERM exit at once; ours stops the job as Ctrl-C does
    res = _current()
    dashboard = getattr(ctx, "dashboard_url", None)
    started = f"started local Ray at {res.address} in {local_temp()}" if address is None else \
        f"joined your cluster (rayhpc up) at {address}" if address in _user_cluster else f"joined Ray at {address}"
    # the dashboard asks for the cluster's token once per browser
    token = os.environ.get("RAY_AUTH_TOKEN_PATH") if address is None or address in _user_cluster else None
    log.info(f"ray: {started} ({res.nodes} node(s), {res.cpus:g} CPUs, {res.gpus:g} GPUs)"
             + (f"; dashboard http://{dashboard} (token: {token or '`ray get-auth-token`'})" if dashboard else ""))
    return res


@contextlib.contextmanager
def working_folder_of_workers():
    """Inside: a `ray.init` puts no folder another user can write on its workers' path. Ray puts the driver's
    working folder first on the `sys.path` of every worker of the job (`JobConfig`'s driver paths, read as it
    connects), so a `torch.py` or `rayhpc/` planted there (a job started in /tmp, a shared scratch, a group's
    project) would run in every worker. Where that folder is not this user's alone (`check_trusted`), the
    process works in `/` meanwhile (root's: nothing to plant there); its own folder, as Ray has it, otherwise.
    A local Ray started inside starts its processes there too."""
    try:
        check_trusted(Path.cwd())
        unsafe = False
    except UnsafePath:
        unsafe = True
    with contextlib.chdir("/") if unsafe else contextlib.nullcontext():
        yield


def joined_user_cluster() -> None:
    """This job runs on the user's cluster: `rayhpc down` stops it first (it is registered), and its stop
    line then says that the cluster went away rather than which signal came."""
    from rayhpc import user_cluster

    entry = user_cluster.register_job()
    atexit.register(entry.unlink, missing_ok=True)
    held_by = (user_cluster.read() or {}).get("pid")

    def went_away() -> str | None:
        info = user_cluster.read()
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


@dataclass
class LocalCluster:
    """A Ray this process started: its private folder (Ray's files in `ray/`, its token), the marker in every
    one of its processes' environment, its node (`ray_start.Node`), and the token settings to give back when
    it stops."""

    folder: Path
    marker: str
    token_before: dict[str, str | None]
    node: ray_start.Node | None = None

    @property
    def token(self) -> Path:
        return self.folder / TOKEN_FILE


TOKEN_FILE = "auth_token"
CLUSTER_MARKER = "RAYHPC_CLUSTER"  # in the environment of every process of a local Ray this process started
_local: list[LocalCluster] = []  # the local Ray this process started, while it runs


def local_temp() -> Path:
    """The private folder of the local Ray this process started."""
    return _local[-1].folder


def local_token() -> Path:
    """The token file of the local Ray this process started (in its private folder)."""
    return _local[-1].token


def start_local(num_cpus: float | None = None, num_gpus: float | None = None, include_dashboard: bool = False,
                **init_kwargs):
    """Start a Ray of this process's own on this machine (`rayhpc.ray_start`, as every node the platform starts)
    and connect to it; returns `ray.init`'s context.

    Never Ray's default: `ray.init()` joins the cluster that `<tmp>/ray/ray_current_cluster` names, a
    folder Ray makes 0777 where any user can start a head or write that file first, and would hand it the
    token, the task's code and data. So: a new node whose sockets, logs and session files live inside a new
    folder of a random name made 0700 (`tempfile.mkdtemp`), with a fresh token of its own in it (never
    ~/.ray/auth_token, which every Ray of the user shares: one leaked token would open them all), every port
    its processes call with the token bound by its owner (0), and the address read from that folder. Every
    process of the cluster carries a marker in its environment, so that `disconnect` finds and stops them all,
    the GCS last. A start that fails leaves nothing running, and its token goes with its folder."""
    import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

    local = _new_local()
    local.token_before = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    write_private(local.token, secrets.token_hex(32), replace=False)  # as Ray's own generator makes one
    use_token(local.token)
    cpus = local_cpus() if num_cpus is None else num_cpus
    gpus = local_gpus() if num_gpus is None else num_gpus
    args = ["--head", "--port=0", f"--ray-client-server-port={ray_start.free_port()}",
            f"--num-cpus={cpus:g}", f"--num-gpus={gpus:g}", f"--include-dashboard={str(include_dashboard).lower()}",
            *(["--dashboard-host=127.0.0.1", "--dashboard-port=0"] if include_dashboard else [])]
    env = {**{k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_GCS_SERVER_PORT")},
           **ray_start.environment(local.folder, CLUSTER_MARKER, local.marker)}
    try:
        local.node = ray_start.start(local.folder, args, env)
        with working_folder_of_workers():
            ctx = ray.init(address=local.node.address, **init_kwargs)
    except BaseException:
        if ray.is_initialized():
            ray.shutdown()
        _stop_and_remove(local)
        raise
    _local.append(local)
    atexit.unregister(disconnect)
    atexit.register(disconnect)  # once; Ray stops before its folder goes, whichever exit handler runs first
    return ctx


def _new_local() -> LocalCluster:
    """A new private folder for a local Ray, and the marker of its processes."""
    private_tmpdir()  # TMPDIR: this process's own
    # in the TMPDIR the process was given, not in its private one: Ray's socket paths must stay under 107 bytes
    folder = Path(tempfile.mkdtemp(prefix="rayhpc-", dir=os.environ[OWN_TMPDIR_BASE]))
    return LocalCluster(folder, secrets.token_hex(8), {})


def disconnect() -> None:
    """Leave Ray; a local Ray this process started stops (every one of its processes, its GCS last), and its
    private folder, token included, is removed. The job has printed what it had to say: what its workers
    print while Ray stops them (a SIGTERM inside a weakref callback prints a traceback) is not shown."""
    import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

    interrupt.quiet_workers()
    ray.shutdown()
    remove_local_temp()


def _stop_and_remove(local: LocalCluster) -> None:
    """Stop the local Ray `local` (its supervisor kills its processes, the GCS last), kill what is left of it
    (marked: the GCS last again), remove its folder and token, and give the process back the token settings
    it had before."""
    if local.node is not None:
        ray_start.stop(local.node)
    processes.kill_gcs_last(processes.marked(f"{CLUSTER_MARKER}={local.marker}"))
    shutil.rmtree(local.folder, ignore_errors=True)
    for key, value in local.token_before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


_removing = threading.Lock()  # one thread removes at a time: a forced exit waits for a removal under way


def remove_local_temp() -> None:
    """Stop what is left of the local Ray this process started and remove its folder (on leaving Ray, and
    on a forced exit). A cluster leaves `_local` only once it is removed: a forced exit (another thread)
    that begins while the main thread removes it waits for that, rather than finding `_local` empty and
    ending the process halfway through the removal (the folder left behind)."""
    with _removing:
        while _local:
            _stop_and_remove(_local[-1])
            _local.pop()


interrupt.at_forced_exit(remove_local_temp)


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
