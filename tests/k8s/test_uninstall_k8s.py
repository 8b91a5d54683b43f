"""At its stop, an agent tells `helm uninstall` (its DaemonSet gone or being deleted) from a restart (its DaemonSet
there), on a real API server, and removes the node's kept images only in the first case."""

from __future__ import annotations

import pathlib

from kubernetes import client as k8s

from volga_agent.cluster import uninstall
from volga_bench.controlplane import ControlPlane

pytest_plugins = ["k8s_fixtures"]


def daemonset(name: str) -> k8s.V1DaemonSet:
    labels = {"app": name}
    pod = k8s.V1PodTemplateSpec(metadata=k8s.V1ObjectMeta(labels=labels), spec=k8s.V1PodSpec(
        containers=[k8s.V1Container(name="agent", image="localhost/volga-agent:dev-cpu")]))
    return k8s.V1DaemonSet(metadata=k8s.V1ObjectMeta(name=name),
                           spec=k8s.V1DaemonSetSpec(selector=k8s.V1LabelSelector(match_labels=labels), template=pod))


def kept(folder: pathlib.Path) -> pathlib.Path:
    image = folder / "0123abcd"
    image.mkdir(parents=True)
    (image / "pstree.img").write_bytes(b"image")
    (folder / ".tmp-publishing").write_bytes(b"half")
    return folder


def test_kept_images_go_only_when_the_daemonset_does(control_plane: ControlPlane, tmp_path: pathlib.Path) -> None:
    api = control_plane.api_client()
    apps = k8s.AppsV1Api(api)
    folder = kept(tmp_path / ".kept")
    apps.create_namespaced_daemon_set("default", daemonset("volga-agent"))

    # A restart (pod deleted, helm upgrade): the DaemonSet is there, the images stay.
    assert not uninstall.clean_if_uninstalled(str(folder), "default/volga-agent", api)
    assert sorted(p.name for p in folder.iterdir()) == [".tmp-publishing", "0123abcd"]

    # Being deleted (a foreground deletion holds the object with a deletionTimestamp until its pods are gone).
    apps.delete_namespaced_daemon_set("volga-agent", "default", propagation_policy="Foreground")
    assert uninstall.daemonset_gone("default/volga-agent", api)
    assert uninstall.clean_if_uninstalled(str(folder), "default/volga-agent", api)
    assert folder.is_dir() and list(folder.iterdir()) == []

    # Gone (helm uninstall's background deletion); the folder itself, the chart's mount point, stays.
    assert uninstall.daemonset_gone("default/no-such-agent", api)
    # Nothing names the DaemonSet (not the chart's agent): nothing is removed.
    kept(tmp_path / "other")
    assert not uninstall.clean_if_uninstalled(str(tmp_path / "other"), "", api)
    api.close()


def test_an_api_server_that_cannot_tell_keeps_the_images(control_plane: ControlPlane, tmp_path: pathlib.Path) -> None:
    """Denied (a user without the Role): the images stay, whether or not the DaemonSet exists."""
    cert, key = control_plane.pki.client_cert("no-rights")
    api = control_plane.api_client(control_plane.write_kubeconfig(tmp_path / "kubeconfig", cert, key))
    folder = kept(tmp_path / ".kept")
    assert not uninstall.clean_if_uninstalled(str(folder), "default/no-such-agent", api)
    assert len(list(folder.iterdir())) == 2
    api.close()


def test_the_watch_sees_the_uninstall_that_a_read_cannot(control_plane: ControlPlane, tmp_path: pathlib.Path) -> None:
    """`helm uninstall` deletes the agent's Role with its DaemonSet: a read at the stop is denied, but the watch the
    agent opened at its start (allowed by a Role naming the DaemonSet) brings the deletion."""
    admin = control_plane.api_client()
    rbac = k8s.RbacAuthorizationV1Api(admin)
    rbac.create_namespaced_role("default", k8s.V1Role(metadata=k8s.V1ObjectMeta(name="agent"), rules=[
        k8s.V1PolicyRule(api_groups=["apps"], resources=["daemonsets"], resource_names=["agent-ds"],
                         verbs=["get", "list", "watch"])]))
    rbac.create_namespaced_role_binding("default", k8s.V1RoleBinding(
        metadata=k8s.V1ObjectMeta(name="agent"),
        role_ref=k8s.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name="agent"),
        subjects=[k8s.RbacV1Subject(kind="User", name="agent-user", api_group="rbac.authorization.k8s.io")]))
    apps = k8s.AppsV1Api(admin)
    apps.create_namespaced_daemon_set("default", daemonset("agent-ds"))
    cert, key = control_plane.pki.client_cert("agent-user")
    agent_api = control_plane.api_client(control_plane.write_kubeconfig(tmp_path / "kubeconfig", cert, key))
    follower = uninstall.Follower("default/agent-ds", agent_api)
    follower.start()
    try:
        assert follower.watch.synced.wait(20) and follower._seen
        folder = kept(tmp_path / ".kept")
        # A restart: the DaemonSet is there.
        assert not uninstall.clean_if_uninstalled(str(folder), follower.ref, follower=follower)
        # The uninstall: the Role first (the read is then denied), then the DaemonSet.
        rbac.delete_namespaced_role("agent", "default")
        apps.delete_namespaced_daemon_set("agent-ds", "default")
        assert uninstall.clean_if_uninstalled(str(folder), follower.ref, follower=follower)
        assert list(folder.iterdir()) == []
    finally:
        follower.stop()
        agent_api.close()
        admin.close()
