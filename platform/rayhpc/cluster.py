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
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from rayhpc import interrupt, processes
from rayhpc.config import ConfigError
from rayhpc.slurm.private import OWN_TMPDIR_BASE, UnsafePath, check_trusted, private_tmpdir, write_private

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
    from rayhpc.up import connection

    try:
        found = connection.find(same_environment)
    except UnsafePath as exc:
        raise ConfigError(f"{connection.path()}: {exc}") from None
    except connection.OtherEnvironment as exc:
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
            if address in _user_cluster:
                init_kwargs = {"runtime_env": warm_workers(), **init_kwargs}
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


def first_worker_now():
    """Ask for this job's first worker process now, without waiting for it, where the job's workers start warm
    (a local Ray of this process's, the user's cluster): the reference of its task, or None. The job's first
    worker makes a starter of that job's workers load Ray, Ray Tune and Ray Train (`rayhpc.up.starter`: about
    1 s on one core); asked for here, that overlaps the job's own set-up in this process (Tune's experiment)
    instead of following it. A task of no CPU that does nothing: it holds no resource.

    Only for actors with the job's own runtime environment (Tune's trials): Ray Train gives its controller and
    workers settings of their own (`runtime_env` env_vars), so their workers have a starter of their own, and
    this one would load Ray beside it on the same cores (a training run's first step came 1 s later, measured)."""
    import ray

    if not ((_local and _local[-1].starter is not None) or ray.get_runtime_context().gcs_address in _user_cluster):
        return None

    @ray.remote(num_cpus=0)
    def nothing():
        return None

    return nothing.remote()  # the job does not wait for it


def warm_workers() -> dict:
    """A job's Ray workers on the user's cluster start as forks of its warm starter of workers, which has
    imported torch (`rayhpc.up.worker`); none where it has no such starter (`rayhpc up --no-warm`)."""
    from rayhpc.up import connection, worker

    return {"py_executable": worker.command()} if connection.workers_socket_path().exists() else {}


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


@dataclass
class LocalCluster:
    """A Ray this process started: its private folder (Ray's files in `ray/`, its token), the marker in every
    one of its processes' environment, and the token settings to give back when it stops."""

    folder: Path
    marker: str
    token_before: dict[str, str | None]
    starter: subprocess.Popen | None = None  # its warm starter of workers (`own_warm_workers`)
    runtime_env: dict | None = None  # what makes its workers the starter's forks (`own_warm_workers`)
    extras: tuple[str, ...] = ()  # the libraries of `WORKER_EXTRAS` the starter loads
    settings: dict[str, str] | None = None  # the libraries' settings it loaded them with (`warm.LOAD_SETTINGS`)

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


