"""Real model stores for the source tests and `volga bench fetch`: versitygw (an S3-compatible server), Debian's
docker-registry (distribution 2.8, an OCI registry), and the clients users push with (boto3, the oras CLI).
`make setup` installs them (scripts/install-stores.sh)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from typing import Any

STORES = pathlib.Path(os.environ.get("VOLGA_STORES", pathlib.Path.home() / ".cache/volga/stores"))
VERSITYGW = STORES / "bin" / "versitygw"
ORAS = STORES / "bin" / "oras"
REGISTRY = shutil.which("docker-registry") or "/usr/bin/docker-registry"
ACCESS, SECRET = "volga-test-access", "volga-test-secret-key"


def missing() -> str:
    """Why the stores cannot run here ('' when they can)."""
    lacking = [str(p) for p in (VERSITYGW, ORAS, pathlib.Path(REGISTRY)) if not pathlib.Path(p).exists()]
    try:
        import boto3  # noqa: F401
    except ImportError:
        lacking.append("boto3")
    return f"not installed: {', '.join(lacking)} (make setup runs scripts/install-stores.sh)" if lacking else ""


def self_signed(folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    """A private CA and a certificate it signed for 127.0.0.1 (trustme): the (CA, certificate, key) files."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    files = (folder / "ca.pem", folder / "cert.pem", folder / "key.pem")
    ca.cert_pem.write_to_path(str(files[0]))
    cert.cert_chain_pems[0].write_to_path(str(files[1]))
    cert.private_key_pem.write_to_path(str(files[2]))
    return files


@contextlib.contextmanager
def small_disk(path: pathlib.Path, mib: int) -> Iterator[pathlib.Path]:
    """A file system of `mib` MiB (a size-limited tmpfs) mounted at `path` for the block: a disk that really fills.
    Skips the test, saying why, where mounting is not allowed (root with CAP_SYS_ADMIN is needed)."""
    import pytest

    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0755", "tmpfs", str(path)],
                             capture_output=True, text=True, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a {mib} MiB tmpfs at {path} (needs root with CAP_SYS_ADMIN): "
                    f"{mounted.stderr.strip() or mounted.returncode}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, name: str, args: list[str], folder: pathlib.Path, port: int, env: dict[str, str]) -> None:
        self.port = port
        self.log = folder / f"{name}.log"
        self.proc = subprocess.Popen(args, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **env}, start_new_session=True)
        from procs import wait_for

        wait_for(f"{name} to listen", self._listening, timeout=60, proc=self.proc)

    def _listening(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class S3(Server):
    """versitygw over a POSIX folder, one root user."""

    def __init__(self, folder: pathlib.Path, tls: tuple[pathlib.Path, pathlib.Path, pathlib.Path] | None = None
                 ) -> None:
        """`tls`: (CA, certificate, key) files: the store speaks HTTPS only."""
        data = folder / "s3"
        data.mkdir(parents=True, exist_ok=True)
        port = free_port()
        https = ["--cert", str(tls[1]), "--key", str(tls[2])] if tls else []
        super().__init__("versitygw", [str(VERSITYGW), "--access", ACCESS, "--secret", SECRET, "--quiet", *https,
                                       "--port", f"127.0.0.1:{port}", "posix", str(data)], folder, port, {})
        self.endpoint = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        self.tls = tls

    def credentials(self, secret: str = SECRET) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": secret, "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_REGION": "us-east-1"}

    def client(self) -> Any:
        """boto3's S3 client, as a user uploads with it."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS,
                            aws_secret_access_key=SECRET, region_name="us-east-1",
                            verify=str(self.tls[0]) if self.tls else None)


def untrusted_s3(folder: pathlib.Path, model: pathlib.Path, key: str = "tls/model.onnx"
                 ) -> tuple[S3, tuple[pathlib.Path, pathlib.Path, pathlib.Path]]:
    """versitygw over HTTPS with a private CA's certificate (which no client trusts unless told), `model` uploaded
    to bucket `models` as `key`: the store, and the (CA, certificate, key) files."""
    files = self_signed(folder)
    s3 = S3(folder, tls=files)
    try:
        s3.client().create_bucket(Bucket="models")
        s3.client().upload_file(str(model), "models", key)
    except BaseException:
        s3.stop()
        raise
    return s3, files


class Registry(Server):
    """docker-registry (distribution 2.8) on a folder, plain HTTP on loopback."""

    def __init__(self, folder: pathlib.Path, tls: tuple[pathlib.Path, pathlib.Path, pathlib.Path] | None = None
                 ) -> None:
        """`tls`: (CA, certificate, key) files: the registry speaks HTTPS only."""
        port = free_port()
        config = folder / "registry.yml"
        https = f"  tls:\n    certificate: {tls[1]}\n    key: {tls[2]}\n" if tls else ""
        config.write_text(f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {folder / 'registry'}\n"
                          f"http:\n  addr: 127.0.0.1:{port}\n{https}")
        super().__init__("registry", [REGISTRY, "serve", str(config)], folder, port, {})
        self.host = f"127.0.0.1:{port}"
        self.tls = tls

    def push(self, reference: str, files: list[str], cwd: pathlib.Path) -> str:
        """`oras push` the files (or a folder) as an artifact; the manifest's digest."""
        how = ["--ca-file", str(self.tls[0])] if self.tls else ["--plain-http"]
        out = subprocess.run([str(ORAS), "push", *how, f"{self.host}/{reference}", *files], cwd=cwd,
                             capture_output=True, text=True, timeout=300, check=True).stdout
        return next(line.split()[-1] for line in out.splitlines() if line.startswith("Digest:"))

    def alive(self) -> bool:
        with urllib.request.urlopen(f"http://{self.host}/v2/", timeout=5) as reply:
            return bool(reply.status == 200)
