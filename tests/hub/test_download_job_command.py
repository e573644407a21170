"""The operator's download Job, run for real: its container's command line and environment (the token
Secret and HF_ENDPOINT resolved as the kubelet would) against the fake Hub, into a directory standing
for the cache claim; then the model pod's `pagoda serve <directory>` serves it from a read-only copy."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from fake_hub import FakeHub

from pagoda_operator import builders as b
from pagoda_operator import model_cache as mc
from pagoda_operator.spec import MODEL_CACHE_PATH, parse_spec

pytestmark = pytest.mark.server

PAGODA = str(Path(sys.executable).parent / "pagoda")
TOKEN = "hf_job_token"


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def private_hub(tiny_dir):
    hub = FakeHub()
    hub.add_model_dir("org/tiny", tiny_dir, extra={"pytorch_model.bin": b"\0" * 100}, revisions=("main", "v1"),
                      token=TOKEN)
    hub.start()
    yield hub
    hub.stop()


def in_pod(path: str, mounts: dict[str, Path]) -> str:
    """A path inside the pod, on this machine: the volume's mount point replaced by its directory."""
    for mount, directory in mounts.items():
        if path == mount or path.startswith(mount + "/"):
            return str(directory) + path[len(mount):]
    return path


def kubelet_env(entries: list[dict], secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    env = {}
    for entry in entries:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def test_the_download_jobs_command_fills_the_directory_the_model_pods_serve(private_hub, tiny_dir, tmp_path):
    body = {"apiVersion": b.API_VERSION, "kind": b.KIND, "metadata": {"name": "demo", "namespace": "ns", "uid": "u"},
            "spec": {"model": {"name": "org/tiny", "revision": "v1", "tokenSecret": "hf"},
                     "env": [{"name": "HF_ENDPOINT", "value": private_hub.url}],
                     "resources": {"requests": {"cpu": "1"}}}}
    spec = parse_spec(body, default_image="pagoda-runtime:test")
    (container,) = mc.build_download_job(spec, body)["spec"]["template"]["spec"]["containers"]
    cache, scratch = tmp_path / "cache", tmp_path / "tmp"
    cache.mkdir()
    scratch.mkdir()
    mounts = {MODEL_CACHE_PATH: cache, "/tmp": scratch}
    job_env = {k: in_pod(v, mounts) for k, v in kubelet_env(container["env"], {"hf": {"token": TOKEN}}).items()}
    assert job_env["HF_ENDPOINT"] == private_hub.url and job_env["HF_TOKEN"] == TOKEN
    base = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    command = [PAGODA, *(in_pod(a, mounts) for a in container["args"])]  # the image's entrypoint is `pagoda`

    result = subprocess.run(command, env={**base, **job_env}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    model_dir = Path(in_pod(spec.model_path, mounts))
    assert result.stdout.strip().splitlines()[-1] == str(model_dir)
    got = {p.name for p in model_dir.iterdir() if p.is_file()}
    assert got == {p.name for p in tiny_dir.iterdir() if p.is_file()}  # only the engine's files
    for name in got:
        assert (model_dir / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    model_requests = [r for r in private_hub.requests if r.path.startswith(("/org/tiny/", "/api/models/org/tiny/"))]
    assert model_requests and all(r.authorization == f"Bearer {TOKEN}" for r in model_requests)

    # Into an empty claim without the Secret, the same command fails; its last line is what ModelReady shows.
    empty = tmp_path / "empty-cache"
    no_token = {k: v for k, v in job_env.items() if k != "HF_TOKEN"}
    failed = subprocess.run([PAGODA, *(in_pod(a, {MODEL_CACHE_PATH: empty}) for a in container["args"])],
                            env={**base, **no_token}, capture_output=True, text=True, timeout=300)
    assert failed.returncode != 0
    reason = mc.pod_failure_message([{"status": {"containerStatuses": [{"state": {"terminated": {
        "exitCode": failed.returncode, "message": failed.stderr}}}]}}])
    assert "'org/tiny'" in reason and "set HF_TOKEN" in reason, failed.stderr

    # The model pod mounts the claim read-only and serves the directory named in its arguments.
    from openai import OpenAI
    from server.live_server import start_server

    (sts,) = [m for m in b.build_all(spec, body) if m["kind"] == "StatefulSet"]
    served = Path(in_pod(sts["spec"]["template"]["spec"]["containers"][0]["args"][1], mounts))
    assert served == model_dir
    writable = [p for p in [cache, *cache.rglob("*")]]
    for path in writable:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        start = len(private_hub.requests)
        server = start_server(served, tmp_path, "--served-model-name", "demo", env={"HF_HUB_OFFLINE": "1"})
        try:
            client = OpenAI(base_url=server.url + "/v1", api_key="unused")
            completion = client.completions.create(model="demo", prompt="Hello", max_tokens=4, temperature=0)
            assert completion.usage.completion_tokens == 4
        finally:
            server.stop()
        assert len(private_hub.requests) == start  # served from the cache alone
    finally:
        for path in writable:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
