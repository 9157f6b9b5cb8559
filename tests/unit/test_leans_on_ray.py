"""The library uses Ray, torch and transformers through their public APIs: it assigns nothing to what it imports
from them (documented settings such as `torch.backends.*` aside), forks no process, and imports at most four
private names, each of which still exists and does what the library relies on (a Ray or torch upgrade that
changes one fails here, loudly, not in a user's job)."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

LIBRARY = ROOT / "platform" / "rayhpc"
THEIRS = ("ray", "torch", "transformers", "tensorboardX")
DOCUMENTED_SETTINGS = ("torch.backends",)
# the private names the library imports, and where: each with a comment saying why no public API serves
PRIVATE = {("cluster.py", "ray._raylet", "AuthenticationTokenLoader"), ("cluster.py", "ray._raylet", "Config"),
           ("interrupt.py", "ray._private.ray_logging", "global_worker_stdstream_dispatcher"),
           ("engine/parallelize.py", "torch._inductor.runtime.cache_dir_utils", "default_cache_dir"),
           ("train/rendezvous.py", "ray.train.torch.config", "_TorchBackend"),  # the rendezvous no other user reaches
           ("train/rendezvous.py", "ray.train.torch.config", "_set_torch_distributed_env_vars")}


def modules() -> dict[str, ast.Module]:
    return {str(path.relative_to(LIBRARY)): ast.parse(path.read_text()) for path in sorted(LIBRARY.rglob("*.py"))}


def theirs(module: str | None) -> bool:
    return module is not None and module.split(".")[0] in THEIRS


def imported_names(tree: ast.Module) -> dict[str, str]:
    """Each name bound by an import of Ray, torch, transformers or tensorboardX, and what it names."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update({(a.asname or a.name).split(".")[0]: a.name.split(".")[0] if not a.asname else a.name
                          for a in node.names if theirs(a.name)})
        elif isinstance(node, ast.ImportFrom) and theirs(node.module):
            names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    return names


def dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def patches(tree: ast.Module) -> list[str]:
    """Assignments to attributes of what is imported from their libraries, and `setattr` on it."""
    names, found = imported_names(tree), []

    def check(target: ast.AST, line: int) -> None:
        path = dotted(target)
        if path and path.split(".")[0] in names:
            full = names[path.split(".")[0]] + path[len(path.split(".")[0]):]
            if not full.startswith(DOCUMENTED_SETTINGS):
                found.append(f"line {line}: {full}")

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Attribute):
                    check(target, node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args:
            check(ast.Attribute(value=node.args[0], attr="*"), node.lineno)
    return found


def test_nothing_imported_from_ray_torch_or_transformers_is_assigned_to():
    found = {name: p for name, tree in modules().items() if (p := patches(tree))}
    assert found == {}, f"runtime patches of Ray, torch or transformers: {found}"


def test_the_scan_finds_a_patch_and_a_setattr():
    """The scan itself: the patches cluster.py once made are found (a no-op scan would pass the test above)."""
    tree = ast.parse("from ray._private.node import Node\nimport ray.actor\nimport torch\n"
                     "Node.start_gcs_server = lambda self: None\nray.actor.ActorClassID = object\n"
                     "setattr(torch.nn.Module, 'x', 1)\ntorch.backends.cudnn.benchmark = True\n")
    assert patches(tree) == ["line 4: ray._private.node.Node.start_gcs_server", "line 5: ray.actor.ActorClassID",
                             "line 6: torch.nn.Module.*"]


def test_the_library_forks_no_process():
    forks = [f"{name}:{node.lineno}" for name, tree in modules().items() for node in ast.walk(tree)
             if isinstance(node, ast.Call) and dotted(node.func) in ("os.fork", "os.forkpty")]
    assert forks == []


def private_imports() -> set[tuple[str, str, str]]:
    found = set()
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and theirs(node.module):
                for alias in node.names:
                    private_module = any(part.startswith("_") for part in node.module.split("."))
                    if private_module or (alias.name.startswith("_") and not alias.name.startswith("__")):
                        found.add((name, node.module, alias.name))
            elif isinstance(node, ast.Import):
                found |= {(name, a.name, "") for a in node.names
                          if theirs(a.name) and any(part.startswith("_") for part in a.name.split("."))}
    return found


def test_at_most_four_imports_of_private_names_each_with_its_reason():
    found = private_imports()
    assert found == PRIVATE, f"private imports: {sorted(found - PRIVATE)} new, {sorted(PRIVATE - found)} gone"
    assert len({(file, module) for file, module, _ in found}) <= 4  # import statements
    for file, module, _ in found:
        lines = (LIBRARY / file).read_text().splitlines()
        at = next(i for i, line in enumerate(lines) if f"from {module} import" in line)
        assert "private" in " ".join(lines[max(0, at - 3):at + 1]), f"{file}: no comment says why {module}"


def test_rays_token_cache_can_still_be_reset():
    """`cluster.use_token`: Ray caches its token mode and the token itself once per process."""
    from ray._raylet import AuthenticationTokenLoader, Config

    assert callable(Config.initialize) and callable(AuthenticationTokenLoader.instance().reset_cache)


def test_rays_log_dispatcher_still_has_the_printing_handler():
    """`interrupt.quiet_workers`: the driver's dispatcher of the workers' output, and the handler that prints."""
    import ray
    from ray._private.ray_logging import global_worker_stdstream_dispatcher

    assert callable(global_worker_stdstream_dispatcher.remove_handler)
    # the name under which a driver with log_to_driver adds its printing handler
    assert '"ray_print_logs"' in (Path(ray.__file__).parent / "_private" / "worker.py").read_text()


def test_torchs_compile_caches_and_headers_are_still_where_the_library_looks():
    """`engine.parallelize.private_compile_caches`: the compile caches' default folder is `<tmp>/torchinductor_<user>`
    and the precompiled headers live in it (test_private_tmp.py runs compiles there)."""
    import getpass
    import tempfile

    from torch._inductor.codecache import _HEADER_DIR
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    assert Path(default_cache_dir()) == Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    assert Path(_HEADER_DIR).parent == Path(default_cache_dir())


def test_ray_trains_torch_backend_still_forms_the_world_in_on_start():
    """`train.rendezvous`: the backend whose `on_start` the private rendezvous replaces, and the function that
    sets each rank's torch variables."""
    import inspect

    from ray.train.torch.config import _set_torch_distributed_env_vars, _TorchBackend

    assert "on_start" in vars(_TorchBackend) and callable(_set_torch_distributed_env_vars)
    assert list(inspect.signature(_TorchBackend.on_start).parameters) == ["self", "worker_group", "backend_config"]
