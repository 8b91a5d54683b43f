"""The real node itself: it comes up Ready with every part running, and its stop puts the host back as it was
(the sysctls the kubelet and the bridge plugin set, the iptables rules of kube-proxy and the kubelet, the bridge,
the mounts and cgroups of its pods, its processes)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

from volga_bench import realnode


def host_state() -> dict[str, object]:
    sysctls = {name: (pathlib.Path("/proc/sys") / name).read_text().strip() for name in realnode.SYSCTLS
               if (pathlib.Path("/proc/sys") / name).exists()}
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return {"sysctls": sysctls,
            "rules": sorted(line for line in rules.splitlines() if not line.startswith(("#", ":"))),
            "bridge": realnode.BRIDGE in links,
            "cgroups": sorted(str(p) for p in pathlib.Path("/sys/fs/cgroup").glob("*/kubepods"))}


def test_a_node_comes_up_and_its_stop_puts_the_host_back() -> None:
    before = host_state()
    node = realnode.RealNode()
    try:
        node.start()
        assert set(node.pids()) >= {"etcd", "kube-apiserver", "containerd", "kubelet", "kube-proxy",
                                     "kube-scheduler", "kube-controller-manager"}
        nodes = node.kubectl("get", "nodes", "-o", "name").stdout.split()
        assert nodes == [f"node/{realnode.NODE_NAME}"]
        # kube-proxy has written its Service rules: the `kubernetes` Service is routed.
        rules = subprocess.run(["iptables-save", "-t", "nat"], capture_output=True, text=True, check=True).stdout
        assert "KUBE-SERVICES" in rules and "default/kubernetes:https" in rules
        during = host_state()
        assert during["sysctls"] != before["sysctls"] or during["rules"] != before["rules"]
        pids = node.pids()
    finally:
        node.stop()
    assert host_state() == before
    assert not node.root.exists()
    for pid in pids.values():
        assert not pathlib.Path(f"/proc/{pid}").exists() or "zombie" in pathlib.Path(f"/proc/{pid}/status").read_text()


def test_a_killed_node_is_cleaned_up_by_the_next_one() -> None:
    """A node whose process is killed cannot put the host back; the next node's start does, from the state the
    killed one saved, and its stop leaves the host as it was before either."""
    before = host_state()
    script = ("from volga_bench import realnode; import time\n"
              "node = realnode.RealNode(); node.start(); print(node.root, flush=True); time.sleep(600)")
    killed = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert killed.stdout is not None
        root = pathlib.Path(killed.stdout.readline().strip())
        assert root.is_dir(), "the first node did not start"
    finally:
        killed.kill()
        killed.wait()
    time.sleep(2)  # its parts die with it (their parent-death signal)
    assert host_state() != before, "a killed node leaves its changes behind"
    node = realnode.RealNode()
    try:
        node.start()
        assert not root.exists(), "the killed node's folder was not removed"
    finally:
        node.stop()
    assert host_state() == before
