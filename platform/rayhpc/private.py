"""Folders and files only this user can reach, on nodes other users share.

Other users may create paths before us (a predictable `<log_dir>/<job id>/`, anything in /tmp) and
read whatever is world-readable. So a private folder is created exclusively with mode 0700, and one
that already exists is used only if this user owns it, nobody else can write or enter it, and no
folder above it lets another user swap it out (writable by others without the sticky bit, as
/tmp has). Standard library only: the sbatch startup runs this before anything else.
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable


class UnsafePath(Exception):
    """A path another user controls or can read; the message names it and the fix."""


def check_ancestors(path: Path) -> None:
    """Every existing folder from / down to `path` is owned by root or this user, and one that others
    may write to has the sticky bit (as /tmp), so no other user can rename or replace what is inside.
    Symbolic links are followed: the folders checked are those the path really goes through (a link
    in a folder of one's own may lead into a folder others can write), and a link another user owns
    is refused (they can point it anywhere, at any time)."""
    uid = os.getuid()
    path = Path(os.path.abspath(path))
    for entry in [*reversed(path.parents), path]:
        try:
            st = os.lstat(entry)
        except FileNotFoundError:
            break
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, uid):
            raise UnsafePath(f"{entry} is a symbolic link of uid {st.st_uid}, not yours (uid {uid}) or root's: "
                             f"they can point it anywhere; choose a folder of your own")
    path = path.resolve()
    for folder in [*reversed(path.parents), path]:
        try:
            st = os.stat(folder)
        except FileNotFoundError:
            return
        if st.st_uid not in (0, uid):
            raise UnsafePath(f"{folder} belongs to uid {st.st_uid}, not to you (uid {uid}) or root: another user "
                             f"controls what is inside it; choose a folder of your own")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise UnsafePath(f"{folder} (mode {stat.S_IMODE(st.st_mode):04o}) can be written by other users and has no "
                             f"sticky bit: they could replace what is inside; chmod go-w {folder}")


def owned_dir(path: str | Path) -> Path:
    """`path` as a folder of this user's that no other user can swap out (made 0700 where missing, its
    missing parents too); an existing one may be readable by others (a log folder), not writable."""
    path = Path(path)
    check_ancestors(path)
    for folder in [*reversed(path.parents), path]:
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
    if not path.is_dir():
        raise UnsafePath(f"{path} exists and is not a folder")
    check_ancestors(path)
    return path


def log_folder(path: str | Path) -> Path:
    """`path` as a folder of this user's (`owned_dir`) that no other user can create files in, sticky bit or not:
    Slurm appends a job's output to `<folder>/%x-%j.log`, a name they could create first (a FIFO, a file of
    theirs, a link to one of the user's files). `UnsafePath` naming it otherwise."""
    folder = owned_dir(path)
    mode = folder.stat().st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePath(f"{folder} (mode {stat.S_IMODE(mode):04o}) lets other users create files in it, such as "
                         f"the next job's log before Slurm writes it; use a folder of your own, or chmod go-w {folder}")
    return folder


def private_dir(path: str | Path) -> Path:
    """`path` as a folder only this user can enter: created here with mode 0700 (missing parents too), or
    an existing one that passes the same checks. Raises `UnsafePath` otherwise (never chmods someone
    else's folder into shape)."""
    path = Path(path)
    owned_dir(path.parent)
    try:
        os.mkdir(path, 0o700)  # exclusive: fails if anything (a folder, a link, a file) is there already
        return path
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{path} exists and is not a folder (a {'link' if stat.S_ISLNK(st.st_mode) else 'file'}): "
                         f"another user may have put it there; remove it or choose another log_dir")
    if st.st_uid != os.getuid():
        raise UnsafePath(f"{path} exists and belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): another "
                         f"user created it first; the job stops rather than put its token there")
    if st.st_mode & 0o077:
        raise UnsafePath(f"{path} exists with mode {stat.S_IMODE(st.st_mode):04o}; a private folder must be 0700 "
                         f"(chmod 700 {path})")
    return path


