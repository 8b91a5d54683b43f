"""The k8s test control plane is a real one: objects persist in etcd, CRD schemas and RBAC are enforced,
the API server restarts on the same data, and kubectl talks to it."""

from __future__ import annotations

import pathlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3
from kubernetes import client as k8s_client
from kubernetes.client import V1ClusterRole, V1ConfigMap, V1Namespace, V1ObjectMeta, V1PolicyRule
from kubernetes.client.exceptions import ApiException

from volga_bench.controlplane import ControlPlane, eventually

pytest_plugins = ["k8s_fixtures"]

GROUP = "test.example.com"


@pytest.fixture
def namespace(kube_client: k8s_client.ApiClient) -> str:
    # The control plane is shared by the session; a fresh namespace per test keeps tests apart.
    # No namespace controller runs, so a deleted namespace would stay Terminating: they are left in place.
    name = f"vt-{uuid.uuid4().hex[:8]}"
    k8s_client.CoreV1Api(kube_client).create_namespace(V1Namespace(metadata=V1ObjectMeta(name=name)))
    return name


@pytest.fixture
def widget_crd(kube_client: k8s_client.ApiClient) -> Iterator[str]:
    """A namespaced CRD `widgets.test.example.com` whose schema needs spec.size, an integer from 1 to 10."""
    ext = k8s_client.ApiextensionsV1Api(kube_client)
    name = f"widgets.{GROUP}"
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "required": ["size"],
                "properties": {"size": {"type": "integer", "minimum": 1, "maximum": 10}, "color": {"type": "string"}},
            }
        },
        "required": ["spec"],
    }
    # A plain manifest reads better than the nested V1CustomResourceDefinition models; the client accepts both.
    ext.create_custom_resource_definition(
        {  # type: ignore[arg-type]
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": name},
            "spec": {
                "group": GROUP,
                "scope": "Namespaced",
                "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
                "versions": [
                    {"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": schema}}
                ],
            },
        }
    )

    def established() -> bool:
        status = ext.read_custom_resource_definition(name).status
        conditions = (status.conditions if status else None) or []
        return any(c.type == "Established" and c.status == "True" for c in conditions)

    eventually(established, what=f"CRD {name} Established")
    yield "widgets"
    ext.delete_custom_resource_definition(name)


def widget(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": {"name": name}, "spec": spec}


def config_map(name: str, data: dict[str, str]) -> V1ConfigMap:
    return V1ConfigMap(metadata=V1ObjectMeta(name=name), data=data)


def cluster_role(name: str, resource: str, verbs: list[str]) -> V1ClusterRole:
    rule = V1PolicyRule(api_groups=[""], resources=[resource], verbs=verbs)
    return V1ClusterRole(metadata=V1ObjectMeta(name=name), rules=[rule])


def test_namespace_and_configmap_round_trip(kube_client: k8s_client.ApiClient, namespace: str) -> None:
    core = k8s_client.CoreV1Api(kube_client)
    core.create_namespaced_config_map(namespace, config_map("settings", {"tier": "warm"}))

    names = {ns.metadata.name for ns in core.list_namespace().items if ns.metadata}
    assert {namespace, "default", "kube-system"} <= names
    maps = core.list_namespaced_config_map(namespace).items
    assert [(m.metadata.name, m.data) for m in maps if m.metadata] == [("settings", {"tier": "warm"})]
    # Fields the server fills in prove the object went through the API server and etcd, not a stub.
    stored = core.read_namespaced_config_map("settings", namespace).metadata
    assert stored and stored.uid and stored.resource_version


def test_crd_objects_are_stored_and_schema_enforced(
    kube_client: k8s_client.ApiClient, namespace: str, widget_crd: str
) -> None:
    custom = k8s_client.CustomObjectsApi(kube_client)

    # Discovery of a just-Established CRD can lag a moment behind: retry the first create.
    eventually(
        lambda: custom.create_namespaced_custom_object(GROUP, "v1", namespace, widget_crd, widget("w1", {"size": 3})),
        what="first Widget created",
    )
    listed: list[dict[str, Any]] = custom.list_namespaced_custom_object(  # type: ignore[index]
        GROUP, "v1", namespace, widget_crd
    )["items"]
    assert [(w["metadata"]["name"], w["spec"]) for w in listed] == [("w1", {"size": 3})]

    for bad in ({"size": "three"}, {"size": 11}, {"color": "red"}):
        with pytest.raises(ApiException) as err:
            custom.create_namespaced_custom_object(GROUP, "v1", namespace, widget_crd, widget("bad", bad))
        assert err.value.status == 422, (bad, err.value.body)
        assert "spec." in str(err.value.body)


def test_rbac_is_enforced(
    control_plane: ControlPlane, kube_client: k8s_client.ApiClient, tmp_path: pathlib.Path
) -> None:
    rbac = k8s_client.RbacAuthorizationV1Api(kube_client)
    # RBAC objects are validated like any other: a rule without verbs is refused.
    with pytest.raises(ApiException) as err:
        rbac.create_cluster_role(cluster_role("vt-no-verbs", "pods", verbs=[]))
    assert err.value.status == 422

    user = f"alice-{uuid.uuid4().hex[:6]}"
    cert, key = control_plane.pki.client_cert(user)
    alice = control_plane.api_client(control_plane.write_kubeconfig(tmp_path / "alice.kubeconfig", cert, key))
    try:
        with pytest.raises(ApiException) as err:
            k8s_client.CoreV1Api(alice).list_namespace()
        assert err.value.status == 403

        role = f"vt-ns-reader-{user}"
        rbac.create_cluster_role(cluster_role(role, "namespaces", verbs=["list"]))
        rbac.create_cluster_role_binding(
            {  # type: ignore[arg-type]
                "metadata": {"name": role},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
            }
        )
        # The RBAC authorizer reads bindings through an informer: the grant shows up after a moment.
        eventually(lambda: k8s_client.CoreV1Api(alice).list_namespace().items, what=f"{user} may list namespaces")
        with pytest.raises(ApiException) as err:
            k8s_client.CoreV1Api(alice).list_namespaced_config_map("default")
        assert err.value.status == 403
    finally:
        alice.close()  # type: ignore[no-untyped-call]


def test_apiserver_restart_keeps_etcd_data(
    control_plane: ControlPlane, kube_client: k8s_client.ApiClient, namespace: str
) -> None:
    core = k8s_client.CoreV1Api(kube_client)
    core.create_namespaced_config_map(namespace, config_map("survivor", {"k": "v"}))

    control_plane.stop_apiserver()
    with pytest.raises(urllib3.exceptions.MaxRetryError):
        core.read_namespaced_config_map("survivor", namespace)
    control_plane.start_apiserver()

    # Same port and certificates: the client made before the restart keeps working.
    assert core.read_namespaced_config_map("survivor", namespace).data == {"k": "v"}


def test_kubectl_get_ns(control_plane: ControlPlane, namespace: str) -> None:
    result = control_plane.kubectl("get", "ns", "-o", "name")
    assert f"namespace/{namespace}" in result.stdout.split(), result
    assert "namespace/default" in result.stdout.split()
