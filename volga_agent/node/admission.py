"""What a node admits: model files inside its model roots, model code only where allowed, and no more instances
than its cap; and the node defaults taken from the machine (a host memory budget, the instance cap).

A ModelSpec is written by whoever may create one in the cluster, and the agent runs as root: its `spec.source`
must not make the agent open any file it names, and loading it must not run code unless the node says so.
The pool asks `check_source` before it creates an instance, so a refusal is the instance's recorded reason
(readiness, EMI status). See docs/security.md.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import stat
from collections.abc import Iterable, Sequence

from volga_agent.node import instance
from volga_agent.node.settings import Settings
from volga_core import api

# Frameworks whose files run Python when loaded: a .py source is executed, anything else is unpickled.
MODEL_CODE_FRAMEWORKS = frozenset({api.Framework.PYTORCH})
# The memory one instance is assumed to need when the cap is taken from the machine (a small CPU worker's RSS).
INSTANCE_MEMORY_ESTIMATE = 256 * 2**20
MEMINFO = pathlib.Path("/proc/meminfo")
# The flag that adds a model root to `volga up` (and `volga validate`).
ROOTS_FLAG = "volga up --model-root DIR"
INSTANCE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def check_source(spec: api.ModelSpecSpec, roots: Sequence[str], allow_model_code: bool) -> pathlib.Path:
    """The model file `spec.source` names, symlinks resolved: a regular file inside one of `roots` (anywhere when
    `roots` is empty). ValueError naming spec.source and the reason otherwise."""
    where = f"spec.source: {spec.source}"
    if spec.framework in MODEL_CODE_FRAMEWORKS and not allow_model_code:
        raise ValueError(f"{where}: framework {spec.framework.value} runs model code when loaded (a .py file is "
                         "executed, any other file is unpickled) and this node does not allow model code; use onnx "
                         "or torchscript, or allow it with settings.allow_model_code (volga up --allow-model-code)")
    path = spec.source_path
    if not path.is_absolute():
        raise ValueError(f"{where}: must be an absolute path on the node")
    try:
        resolved = path.resolve(strict=True)
        mode = resolved.stat().st_mode
    except FileNotFoundError:
        raise ValueError(f"{where}: model file {path} does not exist") from None
    except (OSError, RuntimeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"{where}: cannot be opened: {reason}") from None
    if roots and not any(resolved.is_relative_to(pathlib.Path(root).resolve()) for root in roots):
        raise ValueError(f"{where}: resolves to {resolved}, outside the model roots ({', '.join(roots)}); "
                         f"model files must live under settings.model_roots ({ROOTS_FLAG})")
    if not stat.S_ISREG(mode):
        raise ValueError(f"{where}: resolves to {resolved}, which is not a regular file")
    return resolved


@dataclasses.dataclass(frozen=True)
class Outside:
    """A ModelSpec whose model file lies outside the model roots: where it was read, its name and source, and the
    file its source resolves to."""

    label: str
    name: str
    source: str
    path: pathlib.Path  # the file the source names
    resolved: pathlib.Path  # ... with symlinks resolved
    field: str = "spec.source"  # or a model server's spec.server.workingDir
    what: str = "the model file"  # or a model server's source, or working folder

    @property
    def problem(self) -> tuple[str, str]:
        """(field path, reason), as `volga validate` lists a problem."""
        where = f"{self.path}" if self.resolved == self.path else f"{self.path}, which resolves to {self.resolved},"
        return self.field, f"{self.source}: {self.what} {where} is outside the model roots"


def outside_roots(labelled: Iterable[tuple[str, api.ModelSpec]], roots: Sequence[str]) -> list[Outside]:
    """The ModelSpecs (with where each was read) whose model file exists and resolves outside `roots` (none when
    `roots` is empty): each of them `check_source` would refuse, one instance at a time, once the node runs."""
    if not roots:
        return []
    inside = [pathlib.Path(root).resolve() for root in roots]
    found = []
    for label, spec in labelled:
        if spec.spec.remote_source:
            continue  # fetched into the model cache, a root
        server = spec.spec.server if spec.spec.framework is api.Framework.SERVER else None
        given = [("spec.source", spec.spec.source, "the model file" if server is None else "the server's source")]
        if server is not None and server.working_dir:
            given.append(("spec.server.workingDir", server.working_dir, "the server's working folder"))
        for field, source, what in given:
            path = spec.spec.source_path if field == "spec.source" else instance.server_folder(spec.spec)
            if not path.is_absolute():
                continue  # check_source says why, when the instance is created
            try:
                resolved = path.resolve(strict=True)
            except (OSError, RuntimeError):
                continue  # missing or unreadable: said where the file is read
            if not any(resolved.is_relative_to(root) for root in inside):
                found.append(Outside(label, spec.metadata.name, source, path, resolved, field, what))
    return found


def roots_hint(roots: Sequence[str], origin: str) -> list[str]:
    """What to do about model files outside the model roots: the roots in force (`origin`: where they come from)
    and how to add one."""
    return [f"the model roots: {', '.join(roots)} ({origin})",
            f"model files must live under a model root: add the folder that holds them with `{ROOTS_FLAG}` "
            "(repeatable; it replaces the default roots, so name every folder the models lie in; `volga validate` "
            "takes it too) or with the setting settings.model_roots"]


def check_instance_name(name: str) -> None:
    """ValueError unless `name` is a DNS-1123 subdomain: the instance's folders (workdir, snapshots) are named
    after it, so it must never leave their roots ('/', '..')."""
    if len(name) > 253 or not INSTANCE_NAME.match(name):  # EMI keys join a namespace and a name with '.'
        raise ValueError(f"instance name {name!r}: must be a DNS-1123 subdomain of at most 253 characters "
                         "(lowercase letters, digits, '-' and '.'), not a path")


def check_count(placed: int, settings: Settings) -> None:
    """ValueError when more instances are placed on the node than `settings.max_instances` (0: no cap)."""
    cap = settings.max_instances
    if cap and placed > cap:
        raise ValueError(f"{placed} instances are placed on this node, more than settings.max_instances ({cap}): "
                         "lower the ModelSpecs' pool floors or raise the cap (volga up --max-instances)")


def mem_total(meminfo: pathlib.Path = MEMINFO) -> int:
    """The machine's memory in bytes (MemTotal of /proc/meminfo); 0 when it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def node_settings(settings: Settings, total: int | None = None) -> Settings:
    """`settings` with what is left at 0 taken from the machine: the host memory budget (budgets.host_memory_fraction
    of MemTotal) and the instance cap (one instance per INSTANCE_MEMORY_ESTIMATE of MemTotal)."""
    total = mem_total() if total is None else total
    if total <= 0:
        return settings
    update: dict[str, object] = {}
    budgets = settings.budgets
    if budgets.host_memory_bytes == 0 and budgets.host_memory_fraction > 0:
        update["budgets"] = budgets.model_copy(update={"host_memory_bytes": int(total * budgets.host_memory_fraction)})
    if settings.max_instances == 0:
        update["max_instances"] = max(1, total // INSTANCE_MEMORY_ESTIMATE)
    return settings.model_copy(update=update) if update else settings


def spec_folders(files: Sequence[str]) -> list[str]:
    """The folders ModelSpec files (or folders of them) were read from: `volga up`'s default model roots."""
    folders = []
    for name in files:
        path = pathlib.Path(name).resolve()
        folders.append(str(path if path.is_dir() else path.parent))
    return sorted(set(folders))

