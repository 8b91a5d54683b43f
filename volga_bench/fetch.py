"""`volga bench fetch`: a model's cold start from an S3-compatible store beside the same model from a local file,
and the model cache's download rate beside the store's own client (boto3's download_file, s3transfer's threads)
on the same object, in one run (alternated rounds, medians reported).

The store is versitygw (`make setup` builds it, scripts/install-stores.sh) on loopback; the model is an ONNX
MatMul whose weight is one initializer of `size_mib` MiB. Cold start: fetch (for the remote one) + onnxruntime
session + first answer. Rates are over the object's bytes, in MB/s (10^6 bytes); the cache's includes hashing
the bytes it verifies. Each round also gives the ratio of the two rates (cache / boto3, measured back to back, so
that a burst of other work on the machine weighs on one round's pair rather than on one side) and the CPU seconds
this process spent on each download (both run in it; the store's are not counted): on a machine whose cores the
store and other work share, the CPU a download needs is what its rate depends on, and varies far less than the rate.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from volga_agent.sources import cache, download

STORES = pathlib.Path(os.environ.get("VOLGA_STORES", pathlib.Path.home() / ".cache/volga/stores"))
ACCESS, SECRET = "volga-bench-access", "volga-bench-secret"


def _model(path: pathlib.Path, size_mib: int) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    side = int((size_mib * (1 << 20) / 4) ** 0.5)
    weight = np.random.default_rng(0).standard_normal((side, side), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "fetch",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, side])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, side])], [numpy_helper.from_array(weight, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def _first_answer(path: pathlib.Path) -> None:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    side = session.get_inputs()[0].shape[1]
    session.run(None, {"x": np.ones((1, side), dtype=np.float32)})


def _drop_page_cache(path: pathlib.Path) -> None:
    """Keep the local file's pages from counting as a download: advise the kernel to drop them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run(size_mib: int = 1024, connections: int = 10, rounds: int = 3,
        progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    import boto3

    server = STORES / "bin" / "versitygw"
    if not server.exists():
        raise FileNotFoundError(f"{server}: not installed (make setup runs scripts/install-stores.sh)")
    with tempfile.TemporaryDirectory(prefix="volga-bench-fetch-") as tmp:
        root = pathlib.Path(tmp)
        (root / "s3").mkdir()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([str(server), "--access", ACCESS, "--secret", SECRET, "--quiet", "--port",
                                 f"127.0.0.1:{port}", "posix", str(root / "s3")], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("versitygw did not start")
                time.sleep(0.2)
            endpoint = f"http://127.0.0.1:{port}"
            client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS,
                                  aws_secret_access_key=SECRET, region_name="us-east-1")
            client.create_bucket(Bucket="models")
            model = root / "model.onnx"
            progress(f"building a {size_mib} MiB ONNX model")
            _model(model, size_mib)
            size = model.stat().st_size
            progress("uploading it with boto3")
            client.upload_file(str(model), "models", "model.onnx")
            credentials = {"AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": endpoint}

            client_times, cache_times, client_cpu, cache_cpu = [], [], [], []
            for n in range(rounds):  # alternated, so that the other work on the machine weighs on both alike
                progress(f"round {n + 1}/{rounds}: boto3 download_file (the store's own client)")
                started, cpu = time.perf_counter(), time.process_time()
                client.download_file("models", "model.onnx", str(root / "client.onnx"))
                client_times.append(time.perf_counter() - started)
                client_cpu.append(time.process_time() - cpu)
                (root / "client.onnx").unlink()
                progress(f"round {n + 1}/{rounds}: the model cache's fetch")
                started, cpu = time.perf_counter(), time.process_time()
                got = cache.Cache(root / "cache-rate", connections=connections).resolve(
                    "s3://models/model.onnx", "", credentials)
                cache_times.append(time.perf_counter() - started)
                cache_cpu.append(time.process_time() - cpu)
                shutil.rmtree(root / "cache-rate")
            client_s, cache_s = statistics.median(client_times), statistics.median(cache_times)

            progress("cold start from the local file")
            _drop_page_cache(model)
            started = time.perf_counter()
            _first_answer(model)
            local_ms = (time.perf_counter() - started) * 1000

            progress("cold start from S3 (fetch + load + first answer)")
            started = time.perf_counter()
            remote = cache.Cache(root / "cache-cold", connections=connections).resolve(
                "s3://models/model.onnx", got.digest, credentials)
            _first_answer(remote.path)
            remote_ms = (time.perf_counter() - started) * 1000
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    return {"bytes": size, "connections": connections, "digest": got.digest,
            "remote_cold_start_ms": round(remote_ms, 1), "local_cold_start_ms": round(local_ms, 1),
            "cache_rate_mbps": round(size / cache_s / 1e6, 1), "client_rate_mbps": round(size / client_s / 1e6, 1),
            "cache_seconds": round(cache_s, 3), "client_seconds": round(client_s, 3), "rounds": rounds,
            "cache_rates_mbps": [round(size / t / 1e6, 1) for t in cache_times],
            "client_rates_mbps": [round(size / t / 1e6, 1) for t in client_times],
            "cache_over_client": [round(c / t, 3) for c, t in zip(client_times, cache_times, strict=True)],
            "cache_over_client_median": round(statistics.median(c / t for c, t in zip(client_times, cache_times,
                                                                                      strict=True)), 3),
            "cache_cpu_seconds": [round(x, 2) for x in cache_cpu],
            "client_cpu_seconds": [round(x, 2) for x in client_cpu],
            "chunk_bytes": download.CHUNK_BYTES, "load_average": [round(x, 2) for x in os.getloadavg()],
            "store": "versitygw (posix, loopback)", "client": "boto3 download_file (s3transfer defaults)",
            "cpus": os.cpu_count()}


def format_table(report: dict[str, Any]) -> str:
    return "\n".join([
        f"object: {report['bytes']} bytes ({report['store']})",
        f"  model cache fetch (verified) : {report['cache_rate_mbps']:8.1f} MB/s  ({report['cache_seconds']} s)",
        f"  {report['client']:29}: {report['client_rate_mbps']:8.1f} MB/s  ({report['client_seconds']} s)",
        f"  cache / client per round     : {', '.join(f'{r:.2f}' for r in report['cache_over_client'])} (median "
        f"{report['cache_over_client_median']:.2f})",
        f"  CPU s per download           : cache {statistics.median(report['cache_cpu_seconds']):.2f}, client "
        f"{statistics.median(report['client_cpu_seconds']):.2f} (medians; this process only)",
        f"  cold start from S3           : {report['remote_cold_start_ms']:8.1f} ms (fetch + load + first answer)",
        f"  cold start from a local file : {report['local_cold_start_ms']:8.1f} ms"])
