"""What a peer of a real worker's socket can make it do: map only the segment the worker named for that connection,
and move the worker only when it is the agent's user (docs/security.md)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import mmap
import os
import pathlib

import numpy as np
import pytest

from volga_agent.gateway import workers
from volga_agent.node import instance
from volga_agent.worker import contract, protocol, serve

SIZE = 1 << 20
GATEWAY_UID = 65532  # the chart's gateway user


def digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def refused(client: protocol.WorkerClient, code: str, **fields: object) -> str:
    with pytest.raises(protocol.WorkerError) as err:
        client.call("attach_shm", **fields)
    assert err.value.code == code, err.value
    return err.value.message


def segment(path: pathlib.Path, size: int = SIZE) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # As the gateway does: the worker runs as its own user, which reaches the segment through its group.
        assert workers.share(fd, {"uid": contract.NOBODY[0], "gid": contract.NOBODY[1]})
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def shm_infer(client: protocol.WorkerClient, mapped: mmap.mmap, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    meta = protocol.write_shm_tensors(inputs, mapped, 0)
    reply = client.call("infer", tensors=meta, shm=True, out_offset=SIZE // 2)
    return {k: v.copy() for k, v in protocol.unpack_shm_tensors(reply.header["tensors"], mapped).items()}


def test_a_peer_maps_only_the_segment_named_for_its_connection(hot: instance.Instance, tmp_path: pathlib.Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me" * 1000)
    passwd = pathlib.Path("/etc/passwd")
    before = {victim: digest(victim), passwd: digest(passwd)}
    x = contract.sample_inputs(hot.config.inputs, batch=2, seed=3)
    expected = hot.infer(x)["probability"]
    made: list[pathlib.Path] = []
    with protocol.WorkerClient(hot.config.socket) as a, protocol.WorkerClient(hot.config.socket) as b:
        try:
            # Names the worker did not give this connection: any file, and /etc/passwd.
            for path in (victim, passwd):
                assert "is not the segment this connection was given" in refused(a, "PERMISSION_DENIED",
                                                                                 path=str(path), size=4096)
            # The named path as a symlink to another file: not followed.
            offered = pathlib.Path(a.call("shm_token", owner=os.getpid()).header["path"])
            assert offered.parent == serve.SHM_DIR and offered.name.startswith(f"{serve.SHM_PREFIX}{os.getpid()}-")
            offered.symlink_to(victim)
            made.append(offered)
            refused(a, "INVALID_ARGUMENT", path=str(offered), size=4096)
            # An offer is good for one attach: the same name again is refused.
            offered.unlink()
            segment(offered).close()
            assert "is not the segment" in refused(a, "PERMISSION_DENIED", path=str(offered), size=4096)
            # A folder, and a file smaller than the size asked for.
            offered = pathlib.Path(a.call("shm_token", owner=os.getpid()).header["path"])
            offered.mkdir()
            made.append(offered)
            assert "Is a directory" in refused(a, "INVALID_ARGUMENT", path=str(offered), size=4096)
            offered = pathlib.Path(a.call("shm_token", owner=os.getpid()).header["path"])
            offered.write_bytes(b"x" * 10)
            made.append(offered)
            assert "not a regular file of 4096 bytes" in refused(a, "PERMISSION_DENIED", path=str(offered), size=4096)
            # A file owned by another user than the peer's.
            offered = pathlib.Path(a.call("shm_token", owner=os.getpid()).header["path"])
            segment(offered).close()
            made.append(offered)
            os.chown(offered, GATEWAY_UID, GATEWAY_UID)
            assert "owned by the peer (uid 0)" in refused(a, "PERMISSION_DENIED", path=str(offered), size=SIZE)

            # The segment named for A works for A.
            mine = pathlib.Path(a.call("shm_token", owner=os.getpid()).header["path"])
            mapped = segment(mine)
            made.append(mine)
            assert a.call("attach_shm", path=str(mine), size=SIZE).header["size"] == SIZE
            assert np.array_equal(shm_infer(a, mapped, x)["probability"], expected)
            contents = bytes(mapped)
            # B names A's segment: refused, and B has no segment, so its shared-memory request fails.
            b.call("shm_token", owner=os.getpid())
            assert "is not the segment" in refused(b, "PERMISSION_DENIED", path=str(mine), size=SIZE)
            with pytest.raises(protocol.WorkerError, match="no shared memory attached"):
                b.call("infer", tensors=protocol.write_shm_tensors(x, bytearray(SIZE), 0), shm=True,
                       out_offset=SIZE // 2)
            assert bytes(mapped) == contents  # nothing written into A's segment
            mapped.close()
        finally:
            for path in made:
                if path.is_dir() and not path.is_symlink():
                    path.rmdir()
                else:
                    path.unlink(missing_ok=True)
    assert {path: digest(path) for path in before} == before
    assert np.array_equal(hot.infer(x)["probability"], expected)


def as_gateway_user(socket_path: str, ops: list[str]) -> dict[str, str]:
    """Each op sent by a process of the gateway's user: 'ok' or the refusal's code."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(GATEWAY_UID)
            os.setuid(GATEWAY_UID)
            answers = {}
            with protocol.WorkerClient(socket_path) as client:
                for op in ops:
                    try:
                        client.call(op, tier="WARM")
                        answers[op] = "ok"
                    except protocol.WorkerError as exc:
                        answers[op] = exc.code
            os.write(write, json.dumps(answers).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        answers: dict[str, str] = json.loads(pipe.read() or "{}")
    os.waitpid(pid, 0)
    return answers


def test_only_the_agents_user_moves_the_worker(hot: instance.Instance) -> None:
    if os.geteuid() != 0:
        pytest.fail("needs root (as CI runs) to connect as the gateway's user", pytrace=False)
    folder = pathlib.Path(hot.config.socket).parent
    os.chmod(folder, 0o755)
    os.chmod(hot.config.socket, 0o666)
    answers = as_gateway_user(hot.config.socket, ["ping", "metadata", "sleep", "offload", "swap", "prepare_checkpoint"])
    assert answers == {"ping": "ok", "metadata": "ok", "sleep": "PERMISSION_DENIED", "offload": "PERMISSION_DENIED",
                       "swap": "PERMISSION_DENIED", "prepare_checkpoint": "PERMISSION_DENIED"}
    # The worker did not go to sleep or pause: it serves, and the agent's user still moves it.
    x = contract.sample_inputs(hot.config.inputs, batch=1)
    assert hot.infer(x)["probability"].shape == (1, 1)
    assert hot.client().call("sleep", tier="WARM").header["ok"] is True
    with pytest.raises(protocol.NotRun):
        hot.infer(x)
    hot.client().call("wake")


def test_the_gateway_attaches_a_worker_named_segment(hot: instance.Instance) -> None:
    async def attach() -> None:
        conn = await workers.Connection.open(hot.config.socket, SIZE)
        try:
            assert conn.segment is not None and len(conn.segment) == SIZE
            assert not list(workers.SHM_DIR.glob(f"{workers.SHM_PREFIX}{os.getpid()}-*"))  # unlinked once mapped
            x = contract.sample_inputs(hot.config.inputs, batch=2, seed=5)
            clients = workers.WorkerClients(SIZE)
            outputs = await clients._on(conn, [], x)
            assert np.array_equal(outputs["probability"], hot.infer(x)["probability"])
        finally:
            conn.close()

    asyncio.run(attach())
