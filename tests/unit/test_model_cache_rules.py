"""The model cache's rules (volga_agent/sources): digests, resumes, eviction, restarts and faults, against an
in-memory store that serves byte ranges (the real stores are exercised in tests/integration/test_sources.py)."""

from __future__ import annotations

import hashlib
import os
import pathlib
from collections.abc import Iterator, Mapping

import pytest

from volga_agent.sources import cache, download, errors, stores, uri


class MemoryStore:
    """Objects by URI; `cut`: serve at most that many bytes of a range (a connection that drops); `reads`: ranges
    asked for."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects
        self.cut: int | None = None
        self.denied = False
        self.reads: list[tuple[int, int]] = []

    def describe(self, source: uri.Source) -> stores.Listing:
        if self.denied:
            raise errors.SourceDenied(f"{source}: the store refused the credentials (credentials from Secret 's')")
        data = self.objects[source.uri]
        obj = stores.Object(source.uri, source.name, len(data), hashlib.md5(data).hexdigest())
        return stores.Listing((obj,), obj.version, False)

    def read(self, obj: stores.Object, start: int, end: int) -> Iterator[bytes]:
        self.reads.append((start, end))
        data = self.objects[obj.key][start:end]
        if self.cut is not None:
            data = data[: self.cut]
        yield data


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def make(root: pathlib.Path, store: MemoryStore, budget: int = 0, chunk: int = 1024) -> cache.Cache:
    def opener(source: uri.Source, credentials: Mapping[str, str], secret: str, connections: int) -> MemoryStore:
        return store

    return cache.Cache(root, budget, connections=3, chunk_bytes=chunk, open_store=opener)


def test_a_source_is_fetched_once_and_named_by_its_digest(tmp_path: pathlib.Path) -> None:
    data = bytes(range(256)) * 40
    store = MemoryStore({"s3://b/m.onnx": data})
    c = make(tmp_path, store)
    first = c.resolve("s3://b/m.onnx")
    assert not first.hit and first.digest == sha(data) and first.path.read_bytes() == data
    assert first.path.name == "m.onnx" and first.path.parent.name == hashlib.sha256(data).hexdigest()
    assert len(store.reads) == 10  # 10 KiB in 1 KiB ranges
    again = c.resolve("s3://b/m.onnx", sha(data))
    assert again.hit and again.path == first.path and len(store.reads) == 10  # pinned and cached: no request


def test_a_pinned_digest_that_does_not_match_is_refused_and_nothing_is_kept(tmp_path: pathlib.Path) -> None:
    store = MemoryStore({"s3://b/m.onnx": b"x" * 5000})
    c = make(tmp_path, store)
    with pytest.raises(errors.SourceMismatch, match=r"spec.sourceDigest is sha256:0{64}: refused"):
        c.resolve("s3://b/m.onnx", "sha256:" + "0" * 64)
    assert c.entries() == {} and not any((tmp_path / "sha256").iterdir())


def test_a_connection_that_keeps_dropping_is_an_error_never_a_short_file(tmp_path: pathlib.Path) -> None:
    store = MemoryStore({"s3://b/m.onnx": b"y" * 5000})
    store.cut = 100
    with pytest.raises(errors.SourceUnavailable, match="closed after 100 of 1024 bytes"):
        make(tmp_path, store).resolve("s3://b/m.onnx")
    assert not any((tmp_path / "sha256").iterdir())


def test_a_cut_fetch_resumes_with_the_ranges_it_lacks(tmp_path: pathlib.Path) -> None:
    data = bytes(range(256)) * 40
    part = tmp_path / "p.part"
    calls: list[tuple[int, int]] = []

    def flaky(start: int, end: int) -> Iterator[bytes]:
        calls.append((start, end))
        if start >= 5120:
            raise errors.SourceUnavailable("gone")
        yield data[start:end]

    with pytest.raises(errors.SourceUnavailable):
        download.fetch(flaky, len(data), part, "v1", connections=1, chunk_bytes=1024)
    served: list[tuple[int, int]] = []

    def whole(start: int, end: int) -> Iterator[bytes]:
        served.append((start, end))
        yield data[start:end]

    got = download.fetch(whole, len(data), part, "v1", connections=2, chunk_bytes=1024)
    assert got == hashlib.sha256(data).hexdigest() and part.read_bytes() == data
    assert sorted(served) == [(n, n + 1024) for n in range(5120, 10240, 1024)]  # only what the first left
    # A new version of the object starts over.
    assert download.fetch(lambda a, b: iter([data[a:b]]), len(data), part, "v2", chunk_bytes=1024) == got


def test_the_fetch_runs_no_further_ahead_of_the_hash_than_its_window(tmp_path: pathlib.Path) -> None:
    """While the first range is held up (so nothing can be hashed), the other connection starts ranges only up to
    connections + AHEAD_CHUNKS: it leaves the CPU to the hash rather than racing on (all 32 ranges, unbounded)."""
    import threading
    import time

    data = os.urandom(32 * 1024)
    asked: list[int] = []
    first_done = threading.Event()
    seen_while_held: list[int] = []

    def read(start: int, end: int) -> Iterator[bytes]:
        asked.append(start // 1024)
        if start == 0:
            time.sleep(0.5)  # the others have long finished any range they may start
            seen_while_held.extend(asked)
            first_done.set()
        yield data[start:end]

    got = download.fetch(read, len(data), tmp_path / "p.part", "v1", connections=2, chunk_bytes=1024)
    assert got == hashlib.sha256(data).hexdigest() and first_done.is_set()
    assert max(seen_while_held) == 2 + download.AHEAD_CHUNKS - 1, seen_while_held
    assert sorted(asked) == list(range(32))


def test_a_changed_object_is_a_new_version_and_the_old_one_stays_its_own(tmp_path: pathlib.Path) -> None:
    store = MemoryStore({"https://h/m.onnx": b"old" * 1000})
    c = make(tmp_path, store)
    old = c.resolve("https://h/m.onnx")
    store.objects["https://h/m.onnx"] = b"new" * 1000
    new = c.resolve("https://h/m.onnx")
    assert new.digest != old.digest and new.path != old.path
    assert old.path.read_bytes() == b"old" * 1000 and new.path.read_bytes() == b"new" * 1000


def test_the_cache_evicts_the_least_recently_used_model_no_instance_holds(tmp_path: pathlib.Path) -> None:
    store = MemoryStore({f"s3://b/{n}.onnx": bytes([n]) * 4000 for n in range(4)})
    c = make(tmp_path, store, budget=10000)
    zero, one = c.resolve("s3://b/0.onnx"), c.resolve("s3://b/1.onnx")
    c.hold("emi-0", zero.digest)
    c.resolve("s3://b/2.onnx")  # 12000 > 10000: 1 goes (0 is held)
    assert set(c.entries()) == {zero.digest, sha(bytes([2]) * 4000)} and not one.path.exists()
    c.hold("emi-2", sha(bytes([2]) * 4000))
    with pytest.raises(errors.CacheFull, match="do not fit the model cache"):
        c.resolve("s3://b/3.onnx")
    assert zero.path.read_bytes() == bytes([0]) * 4000  # the models in use keep serving
    assert c.evictions == 1


def test_the_cache_survives_a_restart_and_drops_what_its_index_does_not_vouch_for(tmp_path: pathlib.Path) -> None:
    data = b"z" * 3000
    store = MemoryStore({"oci://r/m:v1": data})
    first = make(tmp_path, store).resolve("oci://r/m:v1")
    (tmp_path / "sha256" / ("f" * 64)).mkdir()
    reopened = make(tmp_path, store)
    assert reopened.lookup("oci://r/m:v1") is not None and not (tmp_path / "sha256" / ("f" * 64)).exists()
    reads = len(store.reads)
    assert reopened.resolve("oci://r/m:v1").path == first.path and len(store.reads) == reads


def test_a_denied_credential_names_the_secret_and_is_not_retried(tmp_path: pathlib.Path) -> None:
    store = MemoryStore({})
    store.denied = True
    with pytest.raises(errors.SourceDenied, match="Secret 's'") as caught:
        make(tmp_path, store).resolve("s3://b/m.onnx")
    assert not caught.value.retry and errors.SourceUnavailable.retry


def test_folder_digest_is_what_sha256sum_prints_hashed() -> None:
    files = {"model.onnx": "a" * 64, "data/w.bin": "b" * 64}
    lines = f"{'b' * 64}  data/w.bin\n{'a' * 64}  model.onnx\n"
    assert cache.tree_digest(files) == "sha256:" + hashlib.sha256(lines.encode()).hexdigest()
    assert cache.model_file(pathlib.Path("."), sorted(files)) == "model.onnx"
    with pytest.raises(errors.SourceNotFound, match="2 model files"):
        cache.model_file(pathlib.Path("."), ["a.onnx", "b.onnx", "c.bin"])


@pytest.mark.parametrize(("text", "scheme", "host", "path", "ref"), [
    ("s3://bucket/models/m.onnx", "s3", "bucket", "models/m.onnx", ""),
    ("oci://localhost:5000/models/resnet:v2", "oci", "localhost:5000", "models/resnet", "v2"),
    ("oci://reg.io/m@sha256:" + "c" * 64, "oci", "reg.io", "m", "sha256:" + "c" * 64),
    ("oci://reg.io/m", "oci", "reg.io", "m", "latest"),
    ("https://h:8443/a/m.onnx", "https", "h:8443", "/a/m.onnx", ""),
    ("/srv/m.onnx", "file", "", "/srv/m.onnx", "")])
def test_sources_parse(text: str, scheme: str, host: str, path: str, ref: str) -> None:
    source = uri.parse(text)
    assert (source.scheme, source.host, source.path, source.ref) == (scheme, host, path, ref)


def test_a_cached_copy_is_handed_out_without_the_store_only_to_the_credentials_that_fetched_it(
        tmp_path: pathlib.Path) -> None:
    data = b"private" * 500
    store = MemoryStore({"s3://b/m.onnx": data})
    c = make(tmp_path, store)
    c.resolve("s3://b/m.onnx", sha(data), secret="team-a/store")
    assert c.lookup("s3://b/m.onnx", sha(data), "team-a/store") is not None
    assert c.lookup("s3://b/m.onnx", sha(data), "team-b/other") is None
    store.denied = True  # the store refuses team b: the cached copy does not get around that
    with pytest.raises(errors.SourceDenied):
        c.resolve("s3://b/m.onnx", sha(data), secret="team-b/other")
    store.denied = False
    reads = len(store.reads)
    shared = c.resolve("s3://b/m.onnx", "", secret="team-b/other")  # allowed: the same bytes, not fetched again
    assert shared.hit and shared.digest == sha(data) and len(store.reads) == reads


def test_volga_status_shows_where_a_models_bytes_came_from_and_how_a_fetch_goes() -> None:
    from volga_agent.app import status as status_view

    def emi(name: str, source: dict) -> dict:
        return {"metadata": {"name": name}, "spec": {"modelId": "m", "node": "n"},
                "status": {"tier": "COLD", "source": source}}

    digest = "sha256:" + "d" * 64
    [model] = status_view.from_objects([], [
        emi("m-0", {"uri": "s3://b/m.onnx", "digest": digest, "bytes": 10}),
        emi("m-1", {"uri": "s3://b/m.onnx", "fetching": True, "bytes": 1 << 20, "totalBytes": 4 << 20,
                    "rateBytesPerSec": 2.5e6})])
    lines = status_view.table([model]).splitlines()
    assert f"m-0 (m, COLD): bytes from s3://b/m.onnx, {digest}" in lines
    assert "m-1 (m, COLD): fetching s3://b/m.onnx: 1.0 MiB of 4.0 MiB at 2.5 MB/s" in lines
    assert model.to_json()["instanceList"][0]["source"] == f"bytes from s3://b/m.onnx, {digest}"


def test_a_shared_image_key_carries_the_model_digest() -> None:
    from volga_agent.snapshot import shared

    facts = shared.NodeFacts("criu 4.1", cpu_flags="sse4_2")
    plain = facts.key("m", "1", "abc", "onnx", False)
    a = facts.key("m", "1", "abc", "onnx", False, model_digest="sha256:" + "a" * 64)
    b = facts.key("m", "1", "abc", "onnx", False, model_digest="sha256:" + "b" * 64)
    assert len({plain.digest, a.digest, b.digest}) == 3  # other bytes: another image
    assert plain.digest == facts.key("m", "1", "abc", "onnx", False, model_digest="").digest


def test_a_node_file_pinned_by_a_digest_it_does_not_have_is_refused(tmp_path: pathlib.Path) -> None:
    import yaml

    from volga_agent import cli
    from volga_agent.app import defaultmodel

    model = defaultmodel.ensure().spec.source_path
    doc = defaultmodel.spec_document(model)
    doc["spec"]["sourceDigest"] = "sha256:" + "0" * 64  # type: ignore[index]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(doc))
    loaded = cli.load_specs([str(tmp_path / "bad.yaml")])
    assert not loaded.labelled
    [(field, reason)] = loaded.refused[0].error.problems
    assert field == "spec.source" and "spec.sourceDigest is sha256:000" in reason and "refused" in reason
    doc["spec"]["sourceDigest"] = sha(model.read_bytes())  # type: ignore[index]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(doc))
    assert cli.load_specs([str(tmp_path / "bad.yaml")]).labelled


def test_two_processes_share_a_cache_and_neither_evicts_what_the_other_may_use(tmp_path: pathlib.Path) -> None:
    store = MemoryStore({f"s3://b/{n}.onnx": bytes([n]) * 4000 for n in range(3)})
    first = make(tmp_path, store, budget=9000)
    zero = first.resolve("s3://b/0.onnx")
    second = make(tmp_path, store, budget=9000)  # another process's cache on the same folder (its own lock)
    one = second.resolve("s3://b/1.onnx")
    assert set(first.entries()) == set(second.entries()) == {zero.digest, one.digest}  # the index is merged
    assert second.lookup("s3://b/0.onnx") is not None
    with pytest.raises(errors.CacheFull, match="another process uses the cache"):
        first.resolve("s3://b/2.onnx")  # 12000 > 9000, but the other process may be serving 0 or 1
    assert zero.path.exists() and one.path.exists()
    second.close()
    assert first.resolve("s3://b/2.onnx").path.exists() and first.evictions == 1  # alone now: the LRU one goes


def test_an_empty_file_in_a_folder_is_fetched_without_a_range(tmp_path: pathlib.Path) -> None:
    def never(start: int, end: int) -> Iterator[bytes]:
        raise AssertionError("no range is asked for")

    assert download.fetch(never, 0, tmp_path / "e.part", "v") == hashlib.sha256(b"").hexdigest()
    assert (tmp_path / "e.part").read_bytes() == b""


def test_a_node_folder_pinned_by_its_digest_is_checked_as_a_fetched_one_would_be(tmp_path: pathlib.Path) -> None:
    """A model server's folder on the node with spec.sourceDigest: the digest of its files as a fetched folder's."""
    (tmp_path / "app" / "src").mkdir(parents=True)
    (tmp_path / "app" / "src" / "app.py").write_text("print('serving')\n")
    (tmp_path / "app" / "README").write_text("a server\n")
    digest = cache.tree_digest({"src/app.py": hashlib.sha256(b"print('serving')\n").hexdigest(),
                                "README": hashlib.sha256(b"a server\n").hexdigest()})
    cache.verify_local(tmp_path / "app", digest)
    (tmp_path / "app" / "README").write_text("changed\n")
    with pytest.raises(errors.SourceMismatch, match=r"spec\.sourceDigest is sha256:"):
        cache.verify_local(tmp_path / "app", digest)
    with pytest.raises(errors.SourceNotFound, match="No such file"):
        cache.verify_local(tmp_path / "gone", digest)
