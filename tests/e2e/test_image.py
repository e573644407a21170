"""The runtime image as `make images` builds it: what is inside, and `podman run` of it serving the built-in
default model as uid 10001 on a read-only root filesystem, as the operator's pods run it."""

from __future__ import annotations

import json
import subprocess
import time
import uuid

import pytest
from openai import OpenAI

pytestmark = pytest.mark.e2e

RUN = ["podman", "run", "--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]


def run_python(image: str, code: str) -> str:
    out = subprocess.run([*RUN, "--rm", "--entrypoint", "python", image, "-c", code], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_image_has_torch_cpu_prebuilt_kernels_and_no_compiler(runtime_image):
    facts = json.loads(run_python(runtime_image, """
import importlib.metadata as md, json, os, shutil, torch
from pagoda.ops import cpu_library
from pagoda import platform
print(json.dumps({
    "torch": torch.__version__, "cuda": torch.version.cuda, "uid": os.getuid(),
    "nvidia": sorted(d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].lower().startswith("nvidia")),
    "triton": any(d.metadata["Name"] == "triton" for d in md.distributions()),
    "compiler": shutil.which("c++") or shutil.which("g++"),
    "prebuilt": sorted(os.listdir(os.environ["PAGODA_PREBUILT_KERNELS"])),
    "level": platform.cpu_isa().level, "kernels": cpu_library.available()}))
"""))
    assert facts["torch"].endswith("+cpu") or (facts["cuda"] is None and not facts["nvidia"]), facts
    assert facts["cuda"] is None and facts["nvidia"] == [] and not facts["triton"], facts
    assert facts["uid"] == 10001 and facts["compiler"] is None, facts
    levels = {name.split("_")[2] for name in facts["prebuilt"]}
    assert {"avx2", "avx512", "avx512bf16"} <= levels, facts
    assert facts["kernels"] is True, facts  # this CPU's level, loaded with no compiler in the image


def test_podman_run_serves_the_default_model_read_only_and_drains_on_sigterm(runtime_image, tmp_path):
    name = f"pagoda-image-{uuid.uuid4().hex[:8]}"
    # the operator's pod: uid 10001, read-only root, /tmp and the kernel directory writable, no capabilities
    subprocess.run([*RUN, "-d", "--name", name, "--user", "10001:10001", "--read-only", "--read-only-tmpfs=false",
                    "--tmpfs", "/tmp:rw,mode=1777", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                    "-p", "127.0.0.1::8000", runtime_image], check=True, capture_output=True, timeout=120)
    try:
        port = subprocess.run(["podman", "port", name, "8000"], capture_output=True, text=True,
                              check=True).stdout.split(":")[-1].strip()
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        deadline = time.monotonic() + 300
        while True:
            try:
                models = client.models.list()
                break
            except Exception:
                state = subprocess.run(["podman", "inspect", "--format", "{{.State.Running}}", name],
                                       capture_output=True, text=True).stdout.strip()
                logs = subprocess.run(["podman", "logs", name], capture_output=True, text=True)
                assert state == "true", logs.stdout[-3000:] + logs.stderr[-3000:]
                assert time.monotonic() < deadline, "not serving after 300 s"
                time.sleep(1)
        model = models.data[0].id
        reply = client.chat.completions.create(model=model, temperature=0, max_tokens=16, messages=[
            {"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
        subprocess.run(["podman", "kill", "-s", "TERM", name], check=True, capture_output=True)
        exit_code = subprocess.run(["podman", "wait", name], capture_output=True, text=True, timeout=120).stdout
        logs = subprocess.run(["podman", "logs", name], capture_output=True, text=True)
        assert exit_code.strip() == "0", logs.stderr[-3000:]
        assert "draining" in logs.stdout + logs.stderr
        assert "Traceback" not in logs.stdout + logs.stderr
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True)
