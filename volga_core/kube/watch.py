"""List + watch one resource forever on a thread, through API server outages.

The node daemons keep serving from the last state they saw while the API server is away (a restart, an
upgrade, a network cut): a failed list is retried with exponential backoff (0.5 s doubling to 10 s, starting
over once a list works), and a watch that breaks off is followed by a new list.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import kubernetes

from volga_core.kube import client

log = logging.getLogger(__name__)
FIRST_DELAY_S = 0.5
MAX_DELAY_S = 10.0
LIST_PAGE = 500
WATCH_TIMEOUT_S = 300


def json_lister(list_call: Callable[..., Any]) -> Callable[..., Any]:
    """A core API list call (`CoreV1Api.list_node`, `list_namespaced_config_map`, ...) as `Events` calls it: a list
    answers the API server's JSON as dicts (not the client's models, as the custom object APIs answer), a watch the
    unparsed response `Events` reads line by line."""

    def lister(**kwargs: Any) -> Any:
        raw = list_call(**{"_preload_content": False, **kwargs})
        return raw if kwargs.get("watch") else json.loads(raw.data)

    return lister


class Events:
    """List + watch one resource forever on a thread, handing over each object as it comes rather than the whole
    set (`Watch`): for a controller holding thousands of objects, where a copy of them all per event would cost
    more than the event. `on_list(objects)` gets every object of a (re)list, `on_event(type, obj)` each watch event
    after it (ADDED, MODIFIED, DELETED). Objects are the API server's JSON as dicts (no client models); lists come
    LIST_PAGE at a time. A watch that ends resumes where it stopped; one too far behind (410) lists again.

    With `on_page(objects, first)`, a (re)list is not held whole: each page goes there as it arrives (`first` for a
    list's first page, also when a failed list starts over) and `on_list` gets [] once the list is complete, so
    what a relist of thousands of objects holds at once is one page."""

    def __init__(self, name: str, lister: Callable[..., Any], on_list: Callable[[list[Any]], None],
                 on_event: Callable[[str, Any], None], on_page: Callable[[list[Any], bool], None] | None = None,
                 **list_kwargs: Any) -> None:
        self.name = name
        self.lister = lister
        self.on_list = on_list
        self.on_event = on_event
        self.on_page = on_page
        self.list_kwargs = list_kwargs
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"watch-{name}", daemon=True)
        self.outages = 0

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()

    def _run(self) -> None:
        first_delay = FIRST_DELAY_S
        while not self.stopping.is_set():
            listed = client.until_stopped(self._list, self.stopping, first_delay, MAX_DELAY_S, self._outage)
            if listed is None:
                return
            items, version = listed
            self.on_list(items)
            try:
                self._follow(version)
                first_delay = FIRST_DELAY_S
            except client.TRANSIENT as exc:
                if getattr(exc, "status", None) == 410:
                    continue  # the watch fell too far behind: list again now
                self._outage(exc, FIRST_DELAY_S)
                self.stopping.wait(FIRST_DELAY_S)
                first_delay = 2 * FIRST_DELAY_S

    def _list(self) -> tuple[list[Any], str]:
        items: list[Any] = []
        token = None
        while True:
            page = self.lister(limit=LIST_PAGE, _request_timeout=30, **({"_continue": token} if token else {}),
                               **self.list_kwargs)
            if self.on_page is not None:
                self.on_page(page.get("items") or [], token is None)
            else:
                items += page.get("items") or []
            token = page["metadata"].get("continue")
            if not token:
                return items, page["metadata"]["resourceVersion"]

    def _follow(self, version: str) -> None:
        """Watch from `version` on, one request after another (each ends after WATCH_TIMEOUT_S), each line parsed
        once with json (the client's Watch would build its models or parse twice)."""
        while not self.stopping.is_set():
            response = self.lister(watch=True, resource_version=version, timeout_seconds=WATCH_TIMEOUT_S,
                                   allow_watch_bookmarks=True, _preload_content=False,
                                   _request_timeout=WATCH_TIMEOUT_S + 30, **self.list_kwargs)
            try:
                for line in kubernetes.watch.watch.iter_resp_lines(response):
                    if self.stopping.is_set():
                        return
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    obj = event["object"]
                    if event["type"] == "ERROR":  # 410: the version is too old, list again
                        raise kubernetes.client.ApiException(status=obj.get("code"), reason=obj.get("message"))
                    version = obj.get("metadata", {}).get("resourceVersion") or version
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self.on_event(event["type"], obj)
            finally:
                response.close()
                response.release_conn()

    def _outage(self, exc: BaseException | None, delay: float) -> None:
        self.outages += 1
        log.info("watch %s: API server unreachable (%s); keeping the last state, retrying in %.1f s",
                 self.name, type(exc).__name__, delay)


class Watch(Events):
    """List + watch one resource forever on a thread; `on_change(objects)` gets the full current set after each
    (re)list and each event (`synced` is set once the first list arrived). For the node daemons' few objects."""

    def __init__(self, name: str, lister: Callable[..., Any], on_change: Callable[[dict[tuple[str, str], Any]], None],
                 **list_kwargs: Any) -> None:
        super().__init__(name, lister, self._listed, self._changed, **list_kwargs)
        self.on_change = on_change
        self.objects: dict[tuple[str, str], Any] = {}
        self.synced = threading.Event()

    @staticmethod
    def key(obj: Any) -> tuple[str, str]:
        meta = obj["metadata"]
        return meta.get("namespace", ""), meta["name"]

    def _listed(self, items: list[Any]) -> None:
        self.objects = {self.key(o): o for o in items}
        self.synced.set()
        self.on_change(dict(self.objects))

    def _changed(self, kind: str, obj: Any) -> None:
        if kind == "DELETED":
            self.objects.pop(self.key(obj), None)
        else:
            self.objects[self.key(obj)] = obj
        self.on_change(dict(self.objects))
