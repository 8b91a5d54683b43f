"""The images as built by `make images` (scripts/build-images.sh), run as their pods run them.

- The operator image's entrypoint, as the chart's UID 10001, reconciles a ModelSpec on a real API server.
- Each flavour of the agent image's agent (root, as the chart's privileged container) freezes a worker of the
  default model with the CRIU inside the image and restores it on a request; its gateway, as the chart's UID 65532
  in the pod's shared group, answers an unmodified tritonclient with the model's own answer. The GPU flavour does
  so on the CPU here (no GPU and no driver), as on a node without one.
- The GPU flavour's CUDA libraries (NVIDIA's wheels) are complete and there once: PyTorch and onnxruntime's CUDA
  provider resolve every library they link inside the image except the driver's libcuda.so.1, which the NVIDIA
  container toolkit brings from the node. `make images` skips the GPU flavour when the disk is too small for its
  build; these tests then skip with the reason it wrote.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from images import Rootfs, have_buildah, image_exists
from procs import wait_for
from prometheus_client import parser as prom_parser

from volga_agent.app import defaultmodel
from volga_agent.node import instance
from volga_agent.worker import contract
from volga_bench.controlplane import ControlPlane, free_ports

pytest_plugins = ["k8s_fixtures"]
pytestmark = pytest.mark.slow
OPERATOR = "localhost/volga-operator:dev"
AGENT_CPU = "localhost/volga-agent:dev-cpu"
AGENT_GPU = "localhost/volga-agent:dev-gpu"
# Where scripts/build-images.sh writes why it did not build the GPU flavour (VOLGA_IMAGES_STATE there).
GPU_SKIPPED = pathlib.Path(os.environ.get("VOLGA_IMAGES_STATE", pathlib.Path.home() / ".cache/volga/images"),
                           "volga-agent-dev-gpu.skipped")
GATEWAY_UID = 65532  # charts/volga/values.yaml: gateway.securityContext.runAsUser and gateway.podFsGroup


@pytest.fixture(scope="module", autouse=True)
def images_built() -> None:
    if not have_buildah():
        pytest.fail("buildah is missing: run `make images` (scripts/build-images.sh)", pytrace=False)
    for image in (OPERATOR, AGENT_CPU):
        if not image_exists(image):
            pytest.fail(f"{image} is not built: run `make images`", pytrace=False)


@pytest.fixture
def rootfs(request: pytest.FixtureRequest) -> Iterator[Rootfs]:
    if request.param == AGENT_GPU and not image_exists(AGENT_GPU):
        if GPU_SKIPPED.exists():
            pytest.skip(f"make images did not build {AGENT_GPU}: {GPU_SKIPPED.read_text().strip()}")
        pytest.fail(f"{AGENT_GPU} is not built: run `make images`", pytrace=False)
    fs = Rootfs(request.param)
    try:
        yield fs
    finally:
        fs.close()


def stop(proc: subprocess.Popen[str], timeout: float = 60.0) -> int:
    """SIGTERM the command inside (the child of `unshare --fork`) and wait for it, as the kubelet stops a pod."""
    children = [int(c) for task in pathlib.Path(f"/proc/{proc.pid}/task").iterdir()
                for c in (task / "children").read_text().split()] if proc.poll() is None else []
    for child in children:
        os.kill(child, signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


@pytest.mark.parametrize("rootfs", [OPERATOR], indirect=True)
def test_operator_image_reconciles_a_modelspec(rootfs: Rootfs, control_plane: ControlPlane, crds: None,
                                               tmp_path: pathlib.Path) -> None:
    assert rootfs.user == "10001:10001"
    kube = tmp_path / "kube"
    kube.mkdir()
    shutil.copy(control_plane.kubeconfig, kube / "config")
    (kube / "config").chmod(0o644)
    log = (tmp_path / "operator.log").open("w")
    proc = rootfs.popen(["volga-operator", "--liveness", "", "-v"], binds={kube: "/etc/volga-kube"},
                        env={"KUBECONFIG": "/etc/volga-kube/config"}, stdout=log, stderr=subprocess.STDOUT)
    try:
        spec = {"apiVersion": "volga.dev/v1alpha1", "kind": "ModelSpec",
                "metadata": {"name": "needs-h200", "namespace": "default"},
                "spec": {"modelId": "needs-h200", "framework": "onnx", "source": "file:///models/m.onnx",
                         "inputs": [{"name": "features", "dtype": "FP32", "shape": [-1, 4]}],
                         "outputs": [{"name": "score", "dtype": "FP32", "shape": [-1, 1]}],
                         "hardware": {"gpu": True, "gpuProduct": "NVIDIA H200"}, "pool": {"frozen": 1}}}
        path = tmp_path / "ms.yaml"
        path.write_text(yaml.safe_dump(spec))
        applied = control_plane.kubectl("apply", "-f", str(path), check=False)
        assert applied.returncode == 0, applied.stderr

        def unschedulable() -> dict[str, Any] | None:
            out = control_plane.kubectl("get", "ms", "needs-h200", "-o", "yaml").stdout
            ms = yaml.safe_load(out)
            conditions = ms.get("status", {}).get("conditions", ())
            return ms if any(c["type"] == "Ready" and c.get("reason") == "Unschedulable" for c in conditions) else None

        ms = wait_for("the operator's Unschedulable condition", unschedulable, every=0.2, proc=proc)
        assert ms["status"]["observedGeneration"] == ms["metadata"]["generation"]
        assert not ms["metadata"].get("finalizers")  # its EMIs go with it (ownerReferences and the operator)
        control_plane.kubectl("delete", "ms", "needs-h200", "--timeout=60s")
    finally:
        stop(proc)
        log.close()


@pytest.mark.parametrize("rootfs", [AGENT_CPU, AGENT_GPU], indirect=True)
def test_agent_image_freezes_restores_and_serves(rootfs: Rootfs, tmp_path: pathlib.Path) -> None:
    assert (rootfs.root / "opt/criu/bin/criu").exists()
    model = defaultmodel.ensure()
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(model.spec.source_path, models / "model.onnx")
    document = defaultmodel.spec_document(pathlib.Path("/models/model.onnx"))
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "ctr.yaml").write_text(yaml.safe_dump(document))
    # The pod's shared workdir: owned by the gateway's group, setgid, as the kubelet makes an fsGroup emptyDir.
    work = pathlib.Path(tempfile.mkdtemp(prefix="vimg-", dir="/tmp"))
    os.chown(work, 0, GATEWAY_UID)
    work.chmod(0o2770)
    snapshots = f"/dev/shm/{work.name}"
    agent_port, agent_metrics, http, grpc, gw_metrics = free_ports(5)
    binds = {models: "/models", specs: "/specs", work: "/run/volga"}
    agent_log, gateway_log = (tmp_path / "agent.log").open("w"), (tmp_path / "gateway.log").open("w")
    agent = rootfs.popen(["volga-agent", "-f", "/specs/ctr.yaml", "--node", "image-test", "--host", "127.0.0.1",
                          "--port", str(agent_port), "--metrics-port", str(agent_metrics), "--workdir", "/run/volga",
                          "--snapshot-dir", snapshots], user="0:0", umask="0007", binds=binds,
                         stdout=agent_log, stderr=subprocess.STDOUT)
    gateway = rootfs.popen(["volga-gateway", "-f", "/specs/ctr.yaml", "--agent", f"127.0.0.1:{agent_port}",
                            "--host", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc),
                            "--metrics-port", str(gw_metrics)], user=f"{GATEWAY_UID}:{GATEWAY_UID}",
                           groups=str(GATEWAY_UID), binds=binds, stdout=gateway_log, stderr=subprocess.STDOUT)
    try:
        def agent_metric(name: str, **labels: str) -> float:
            text = urllib.request.urlopen(f"http://127.0.0.1:{agent_metrics}/metrics", timeout=5).read().decode()
            return sum(sample.value for family in prom_parser.text_string_to_metric_families(text)
                       for sample in family.samples
                       if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))

        # The pool floor is one FROZEN instance: a cold start, then a CRIU dump inside the image.
        wait_for("a FROZEN instance", lambda: agent_metric("volga_emis_active_total", tier="FROZEN") == 1,
                 timeout=180, every=0.2, proc=agent)
        decls = instance.decls(model.spec.inputs)
        x = contract.sample_inputs(decls, batch=4, seed=21)
        inputs = []
        for decl in decls:
            tensor = grpcclient.InferInput(decl.name, list(x[decl.name].shape), decl.dtype)
            tensor.set_data_from_numpy(x[decl.name])
            inputs.append(tensor)
        client = wait_for("the gateway", lambda: _client(grpc), every=0.2, proc=gateway)
        try:
            answer = client.infer(model.spec.model_id, inputs, client_timeout=120).as_numpy("probability")
        finally:
            client.close()
        import onnxruntime

        session = onnxruntime.InferenceSession(str(model.spec.source_path), providers=["CPUExecutionProvider"])
        assert np.array_equal(answer, session.run(["probability"], x)[0])
        # The answer came from a CRIU restore inside the image, not a cold start.
        assert agent_metric("volga_snapshot_restore_latency_ms_count", tier="FROZEN") >= 1
        assert agent_metric("volga_snapshot_restore_failures_total") == 0
        assert stop(gateway) == 0
        assert stop(agent) == 0
    except BaseException:
        for name in ("agent.log", "gateway.log"):  # shown with the failure (pytest prints what a test printed)
            print(f"--- {name} (last 4000 characters)\n{(tmp_path / name).read_text(errors='replace')[-4000:]}")
        raise
    finally:
        for proc in (gateway, agent):
            if proc.poll() is None:
                stop(proc)
        agent_log.close()
        gateway_log.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(snapshots, ignore_errors=True)


# Libraries in the GPU image's wheels that nothing links and that need what the image does not have.
OPTIONAL_LIBS = {
    "libonnxruntime_providers_tensorrt.so": "onnxruntime's TensorRT provider: TensorRT is not in the image",
    "libcufile_rdma.so.1": "cuFile's GPUDirect Storage RDMA plugin: needs the node's rdma-core (libibverbs)",
    "libgfortran.so.5": "bundled in torch/lib, linked by none of PyTorch's libraries (needs libquadmath)",
}
# In the GPU image: what PyTorch and onnxruntime were built for, and for each shared library of onnxruntime, of
# PyTorch and of the nvidia-* wheels what ldd cannot resolve; each one ldd resolves completely is then loaded.
GPU_PROBE = r"""
import ctypes, glob, json, os, subprocess, sys
import onnxruntime, torch
import onnxruntime.capi.build_and_package_info as ort_build
from volga_agent.snapshot import shared

