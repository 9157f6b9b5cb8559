"""Every process the platform starts gets a temp folder of its own before torch is imported, and torch's compile
caches are the user's alone: another user who made `<tmp>/torchinductor_<user>` first (inductor takes the folder
as it finds it, and a header in it as built) gets nothing compiled into it and has nothing of theirs included.
Each case runs in a fresh interpreter: inductor fixes its headers' folder when it is first imported. (A whole
`--compile` job under the attack: tests/ray/test_local_security.py.)"""

from __future__ import annotations

import getpass
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ATTACKER

# in a fresh interpreter: what the platform's own processes do (a private TMPDIR first, where asked), then what
# a worker does before it compiles; prints where torch will look and what happened
CHECK = """
import json, os, sys, tempfile
from rayhpc.private import private_tmpdir, UnsafePath
if sys.argv[1] == "private":
    private_tmpdir()
from rayhpc.engine.parallelize import private_compile_caches
from torch._inductor.codecache import _HEADER_DIR
try:
    private_compile_caches()
    outcome = "ok"
except UnsafePath as exc:
    outcome = f"refused: {exc}"
headers = os.path.dirname(_HEADER_DIR)
st = os.stat(headers) if os.path.exists(headers) else None
print(json.dumps({"headers": headers, "tmp": tempfile.gettempdir(), "outcome": outcome,
                  "link": os.path.islink(headers), "real": os.path.realpath(headers),
                  "mode": st and oct(st.st_mode & 0o777), "uid": st and st.st_uid}))
"""


