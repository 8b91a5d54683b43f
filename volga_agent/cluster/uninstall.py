"""Whether an agent stops because Volga is being uninstalled from its node, and what it then takes with it.

An agent pod ends for three reasons: it was deleted (its DaemonSet starts another at once), its DaemonSet rolls it
(`helm upgrade`), or its DaemonSet was deleted (`helm uninstall`: Helm deletes with background propagation, so the
DaemonSet is gone, or marked for deletion, before its pods are told to stop). The images a node keeps across agent
restarts (settings.shared.node_local, the chart's hostPath mode) must survive the first two, so the next agent
restores them instead of cold-starting, and must not outlive the third: an uninstalled Volga leaves nothing on the
node. The agent's pool already stops every worker and removes the images it made; this removes the kept ones.

The DaemonSet is named by VOLGA_DAEMONSET ("namespace/name", from the chart). `Follower` watches it from the agent's
start: `helm uninstall` deletes the agent's Role together with the DaemonSet, so a read at the stop is often denied,
while a watch opened earlier still brings the deletion. At the stop the watch's view decides, else a read; when
neither can say (an outage), the images stay: keeping a few files is the safe mistake; removing them wrongly
costs the next agent a cold start per model.
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib
import shutil
import threading
from typing import Any

import kubernetes

from volga_core.kube import client, watch

log = logging.getLogger(__name__)

DAEMONSET_ENV = "VOLGA_DAEMONSET"


def daemonset_gone(ref: str, api: kubernetes.client.ApiClient | None = None) -> bool:
    """True when the DaemonSet `namespace/name` does not exist or is being deleted; False when it exists or when
    the API server cannot tell. `api`: a client to use (else the pod's in-cluster one, or the kubeconfig's)."""
    namespace, _, name = ref.partition("/")
    if not namespace or not name:
        return False
    try:
        reader = api or client.api_client()
    except kubernetes.config.ConfigException as exc:
        log.warning("no Kubernetes client (%s): the kept images stay", exc)
        return False
    try:
        found = kubernetes.client.AppsV1Api(reader).read_namespaced_daemon_set(name, namespace, _request_timeout=10)
    except kubernetes.client.exceptions.ApiException as exc:
        if exc.status == 404:
            return True
        log.warning("cannot read the DaemonSet %s (HTTP %s): the kept images stay", ref, exc.status)
        return False
    except Exception as exc:  # any transport failure: the API server cannot tell
        log.warning("cannot read the DaemonSet %s (%s): the kept images stay", ref, exc)
        return False
    finally:
        if api is None:
            reader.close()
    return found.metadata is not None and found.metadata.deletion_timestamp is not None


def remove_kept(folder: pathlib.Path) -> int:
    """Remove everything in the kept-images folder (the folder itself is the chart's mount point); the count."""
    removed = 0
    for entry in folder.iterdir() if folder.is_dir() else ():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed += 1
    return removed


class Follower:
    """Watches one DaemonSet (list + watch with a name field selector, which a Role naming that DaemonSet allows)
    and remembers whether it was seen deleted or marked for deletion."""

    def __init__(self, ref: str, api: kubernetes.client.ApiClient | None = None) -> None:
        self.ref = ref
        self.namespace, _, self.name = ref.partition("/")
        self.api = api or client.api_client()
        self.gone = threading.Event()
        self._seen = False
        lister = functools.partial(kubernetes.client.AppsV1Api(self.api).list_namespaced_daemon_set, self.namespace)
        self.watch = watch.Watch(f"daemonset-{self.name}", watch.json_lister(lister), self._changed,
                                 field_selector=f"metadata.name={self.name}")

    def start(self) -> None:
        self.watch.start()

    def stop(self) -> None:
        self.watch.stop()

    def _changed(self, objects: dict[tuple[str, str], Any]) -> None:
        found = objects.get((self.namespace, self.name))
        if found is None:
            if self._seen:  # deleted after it was seen: an empty first list proves nothing
                self.gone.set()
            return
        self._seen = True
        if found["metadata"].get("deletionTimestamp"):
            self.gone.set()

    def uninstalled(self, wait: float = 3.0) -> bool:
        """At the agent's stop: the watch saw the DaemonSet go, or a read finds it gone; when the read is denied
        (the Role went with the release), the watch gets `wait` seconds to bring the deletion."""
        if self.gone.is_set():
            return True
        if daemonset_gone(self.ref, self.api):
            return True
        return self.gone.wait(wait)


def clean_if_uninstalled(folder: str, ref: str | None = None, api: kubernetes.client.ApiClient | None = None,
                         follower: Follower | None = None) -> bool:
    """At the agent's stop: remove the node's kept images when its DaemonSet is gone. True when it did."""
    ref = ref if ref is not None else os.environ.get(DAEMONSET_ENV, "")
    if not folder or not ref:
        return False
    if not (follower.uninstalled() if follower is not None else daemonset_gone(ref, api)):
        return False
    removed = remove_kept(pathlib.Path(folder))
    log.warning("the DaemonSet %s is gone (uninstalled): removed %d kept images from %s", ref, removed, folder)
    return True
