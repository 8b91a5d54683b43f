"""Run commands from a built image the way its pod runs them, without a container engine.

`podman run` cannot start containers on these machines (crun cannot set rlimits, cgroups are hybrid), so an
image's root filesystem is mounted with buildah and entered with chroot inside a private mount namespace that
has the host's /proc, /sys and /dev bound in: what a privileged pod with hostPID sees. The command runs with the
image's environment and as the user asked for (the chart's UIDs), on the host's network namespace.
"""

from __future__ import annotations

import json
import pathlib
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any


def have_buildah() -> bool:
    return shutil.which("buildah") is not None


def image_exists(image: str) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", image], capture_output=True,
                          check=False).returncode == 0


class Rootfs:
    """One working container of `image`, mounted; `popen` runs a command inside it. close() removes it."""

    def __init__(self, image: str) -> None:
        self.image = image
        self.container = _out(["buildah", "from", "--quiet", image])
        self.root = pathlib.Path(_out(["buildah", "mount", self.container]))
        config: dict[str, Any] = json.loads(_out(["buildah", "inspect", "--type", "image", image]))["Docker"]["config"]
        self.env: list[str] = list(config.get("Env") or [])
        self.user: str = config.get("User") or "0:0"
        self.entrypoint: list[str] = list(config.get("Entrypoint") or [])

    def popen(self, args: Sequence[str], user: str | None = None, groups: str = "", umask: str = "0022",
              binds: Mapping[pathlib.Path, str] | None = None, env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen[str]:
        """Start `args` in the image as `user` (uid:gid, default the image's USER), with host folders bound in."""
        script = ["set -e", f"r={shlex.quote(str(self.root))}"]
        script += [f'mount --rbind /{d} "$r/{d}"' for d in ("proc", "sys", "dev")]
        for source, target in (binds or {}).items():
            script.append(f'mkdir -p "$r{target}" && mount --bind {shlex.quote(str(source))} "$r{target}"')
        userspec = user or self.user
        if ":" not in userspec:
            userspec += f":{userspec}"
        environment = [*self.env, *(f"{k}={v}" for k, v in (env or {}).items())]
        if not any(e.startswith("HOME=") for e in environment):
            environment.append("HOME=/")  # what container runtimes set for a user without a passwd entry
        script.append(f"umask {umask}")
        script.append("exec env -i " + " ".join(shlex.quote(e) for e in environment)
                      + f' chroot --userspec={shlex.quote(userspec)}'
                      + (f" --groups={shlex.quote(groups)}" if groups else "") + ' "$r" "$@"')
        return subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--fork", "sh", "-c",
                                 "\n".join(script), "sh", *args], text=True, **kwargs)

    def run(self, args: Sequence[str], timeout: float = 120.0, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        proc = self.popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)
        out, _ = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")

    def close(self) -> None:
        subprocess.run(["buildah", "umount", self.container], capture_output=True, check=False)
        subprocess.run(["buildah", "rm", self.container], capture_output=True, check=False)


def _out(args: list[str]) -> str:
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout.strip()
