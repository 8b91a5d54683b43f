"""Several gateway processes on one node's ports (`volga up --gateway-processes`, `volga-gateway --processes`):
connections spread over them, every one answers correctly, one that dies comes back, they end with the first. And
several HOT instances of one model (pool.hot 2 on one node): the gateway spreads requests over their workers."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from procs import wait_for
from prometheus_client.parser import text_string_to_metric_families

from volga_agent.app import defaultmodel
from volga_agent.host import process
from volga_agent.node import instance
from volga_agent.rpc.volga.v1 import agent_pb2, agent_pb2_grpc
from volga_agent.worker import contract, protocol
from volga_bench import harness

pytestmark = pytest.mark.slow
CONNECTIONS = 24  # all on one of two processes by chance: 2 in 2**24
SIDECAR = [sys.executable, "-c",
           "import sys; from volga_agent.app.daemons import gateway_main; sys.exit(gateway_main())"]


def answered(metrics_url: str, protocol: str) -> float:
    """Requests the gateway process behind `metrics_url` answered OK over `protocol`."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "volga_gateway_requests_total" and sample.labels.get("code") == "OK"
               and sample.labels.get("protocol") == protocol)


def gone(pid: int) -> bool:
    """Whether the process has exited with all its threads: reaped, or a zombie left alone in its thread group. (A
    zombie group leader is not enough while its other threads still exit: the listening sockets stay open,
    unattended, until the last one is gone.)"""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        return state == "Z" and len(os.listdir(f"/proc/{pid}/task")) == 1
    except OSError:
        return True


def gateway_processes(pid: int) -> dict[int, int]:
    """sibling index -> pid of the gateway processes `volga up` started."""
    found = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit() or process.parent(int(entry.name)) != pid:
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--sibling" in args:
            found[int(args[args.index(b"--sibling") + 1])] = int(entry.name)
    return found


def spread_requests(up: harness.UpProcess, reference: np.ndarray | None = None) -> np.ndarray:
    """One request on each of CONNECTIONS fresh gRPC connections and as many HTTP ones; every answer the same."""
    spec = defaultmodel.ensure().spec
    decls = instance.decls(spec.inputs)
    x = contract.sample_inputs(decls, batch=2, seed=7)
    for index in range(CONNECTIONS):
        # A subchannel pool of its own: a new TCP connection, not one shared with the other clients' channels.
        client = grpcclient.InferenceServerClient(up.endpoints["grpc"],
                                                  channel_args=[("grpc.use_local_subchannel_pool", 1)])
        out = client.infer(spec.model_id, harness.triton_inputs(decls, x, grpcclient),
                           client_timeout=60).as_numpy("probability")
        client.close()
        reference = out if reference is None else reference
        assert np.array_equal(out, reference), index
        web = httpclient.InferenceServerClient(up.endpoints["http"].removeprefix("http://"), concurrency=1)
        out = web.infer(spec.model_id, harness.triton_inputs(decls, x, httpclient)).as_numpy("probability")
        web.close()
        assert np.array_equal(out, reference), index
    assert reference is not None
    return reference


def test_two_gateway_processes_share_the_ports_and_both_answer() -> None:
    with harness.volga_up(["--gateway-processes", "2"]) as up:
        metrics = [up.endpoints["metrics"], up.endpoints["metrics1"]]
        reference = spread_requests(up)
        for protocol in ("grpc", "http"):
            counts = [answered(url, protocol) for url in metrics]
            assert sum(counts) == CONNECTIONS and min(counts) > 0, (protocol, counts)

        # Process 1 killed: process 0 answers every new connection meanwhile, and process 1 comes back on the same
        # ports (its metrics port too) within a few seconds.
        [(_, first)] = gateway_processes(up.proc.pid).items()
        os.kill(first, signal.SIGKILL)
        wait_for("gateway process 1 exits", lambda: gone(first), timeout=30, every=0.1)
        spread_requests(up, reference)
        wait_for("gateway process 1 started again",
                 lambda: gateway_processes(up.proc.pid).get(1) not in (None, first), timeout=30, every=0.1)
        again = gateway_processes(up.proc.pid)[1]
        wait_for("gateway process 1 serves its metrics again", lambda: _serves(up.endpoints["metrics1"]), timeout=30,
                 every=0.1)
        before = answered(up.endpoints["metrics1"], "grpc")
        spread_requests(up, reference)
        assert answered(up.endpoints["metrics1"], "grpc") > before

        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=60) == 0
    wait_for("gateway process 1 ends with volga up", lambda: gone(again), timeout=10, every=0.1)


def _serves(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5).read()
        return True
    except OSError:
        return False


def test_gateway_processes_die_with_the_first() -> None:
    with harness.volga_up(["--gateway-processes", "2"]) as up:
        [(_, other)] = gateway_processes(up.proc.pid).items()
        up.proc.kill()  # SIGKILL: no stop of its own, the kernel's parent-death signal only
        up.proc.wait(timeout=30)
        wait_for("gateway process 1 ends with a killed volga up", lambda: gone(other), timeout=15, every=0.1)