def start_local(warm: bool = True, **init_kwargs):
    """Start a Ray of this process's own on this machine and connect to it; returns `ray.init`'s context.

    Never Ray's default: `ray.init()` joins the cluster that `<tmp>/ray/ray_current_cluster` names, a
    folder Ray makes 0777 where any user can start a head or write that file first, and would hand it the
    token, the task's code and data. So: `address="local"` (always a new cluster), its sockets, logs and
    session files inside a new folder of a random name made 0700 (`tempfile.mkdtemp`), with a fresh token
    of its own in it (never ~/.ray/auth_token, which every Ray of the user shares: one leaked token would
    open them all). Its GCS and dashboard bind ports of the system's choosing themselves (a port picked here
    and handed over could be taken meanwhile by another user, who would then receive the token); the GCS's
    address reaches the processes Ray starts as RAY_ADDRESS (`gcs_address_published`). Every process of the
    cluster carries a marker in its environment, so that `disconnect` finds and stops them all, the GCS last.
    A start that fails leaves nothing running, and its token goes with its folder. Its workers start warm
    (`warm`, `own_warm_workers`; a job command's starter of workers started with it, `prepare_local`)."""
    import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

    warm = warm and os.environ.get(WARM_WORKERS_VARIABLE) != "0"
    local = (_prepared_for_use() if warm else None) or _new_local()
    folder = local.folder
    local.token_before = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    write_private(local.token, secrets.token_hex(32), replace=False)  # as Ray's own generator makes one
    use_token(local.token)
    # the workers Ray starts ahead for the first job (one per CPU, each importing Ray) are of no runtime
    # environment: with warm workers, whose Python is the job's, no task could use them
    prestart = {"RAY_prestart_worker_first_driver": "0"} if warm else {}
    try:
        # its processes import nothing from their working folder (`entry.run_main` sets the same for a command's)
        with environment(**{CLUSTER_MARKER: local.marker, "RAY_GCS_SERVER_PORT": None, "PYTHONSAFEPATH": "1",
                            **prestart, **socket_polling()}), \
                gcs_address_published(), node_defaults(), registration_polled(), working_folder_of_workers():
            if warm:  # a runtime_env given wins, key by key
                if local.starter is None:
                    own_warm_workers(local)
                init_kwargs["runtime_env"] = {**local.runtime_env, **init_kwargs.get("runtime_env", {})}
            # in a folder of its own inside ours: Ray makes its temp dir 0777, ours stays 0700; the dashboard on a
            # port of its own choosing (0), not Ray's 8265 (one port for every Ray on the node)
            ctx = ray.init(address="local", _temp_dir=str(folder / "ray"), **{"dashboard_port": 0, **init_kwargs})
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
    private_tmpdir()  # TMPDIR: this process's own, which the processes of its Ray inherit
    # in the TMPDIR the process was given, not in its private one: Ray's socket paths must stay under 107 bytes
    folder = Path(tempfile.mkdtemp(prefix="rayhpc-", dir=os.environ[OWN_TMPDIR_BASE]))
    return LocalCluster(folder, secrets.token_hex(8), {})


_prepared: list[LocalCluster] = []  # the local Ray this command is about to start, its workers' starter running


def prepare_local(argv: list[str]) -> None:
    """Start the warm starter of workers of the local Ray a job command will start, now, at the command's start
    (`run_main`), in that Ray's folder: it imports torch and the workers' modules (about 2.5 s of CPU) while
    this process imports its own on one core, rather than beside Ray's start, which keeps every core busy
    (`start_local` takes it). Not where the command joins a cluster (`--address`, RAY_ADDRESS; `run_main` has
    handed the command to the user's cluster where one is up) or starts its workers cold. A command that
    starts no Ray after all (bad input, an address in its YAML) stops it and removes the folder at exit; so
    does a start whose task loaded a library of `WORKER_EXTRAS` the starter did not, or whose environment
    now sets the libraries' settings otherwise (importing torch's compiler sets TORCHINDUCTOR_CACHE_DIR)."""
    from rayhpc.up import connection, warm

    if os.environ.get("RAY_ADDRESS") or os.environ.get(WARM_WORKERS_VARIABLE) == "0" or _prepared \
            or any(arg in ("-h", "--help", "--address") or arg.startswith("--address=") for arg in argv) \
            or connection.read() is not None:  # the user's cluster (whose starter did not take the command)
        return
    local = _new_local()
    local.settings = {name: value for name, value in os.environ.items() if name.startswith(warm.LOAD_SETTINGS)}
    with environment(**{CLUSTER_MARKER: local.marker}):
        own_warm_workers(local)
    _prepared.append(local)
    atexit.register(_discard_prepared)


def _prepared_for_use() -> LocalCluster | None:
    """The prepared local Ray (`prepare_local`), where its starter runs and has loaded what this process's task
    loaded; None otherwise (then gone)."""
    from rayhpc.up.warm import differing

    local = _prepared.pop() if _prepared else None
    if local is not None and (local.starter.poll() is not None or local.extras != _worker_extras()
                              or differing(dict(os.environ), local.settings)):
        _stop_and_remove(local)
        local = None
    return local


def _discard_prepared() -> None:
    """At exit: the prepared local Ray no start took, its starter stopped and its folder removed."""
    while _prepared:
        _stop_and_remove(_prepared.pop())