def check(shared: Path, private: bool) -> tuple[dict, str]:
    """What `CHECK` reports with TMPDIR `shared` (a stand-in for the node's /tmp), and what it logged."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAYHPC_OWN_TMPDIR")}
    env.update(TMPDIR=str(shared), PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-c", CHECK, "private" if private else "worker"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


@pytest.fixture
def shared(world_tmp) -> Path:
    folder = world_tmp("rh-shared-tmp")
    folder.mkdir()
    folder.chmod(0o1777)
    return folder


def planted(shared: Path, owner: int, mode: int) -> Path:
    """`<shared>/torchinductor_<user>` made first, by `owner`, with `mode`, a header in it."""
    folder = shared / f"torchinductor_{getpass.getuser()}"
    (folder / "precompiled_headers").mkdir(parents=True)
    (folder / "precompiled_headers" / "planted.h").write_text("__attribute__((constructor)) void run(void) {}\n")
    for path in (folder, folder / "precompiled_headers", folder / "precompiled_headers" / "planted.h"):
        os.chown(path, owner, owner)
    folder.chmod(mode)
    return folder


@pytest.mark.parametrize("owner, mode", [("other", 0o777), ("other", 0o775), ("self", 0o775), ("self", 0o757)])
def test_another_users_or_a_writable_inductor_folder_is_never_used(attacker, shared, owner, mode):
    """Another user's folder, or the user's own that others can write (group- or world-writable): a process of the
    platform (private TMPDIR) keeps the caches in a folder of its own, with a warning naming it; a worker
    whose tmp is the shared one (a cluster the platform did not start) is refused, the folder named. The
    planted header is never touched, and nothing is added beside it."""
    import pwd

    uid = pwd.getpwnam(ATTACKER).pw_uid if owner == "other" else os.getuid()
    folder = planted(shared, uid, mode)
    private = owner == "other" and mode == 0o777 or owner == "self" and mode == 0o775
    got, logged = check(shared, private=private)
    culprit = f"{folder} is uid {uid}'s, mode {mode:04o}: another user may have made it first"
    if private:
        assert got["outcome"] == "ok" and Path(got["tmp"]).parent == shared, got
        assert got["headers"] == str(Path(got["tmp"]) / folder.name) and not got["link"], got
        assert (got["mode"], got["uid"]) == ("0o700", os.getuid()), got
        assert culprit in logged, logged
    else:
        assert got["headers"] == str(folder) and got["outcome"].startswith(f"refused: {culprit}"), got
    assert sorted(p.name for p in folder.rglob("*")) == ["planted.h", "precompiled_headers"]


def test_the_nodes_inductor_folder_is_made_private_or_narrowed_and_shared_by_the_users_jobs(shared):
    """Missing: made 0700, and a job's private TMPDIR links to it (its headers serve every job of the user on the
    node). The user's own folder that only they can write (0755, torch's default): narrowed to 0700 and used."""
    name = f"torchinductor_{getpass.getuser()}"
    for before in (None, 0o755):
        if before is not None:
            (shared / name).mkdir(mode=before)
            (shared / name).chmod(before)
        got, _ = check(shared, private=True)
        assert got["outcome"] == "ok", got
        assert got["link"] and got["real"] == str(shared / name), got
        assert Path(got["headers"]).parent == Path(got["tmp"]) and Path(got["tmp"]).parent == shared, got
        assert stat.S_IMODE((shared / name).stat().st_mode) == 0o700
        (shared / name).rmdir()


def test_a_process_gets_its_own_temp_folder_flat_beside_its_parents_and_a_tmpdir_others_can_swap_is_refused(shared):
    """Each process's own, 0700, in the TMPDIR it was given; a child that inherits a parent's (a warm starter's
    job) makes its own beside it, not inside (Ray's socket paths must stay under 107 bytes); a TMPDIR in a
    folder others can write without the sticky bit is refused before anything is made."""
    code = ("import os, sys; from rayhpc.private import private_tmpdir, UnsafePath\n"
            "try: print(private_tmpdir())\nexcept UnsafePath as exc: print('refused:', exc)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAYHPC_OWN_TMPDIR")}

    def run(extra: dict) -> str:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env={**env, "PYTHONPATH": os.pathsep.join(sys.path), **extra})
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    parent = subprocess.run([sys.executable, "-c", "import os, sys; from rayhpc.private import private_tmpdir\n"
                             "private_tmpdir(); import subprocess\n"
                             f"print(subprocess.run([sys.executable, '-c', {code!r}], capture_output=True, "
                             "text=True).stdout.strip(), os.environ['TMPDIR'])"],
                            capture_output=True, text=True, timeout=60,
                            env={**env, "TMPDIR": str(shared), "PYTHONPATH": os.pathsep.join(sys.path)})
    child, own = parent.stdout.split()
    assert Path(child).parent == Path(own).parent == shared and child != own, parent.stdout
    assert not Path(child).exists() and not Path(own).exists()  # each removed when its process ended
    open_folder = shared / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    assert run({"TMPDIR": str(open_folder)}) == (f"refused: TMPDIR {open_folder}: {open_folder} (mode 0777) can be "
                                                 f"written by other users and has no sticky bit: they could replace "
                                                 f"what is inside; chmod go-w {open_folder}")
    assert list(open_folder.iterdir()) == []


# a user's task file that records, when the job imports it, where its process keeps temp files and where inductor
# will build its headers (fixed when its cache module is first imported)
PROBE = """
import json, os, sys, tempfile
from torch._inductor.codecache import _HEADER_DIR
with open(os.environ["PROBE_OUT"], "w") as out:
    json.dump({"tmp": tempfile.gettempdir(), "headers": _HEADER_DIR, "env": os.environ["TMPDIR"]}, out)
from line import Line as Probe
"""


def test_a_command_has_its_own_temp_folder_before_it_imports_the_users_task(shared, tmp_path):
    """The job command itself (not only the Ray it starts: a job that joins a cluster, or an array task, starts
    none) runs the user's code and torch in a temp folder of its own, inside the TMPDIR it was given, removed when
    it ends. Bad input stops the job after the task is imported and before any cluster starts."""
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "line.py").write_text((Path(__file__).parents[1] / "tasks" / "line.py").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAYHPC_OWN_TMPDIR", "TORCHINDUCTOR"))}
    env.update(TMPDIR=str(shared), PROBE_OUT=str(tmp_path / "probe.json"), PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, str(Path(__file__).parents[2] / "jobs" / "train_mlp.py"), "--task",
                           f"{tmp_path}/probe.py:Probe", "--hp", "width=wide", "--storage-path", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: hparams.width (--hp)"), proc.stderr
    seen = json.loads((tmp_path / "probe.json").read_text())
    own = Path(seen["tmp"])
    assert own.parent == shared and own.name.startswith("rayhpc-") and seen["env"] == str(own), seen
    assert Path(seen["headers"]).parent.parent == own, seen
    assert list(shared.iterdir()) == [], "the command left its temp folder behind"


def test_a_forked_child_leaves_its_parents_temp_folder_and_the_parent_removes_it_at_exit(shared):
    """A warm starter's child (a command, a Ray worker) exits through its parent's exit handlers: the folder
    stays the parent's, which still uses it, and goes when the parent ends."""
    code = ("import os, sys, tempfile; from rayhpc.private import private_tmpdir\n"
            "own = private_tmpdir()\n"
            "child = os.fork()\n"
            "if child == 0:\n"
            "    sys.exit(0)  # the exit handlers run\n"
            "os.waitpid(child, 0)\n"
            "print(own, os.path.isdir(own), len(tempfile.mkdtemp()) > 0)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAYHPC_OWN_TMPDIR")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**env, "TMPDIR": str(shared), "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr
    own, kept, made = proc.stdout.split()
    assert (kept, made) == ("True", "True") and Path(own).parent == shared, proc.stdout
    assert not Path(own).exists()  # removed when the parent ended