site = os.path.dirname(os.path.dirname(torch.__file__))
optional = set(sys.argv[1:])
libs = sorted({*glob.glob(f"{site}/onnxruntime/capi/*.so"), *glob.glob(f"{site}/torch/lib/*.so*"),
               *glob.glob(f"{site}/torch/_C*.so"), *glob.glob(f"{site}/nvidia/**/lib*.so*", recursive=True)})
missing, loaded = {}, []
for lib in libs:
    out = subprocess.run(["ldd", lib], capture_output=True, text=True, check=True).stdout
    missing[lib] = sorted(line.split()[0] for line in out.splitlines() if "not found" in line)
    if not missing[lib] and os.path.basename(lib) not in optional:
        ctypes.CDLL(lib)
        loaded.append(lib)
json.dump({"torch": torch.__version__, "torch_cuda": torch.version.cuda, "ort_cuda": ort_build.cuda_version,
           "providers": onnxruntime.get_available_providers(), "runtime": shared.runtime_version("onnx"),
           "missing": missing, "loaded": loaded}, sys.stdout)
"""


@pytest.mark.parametrize("rootfs", [AGENT_GPU], indirect=True)
def test_gpu_image_cuda_libraries_resolve_without_the_driver(rootfs: Rootfs) -> None:
    proc = rootfs.run(["python", "-c", GPU_PROBE, *OPTIONAL_LIBS], timeout=600)
    assert proc.returncode == 0, proc.stdout
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    assert probe["torch_cuda"].split(".")[0] == probe["ort_cuda"].split(".")[0] == "13", probe
    assert "CUDAExecutionProvider" in probe["providers"]
    # The shared-snapshot key names the onnxruntime that is installed (onnxruntime-gpu here).
    assert probe["runtime"].startswith("onnxruntime-gpu 1."), probe["runtime"]
    site = "/opt/volga/lib/python3.11/site-packages"
    for lib in (f"{site}/onnxruntime/capi/libonnxruntime_providers_cuda.so", f"{site}/torch/lib/libtorch_cuda.so",
                f"{site}/torch/lib/libc10_cuda.so"):
        assert lib in probe["missing"], f"{lib} is not in the image"
    unresolved = {lib: names for lib, names in probe["missing"].items()
                  if set(names) - {"libcuda.so.1"} and pathlib.PurePath(lib).name not in OPTIONAL_LIBS}
    assert not unresolved, f"libraries missing from the image: {unresolved}"
    # onnxruntime's CUDA provider links the driver itself; all else it links is in the image.
    assert probe["missing"][f"{site}/onnxruntime/capi/libonnxruntime_providers_cuda.so"] == ["libcuda.so.1"]
    # Loaded in the image: the runtime libraries, which load the driver only on first use.
    for lib in ("nvidia/cu13/lib/libcudart.so.13", "nvidia/cudnn/lib/libcudnn.so.9", "nvidia/cu13/lib/libcublas.so.13",
                "torch/lib/libc10_cuda.so"):
        assert f"{site}/{lib}" in probe["loaded"], f"{lib} did not load"
    # One copy of each CUDA library (PyTorch and onnxruntime share the wheels), and never the driver's.
    copies: dict[str, list[str]] = {}
    for path in rootfs.root.rglob("lib*.so*"):
        if path.is_file() and not path.is_symlink():
            copies.setdefault(path.name, []).append(str(path.relative_to(rootfs.root)))
    for name in ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcudnn.so.9", "libcufft.so.12",
                 "libcurand.so.10", "libnvrtc.so.13"):
        assert len(copies.get(name, [])) == 1, f"{name}: {copies.get(name)}"
    assert not [n for n in copies if n.startswith(("libcuda.so", "libnvidia-ml.so"))], "the driver is in the image"


def _client(grpc_port: int) -> grpcclient.InferenceServerClient | None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        if client.is_server_ready():
            return client
    except Exception:  # not listening yet
        pass
    client.close()
    return None