def test_a_sidecar_gateway_runs_as_several_processes(tmp_path: pathlib.Path) -> None:
    """`volga-gateway --processes 2` beside an agent (here `volga up`'s Agent API): both processes answer."""
    spec_file = tmp_path / "model.yaml"
    spec_file.write_text(yaml.safe_dump(defaultmodel.spec_document(defaultmodel.ensure().spec.source_path)))
    with harness.volga_up() as up:
        sidecar = subprocess.Popen([*SIDECAR, "--agent", up.endpoints["agent"], "-f", str(spec_file),
                                    "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--processes", "2"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert sidecar.stdout is not None
            lines: list[str] = []
            while not any("processes; the others' metrics on" in line for line in lines):
                line = sidecar.stdout.readline()
                assert line, "volga-gateway exited:\n" + "".join(lines[-30:])
                lines.append(line)
            first = next(re.search(r"HTTP (\S+), gRPC (\S+), metrics :(\d+)", line) for line in lines
                         if line.startswith("volga-gateway: HTTP"))
            assert first is not None
            [other] = re.findall(r":(\d+)", lines[-1])
            endpoints = {"http": f"http://{first.group(1)}", "grpc": first.group(2)}
            spread_requests(harness.UpProcess(up.proc, endpoints, []))
            counts = [answered(f"http://127.0.0.1:{port}/metrics", "grpc") for port in (first.group(3), other)]
            assert sum(counts) == CONNECTIONS and min(counts) > 0, counts
            sidecar.send_signal(signal.SIGTERM)
            assert sidecar.wait(timeout=30) == 0
        finally:
            if sidecar.poll() is None:
                sidecar.kill()


@pytest.mark.parametrize(("args", "message"), [
    (["up", "--gateway-processes", "0"], "--gateway-processes: 0: at least 1 gateway process"),
    (["up", "--gateway-processes", "2", "--autonomy"], "--gateway-processes: the autonomy loop of `volga up`"),
    (["up", "--gateway-processes", "2", "--agent-port", "-1"], "--gateway-processes: the other gateway processes"),
])
def test_volga_up_refuses_gateway_processes_it_cannot_run(args: list[str], message: str) -> None:
    out = subprocess.run([sys.executable, "-m", "volga_agent.cli", *args, "--http-port", "0", "--grpc-port", "0",
                          "--metrics-port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]


def test_volga_gateway_refuses_no_processes() -> None:
    out = subprocess.run([*SIDECAR, "-f", "x.yaml", "--processes", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--processes: 0: at least 1 gateway process" in out.stderr


def worker_requests(agent: str) -> dict[str, int]:
    """Requests each HOT worker of the default model has run, by instance, as the workers count them."""
    with grpc.insecure_channel(agent) as channel:
        reply = agent_pb2_grpc.AgentStub(channel).ListInstances(agent_pb2.ListInstancesRequest(), timeout=10)
    counts = {}
    for inst in reply.instances:
        if inst.tier == agent_pb2.Tier.Value("HOT"):
            with protocol.WorkerClient(inst.socket) as client:
                counts[inst.name] = int(client.call("stats").header["requests"])
    return counts


def steady(address: str, clients: int = 4, requests: int = 60) -> None:
    """`clients` threads, each on a connection of its own, `requests` requests each, every answer checked."""
    spec = defaultmodel.ensure().spec
    decls = instance.decls(spec.inputs)
    x = contract.sample_inputs(decls, batch=1, seed=3)
    answers: list[np.ndarray] = []

    def run() -> None:
        client = grpcclient.InferenceServerClient(address, channel_args=[("grpc.use_local_subchannel_pool", 1)])
        inputs = harness.triton_inputs(decls, x, grpcclient)
        for _ in range(requests):
            answers.append(client.infer(spec.model_id, inputs, client_timeout=60).as_numpy("probability"))
        client.close()

    threads = [threading.Thread(target=run) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == clients * requests and all(np.array_equal(a, answers[0]) for a in answers)


def test_requests_spread_over_a_models_hot_instances(tmp_path: pathlib.Path) -> None:
    """pool.hot: 2 on one node: the activation names both HOT instances, and the gateway sends each request to
    the one it has fewer requests at, in `volga up` (in-process link) and in a sidecar (the Agent API)."""
    doc = defaultmodel.spec_document(defaultmodel.ensure().spec.source_path)
    doc["spec"]["pool"] = {"hot": 2, "frozen": 0}
    spec_file = tmp_path / "hot2.yaml"
    spec_file.write_text(yaml.safe_dump(doc))
    with harness.volga_up(["-f", str(spec_file)]) as up:
        wait_for("two HOT instances", lambda: len(worker_requests(up.endpoints["agent"])) == 2, timeout=120,
                 every=0.1)
        before = worker_requests(up.endpoints["agent"])
        steady(up.endpoints["grpc"])
        after = worker_requests(up.endpoints["agent"])
        served = {name: after[name] - before[name] for name in after}
        assert sum(served.values()) >= 240 and min(served.values()) > 0, served

        sidecar = subprocess.Popen([*SIDECAR, "--agent", up.endpoints["agent"], "-f", str(spec_file),
                                    "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert sidecar.stdout is not None
            line = sidecar.stdout.readline()
            found = re.search(r"gRPC (\S+),", line)
            assert found, line + (sidecar.stdout.read() if sidecar.poll() is not None else "")
            steady(found.group(1))
            again = worker_requests(up.endpoints["agent"])
            served = {name: again[name] - after[name] for name in again}
            assert sum(served.values()) >= 240 and min(served.values()) > 0, served
        finally:
            sidecar.send_signal(signal.SIGTERM)
            sidecar.wait(timeout=30)