def own_dir(path: str | Path) -> Path:
    """`path` as a folder of this user's that no one else can write into: made 0700 here where missing, and
    an existing one used only where it is a folder (not a link) of this user's that no other user can write
    (narrowed to 0700: what is inside it can only be this user's), in folders no one else can swap. Raises
    `UnsafePath` otherwise, naming it."""
    path = Path(path)
    owned_dir(path.parent)
    try:
        os.mkdir(path, 0o700)
        return path
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        what = "a link" if stat.S_ISLNK(st.st_mode) else "not a folder" if not stat.S_ISDIR(st.st_mode) else \
            f"uid {st.st_uid}'s, mode {stat.S_IMODE(st.st_mode):04o}"
        raise UnsafePath(f"{path} is {what}: another user may have made it first and put code in it; it is not "
                         f"used; set TMPDIR to a folder of your own")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def replace_whole(path: str | Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` to a file beside `path`, then renamed over `path`: whole or not at all, so a reader (a
    resume after a kill, another slice) finds the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)
    return path


def write_private(path: str | Path, text: str, replace: bool = True) -> Path:
    """Write `text` to a new file `path` with mode 0600, created exclusively and never through a link.
    `replace`: whatever was at `path` is removed first (inside a private folder only this user put it
    there); otherwise an existing file stays and `FileExistsError` is raised."""
    path = Path(path)
    if replace:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return path


def check_trusted(path: str | Path, below: bool = False, _seen: set[Path] | None = None) -> None:
    """Before loading what `path` holds (a pickle, a checkpoint, Python code): the folders above it pass
    `check_ancestors`, and `path` itself (with everything inside it, if `below`) belongs to this user or
    root and no other user can write to it, sticky bit or not: a file another user may have put there or
    changed is never loaded. A symbolic link is checked as what it leads to (its target, the folders above
    that, and with `below` everything inside it): a link of one's own may lead to a file another user can
    write; one that leads nowhere is refused (whoever can create its target would choose what is loaded)."""
    seen = set() if _seen is None else _seen
    path = Path(os.path.abspath(path))
    check_ancestors(path)
    entries = [path]
    if below and path.is_dir() and not path.is_symlink():
        for folder, dirs, files in os.walk(path):
            entries += [Path(folder, name) for name in dirs + files]
    uid = os.getuid()
    for entry in entries:
        st = os.lstat(entry)
        if st.st_uid not in (0, uid):
            raise UnsafePath(f"{entry} belongs to uid {st.st_uid}, not to you (uid {uid}): another user put it "
                             f"there, and it is not loaded")
        if stat.S_ISLNK(st.st_mode):
            target = Path(os.path.realpath(entry))
            if not target.exists():
                raise UnsafePath(f"{entry} is a link to {target}, which does not exist: whoever creates it would "
                                 f"choose what is loaded; remove the link")
            if target not in seen:
                seen.add(target)
                check_trusted(target, below, seen)
        elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UnsafePath(f"{entry} (mode {stat.S_IMODE(st.st_mode):04o}) can be written by other users, so what "
                             f"it holds may not be yours, and it is not loaded; if it is: chmod -R go-w {entry}")


CODE_SUFFIXES = (".py", ".pyc", ".pyw", ".so")  # what Python imports from a folder on sys.path


def check_code_folder(folder: str | Path, _seen: set[Path] | None = None) -> None:
    """Before `folder` goes first on `sys.path` (a `--task FILE.py`'s): it passes `check_trusted`, and so does
    everything in it an import could run: each module (source, bytecode, extension), each `__pycache__` folder
    with everything in it (Python runs a cached `.pyc` in place of its source), and each folder that holds code
    (a package: another user who can write it can add modules), checked the same way. Folders without code
    (data) are not walked: a task beside a home folder's thousands of files costs one listing of each."""
    seen = set() if _seen is None else _seen
    folder = Path(os.path.realpath(folder))
    if folder in seen:
        return
    seen.add(folder)
    check_trusted(folder)
    for entry in os.scandir(folder):
        path = Path(entry.path)
        if entry.is_dir() and entry.name == "__pycache__":
            check_trusted(path, below=True)
        elif entry.is_dir() and _holds_code(path):
            check_code_folder(path, seen)
        elif entry.name.endswith(CODE_SUFFIXES):
            check_trusted(path)


def _holds_code(folder: Path) -> bool:
    try:
        return any(e.name == "__pycache__" or e.name.endswith(CODE_SUFFIXES) for e in os.scandir(folder))
    except OSError:  # not ours to list: nothing there is imported either
        return False


def private_tmpdir() -> str:
    """This process's own temp folder: a new 0700 folder of a random name (`mkdtemp`) inside the TMPDIR it was
    given, made TMPDIR, RAY_TMPDIR and Python's `tempfile` default, and removed at exit. Every process this one
    starts inherits it: a local Ray's processes, its workers, Tune's trials, Train's ranks. Called where a
    process starts, before torch is imported, because shared /tmp paths are anyone's to create first:
    torch's compile caches (`<tmp>/torchinductor_<user>`, whose precompiled headers torch takes as it finds
    them, even under TORCHINDUCTOR_CACHE_DIR), Ray Tune and Train's file locks (`<tmp>/_ray_lockfiles`: made
    0700 by another user, every resume fails; made 0777, they hold our locks), multiprocessing's `pymp-*`
    folders. Idempotent per process (a fork gets its own, inside its parent's)."""
    made = _tmpdir.get(os.getpid())
    if made:
        return made
    given = os.environ.get("TMPDIR") or tempfile.gettempdir()
    # flat, never nested: a folder made for a parent (a command whose job a warm starter's child runs) is
    # not the base of its child's, where Ray's socket paths (at most 107 bytes) go
    base = os.environ.get(OWN_TMPDIR_BASE) or given if given == os.environ.get(OWN_TMPDIR) else given
    try:
        check_ancestors(Path(base))
    except UnsafePath as exc:
        raise UnsafePath(f"TMPDIR {base}: {exc}") from None
    folder = tempfile.mkdtemp(prefix="rayhpc-tmp-", dir=base)
    _tmpdir[os.getpid()] = folder
    os.environ.update({"TMPDIR": folder, "RAY_TMPDIR": folder, OWN_TMPDIR: folder, OWN_TMPDIR_BASE: base})
    tempfile.tempdir = folder  # `tempfile` reads TMPDIR once per process, maybe before this call
    atexit.register(_remove_own, folder, os.getpid())
    return folder


def _remove_own(folder: str, pid: int) -> None:
    """At exit: `folder`, where this is the process that made it. A child forked from it (a warm starter's)
    runs its exit handlers too, and leaves the folder to the process still using it."""
    if os.getpid() == pid:
        shutil.rmtree(folder, True)


OWN_TMPDIR, OWN_TMPDIR_BASE = "RAYHPC_OWN_TMPDIR", "RAYHPC_OWN_TMPDIR_BASE"  # the last one made, and where
_tmpdir: dict[int, str] = {}  # pid -> its private temp folder (a fork inherits the dict, not the folder)