def socket_polling() -> dict[str, str]:
    """Ray's settings for how often its processes try a local socket that is not there yet: every 50 ms, 200
    times, where Ray's defaults are every 1000 ms, 10 times (the same 10 s in all). The raylet starts its
    object store in a thread and connects to it at once; the store binds a moment later, so with the defaults
    every Ray start slept a whole second there (its log: the store's start, then 1.000 s to the next line).
    A value the user set wins."""
    wanted = {"RAY_raylet_client_connect_timeout_milliseconds": "50", "RAY_raylet_client_num_connect_attempts": "200"}
    return {} if any(key in os.environ for key in wanted) else wanted


WARM_WORKERS_VARIABLE = "RAYHPC_WARM_WORKERS"  # "0": a local Ray's workers each import torch themselves


def own_warm_workers(local: LocalCluster) -> None:
    """A local Ray's workers start as forks of a warm starter of workers of its own, as those of a job on the
    user's cluster do (`rayhpc.up.starter --workers`: it has imported torch, 1-1.5 s of each worker's start):
    `local.starter`, and `local.runtime_env` for Ray. Started before Ray (at the command's start where
    `prepare_local` did), it imports meanwhile; it listens in the cluster's private folder, which the
    workers' Python names (`rayhpc.up.worker`, Ray's `py_executable`), and it ends with this process (its
    parent-death signal) or with the cluster (it carries the cluster's marker). A worker Ray starts while it
    imports waits for it (`warm.waiting_for`). What it prints goes to `warm-workers.log` in the folder. Of the
    libraries a task may bring (`WORKER_EXTRAS`: Hugging Face's, 1.9 s of CPU), it loads those this process has
    (the task check built the task's model here): with Ray starting on the same cores, a starter loading what no
    worker imports delays them all."""
    import shlex

    from rayhpc.up import connection, worker

    extras = local.extras = _worker_extras()

    # its own temp folder inside the cluster's, which goes with it: the starter is killed, its exit handlers never run
    with environment(**{connection.HOME_VARIABLE: str(local.folder), "TMPDIR": str(local.folder)}):
        connection.folder()
        out = os.open(local.folder / "warm-workers.log", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            local.starter = subprocess.Popen([sys.executable, "-P", "-m", "rayhpc.up.starter", "--workers", "--extras",
                                              ",".join(extras), "--parent", str(os.getpid())],
                                             stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd=local.folder)
        finally:
            os.close(out)
    local.runtime_env = {"py_executable": f"env {connection.HOME_VARIABLE}={shlex.quote(str(local.folder))} "
                                          f"{worker.command()}"}


def _worker_extras() -> tuple[str, ...]:
    """Those of `WORKER_EXTRAS` this process has loaded (its task check built the task's model)."""
    from rayhpc.up import worker

    return tuple(name for name in worker.WORKER_EXTRAS if name.split(".")[0] in sys.modules)


@contextlib.contextmanager
def gcs_address_published():
    """Inside: once the GCS that a `ray.init` starts has bound its port (0: the system's choice), its address is
    RAY_ADDRESS for every process Ray starts after it (raylet, dashboard, agents, workers). Ray's state API
    in a worker (Ray Train's placement-group cleaner) otherwise looks for "the" cluster among every user's
    processes. `ray.init` learns the port from a file the GCS writes; its private `Node.start_gcs_server` is
    where that happens, so it is wrapped here, for this call only."""
    from ray._private.node import Node  # private: the one point between the GCS's start and the raylet's

    start = Node.start_gcs_server

    @functools.wraps(start)
    def then_publish(self, *args, **kwargs):
        start(self, *args, **kwargs)
        os.environ["RAY_ADDRESS"] = self.gcs_address

    Node.start_gcs_server = then_publish
    try:
        with environment(RAY_ADDRESS=None):
            yield
    finally:
        Node.start_gcs_server = start


@contextlib.contextmanager
def node_defaults():
    """Inside: the Ray a `ray.init` starts
    - gives its dashboard agent a port of the system's choosing, not Ray's fixed 52365. Where any other Ray on
      the node (another user's, or the user's own cluster) holds 52365, the agent retries it with a growing
      back-off for seconds (4-5 s of every job's start, measured) and then runs without its HTTP server
      (0: the agent binds a free port and reports it, as Ray supports);
    - sets up each worker process with `rayhpc.up.setup_worker`, which does what Ray's own set-up step does
      without importing Ray: 0.5 s of CPU less in every worker process (a training run starts 7).
    `ray start` takes --dashboard-agent-listen-port (the Slurm startup sets it); `ray.init` has no argument for
    either, so the defaults of its private `RayParams` are changed here, for this call only."""
    from ray._private import parameter  # private: the only place either can be set for ray.init

    from rayhpc.up import setup_worker

    init = parameter.RayParams.__init__

    @functools.wraps(init)
    def with_defaults(self, *args, **kwargs):
        kwargs.setdefault("dashboard_agent_listen_port", 0)
        kwargs.setdefault("setup_worker_path", setup_worker.__file__)
        init(self, *args, **kwargs)

    parameter.RayParams.__init__ = with_defaults
    try:
        yield
    finally:
        parameter.RayParams.__init__ = init


@contextlib.contextmanager
def registration_polled(every_s: float = 0.02, timeout_s: float = 30.0):
    """Inside: a `ray.init` that starts a node notices the raylet's registration with the GCS within `every_s`.
    Ray asks for the node once, through its private `services.get_node`, whose C++ loop sleeps a whole second
    after each miss; the raylet registers once its agents are up, 1.5-2 s after its start on 2 cores, so every
    start waited up to a second with nothing to do (0.7 s idle, measured). Here the GCS is asked every
    `every_s` first (`GcsClient.get_all_node_info`, which Ray's own start-up uses), then Ray's call finds the
    node at once; after `timeout_s` Ray's call decides as before."""
    import time

    from ray._private import services  # private: where `Node.__init__` waits for its raylet
    from ray._raylet import GcsClient

    get_node = services.get_node

    @functools.wraps(get_node)
    def polled(gcs_address, node_id, *args, **kwargs):
        client, deadline = GcsClient(address=gcs_address), time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            alive = client.get_all_node_info(timeout=timeout_s, state_filter=0)  # 0: GcsNodeState.ALIVE
            if any(found.hex() == node_id for found in alive):
                break
            time.sleep(every_s)
        return get_node(gcs_address, node_id, *args, **kwargs)

    services.get_node = polled
    try:
        yield
    finally:
        services.get_node = get_node


def disconnect() -> None:
    """Leave Ray; a local Ray this process started stops (every one of its processes, its GCS last), and its
    private folder, token included, is removed."""
    import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

    with gcs_stopped_last():
        ray.shutdown()
    remove_local_temp()


@contextlib.contextmanager
def gcs_stopped_last():
    """Inside: a `ray.shutdown` that stops the local Ray of this process kills every other process of it first
    (`processes.kill_gcs_last`), and only then lets Ray stop its GCS. Ray stops the GCS second, after the
    raylet, and its dashboard, monitor, agents and workers then call the freed GCS port for seconds with the
    token. Ray's private `Node.kill_all_processes` runs once the driver has disconnected: it is wrapped here,
    for this call only."""
    from ray._private.node import Node  # private: the one point between the driver's disconnect and the kills

    kill_all = Node.kill_all_processes

    @functools.wraps(kill_all)
    def others_first(self, *args, **kwargs):
        for local in _local:
            processes.kill([p for p in processes.marked(f"{CLUSTER_MARKER}={local.marker}")
                            if not processes.is_gcs(p)])
        kill_all(self, *args, **kwargs)

    Node.kill_all_processes = others_first
    try:
        yield
    finally:
        Node.kill_all_processes = kill_all


def _stop_and_remove(local: LocalCluster) -> None:
    """Kill what is left of the local Ray `local` (its GCS last), remove its folder and token, and give the
    process back the token settings it had before."""
    processes.kill_gcs_last(processes.marked(f"{CLUSTER_MARKER}={local.marker}"))
    if local.starter is not None:  # killed above (marked): reaped here
        local.starter.kill()
        local.starter.wait()
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


@contextlib.contextmanager
def environment(**values: str | None):
    """`values` in os.environ inside (what processes started inside inherit; None: unset), as before outside."""
    before = {k: os.environ.get(k) for k in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
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
