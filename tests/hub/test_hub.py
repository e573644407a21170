"""Models by Hub id: `pagoda download`, `pagoda serve ORG/NAME` and `LLM(model="ORG/NAME")` against a local
server speaking the Hub's file API (fake_hub.py), in real processes, offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_hub import FakeHub, HubRepo

from pagoda.config import hub as pagoda_hub

pytestmark = pytest.mark.server

PAGODA = str(Path(sys.executable).parent / "pagoda")
EXTRAS = {"pytorch_model.bin": b"\0" * 300, "consolidated.safetensors": b"\1" * 200,
          "original/model.safetensors": b"\2" * 100, "README.md": b"# tiny\n"}
TOKEN = "hf_test_token"


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama", shards=2)  # sharded: the index decides which weights to fetch


@pytest.fixture(scope="module")
def fake_hub(tiny_dir, tiny_model_factory):
    hub = FakeHub()
    hub.add_model_dir("org/tiny", tiny_dir, extra=EXTRAS, revisions=("main", "v1"))
    hub.add_model_dir("org/private", tiny_dir, token=TOKEN)
    # one weights file larger than huggingface_hub's 10 MiB write chunk, so a cut transfer can resume
    hub.add_model_dir("org/wide", tiny_model_factory("llama", hidden=512, num_heads=8, num_layers=2))
    hub.repos["org/gpt2"] = HubRepo({"config.json": json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                                "model_type": "gpt2"}).encode(),
                                     "model.safetensors": b"\0" * 1000})
    hub.start()
    yield hub
    hub.stop()


def hub_env(hub: FakeHub, home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_ENDPOINT": hub.url, "HF_HOME": str(home), "TOKENIZERS_PARALLELISM": "false", **extra}


def pagoda(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([PAGODA, *args], env=env, capture_output=True, text=True, timeout=300)


def engine_files(tiny_dir: Path) -> set[str]:
    return {p.name for p in tiny_dir.iterdir() if p.is_file()}


def resolve_gets(hub: FakeHub, repo: str) -> list[str]:
    return [r.path for r in hub.requests if r.method == "GET" and r.path.startswith(f"/{repo}/resolve/")]


def test_download_fetches_only_the_engine_files_into_dir_and_prints_it(fake_hub, tiny_dir, tmp_path):
    target = tmp_path / "models" / "tiny"
    env = hub_env(fake_hub, tmp_path / "hf")
    before = len(resolve_gets(fake_hub, "org/tiny"))
    result = pagoda("download", "org/tiny", "--revision", "v1", "--dir", str(target), env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(target.resolve())
    assert "Fetching" in result.stderr  # huggingface_hub's progress bar
    got = {p.name for p in target.iterdir() if p.is_file()}
    assert got == engine_files(tiny_dir) and "model.safetensors.index.json" in got
    for name in got:
        assert (target / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    fetched = resolve_gets(fake_hub, "org/tiny")[before:]
    assert not [p for p in fetched if p.rsplit("/", 1)[-1] in {"pytorch_model.bin", "README.md",
                                                                "consolidated.safetensors"}]
    assert not [p for p in fetched if "/original/" in p]

    again = pagoda("download", "org/tiny", "--revision", "v1", "--dir", str(target), env=env)
    assert again.returncode == 0, again.stderr
    assert len(resolve_gets(fake_hub, "org/tiny")) == before + len(fetched), "complete files fetched again"


def test_interrupted_transfer_resumes_with_a_range_request(fake_hub, tmp_path):
    weights = "model.safetensors"
    size = len(fake_hub.repos["org/wide"].files[weights])
    cut = 10 * 1024 * 1024 + 12345
    assert size > cut + 1024
    fake_hub.cut_once[weights] = cut
    result = pagoda("download", "org/wide", env=hub_env(fake_hub, tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    snapshot = Path(result.stdout.strip().splitlines()[-1])
    assert snapshot.is_relative_to(tmp_path / "hf") and "snapshots" in snapshot.parts
    assert (snapshot / weights).read_bytes() == fake_hub.repos["org/wide"].files[weights]
    gets = [r for r in fake_hub.requests if r.method == "GET" and r.path.endswith("/" + weights)
            and r.path.startswith("/org/wide/")]
    assert len(gets) == 2 and gets[0].range is None, gets
    resumed_at = int(gets[1].range.removeprefix("bytes=").removesuffix("-"))
    assert 0 < resumed_at <= cut, gets[1].range  # the bytes that arrived were kept, not fetched again


def test_wrong_revision_unknown_model_and_bad_id_are_named_without_traceback(fake_hub, tmp_path):
    env = hub_env(fake_hub, tmp_path / "hf")
    cases = [
        (["org/tiny", "--revision", "nope"], "--revision 'nope' of model 'org/tiny' not found on the Hub"),
        (["org/missing"], "'org/missing' is neither a local directory nor a model on the Hub"),
        (["a/b/c"], "argument ORG/NAME: 'a/b/c' is not a Hub model id"),
    ]
    for args, message in cases:
        result = pagoda("download", *args, env=env)
        assert result.returncode != 0 and message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_unsupported_architecture_is_refused_before_the_weights_are_fetched(fake_hub, tmp_path):
    result = pagoda("download", "org/gpt2", env=hub_env(fake_hub, tmp_path / "hf"))
    assert result.returncode != 0, result.stdout
    assert "model 'org/gpt2': unsupported architecture ['GPT2LMHeadModel']" in result.stderr, result.stderr
    assert not [p for p in resolve_gets(fake_hub, "org/gpt2") if p.endswith(".safetensors")]


def test_private_model_needs_hf_token(fake_hub, tmp_path):
    without = pagoda("download", "org/private", env=hub_env(fake_hub, tmp_path / "hf"))
    assert without.returncode != 0 and "set HF_TOKEN" in without.stderr, without.stderr
    start = len(fake_hub.requests)
    with_token = pagoda("download", "org/private", env=hub_env(fake_hub, tmp_path / "hf", HF_TOKEN=TOKEN))
    assert with_token.returncode == 0, with_token.stderr
    assert (Path(with_token.stdout.strip().splitlines()[-1]) / "config.json").is_file()
    assert all(r.authorization == f"Bearer {TOKEN}" for r in fake_hub.requests[start:]
               if r.path.startswith(("/org/private/", "/api/models/org/private/")))


def test_offline_mode_serves_from_the_cache_and_says_so_when_missing(fake_hub, tmp_path):
    home = tmp_path / "hf"
    online = pagoda("download", "org/tiny", env=hub_env(fake_hub, home))
    assert online.returncode == 0, online.stderr
    path = online.stdout.strip().splitlines()[-1]

    start = len(fake_hub.requests)
    offline_env = hub_env(fake_hub, home, HF_HUB_OFFLINE="1")
    offline = pagoda("download", "org/tiny", env=offline_env)
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout.strip().splitlines()[-1] == path
    assert len(fake_hub.requests) == start, "offline mode talked to the Hub"

    missing = pagoda("download", "org/tiny", "--revision", "v1", env=offline_env)  # v1 never fetched here
    assert missing.returncode != 0 and "offline mode is on (HF_HUB_OFFLINE)" in missing.stderr, missing.stderr
    assert "Traceback" not in missing.stderr


def test_serve_by_hub_id_of_the_downloaded_model_answers_the_openai_client(fake_hub, tmp_path):
    """Download once, then serve from the cache with the network off: what a pod does after a download Job."""
    from openai import OpenAI
    from server.live_server import start_server

    env = hub_env(fake_hub, tmp_path / "hf")
    bad = start_server("org/tiny", tmp_path, "--revision", "nope", env=env, wait=False)
    assert bad.process.wait(120) != 0
    assert "--revision 'nope' of model 'org/tiny' not found" in bad.log() and "Traceback" not in bad.log()

    assert pagoda("download", "org/tiny", "--revision", "v1", env=env).returncode == 0
    start = len(fake_hub.requests)
    offline = {**env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens there
    server = start_server("org/tiny", tmp_path, "--revision", "v1", env=offline)
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["org/tiny"]
        completion = client.completions.create(model="org/tiny", prompt="Hello, my name is", max_tokens=5,
                                               temperature=0)
        assert completion.usage.completion_tokens == 5 and completion.choices[0].text
    finally:
        server.stop()
    assert len(fake_hub.requests) == start, "serving a downloaded model went to the Hub"
    snapshots = list((tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots").iterdir())
    assert len(snapshots) == 1 and (snapshots[0] / "model-00002-of-00002.safetensors").is_file()


_LLM_SCRIPT = """
import json, sys
from pagoda import LLM, SamplingParams

params = SamplingParams(temperature=0.0, max_tokens=6)
by_id = LLM(model="org/tiny", revision="v1", kv_cache_memory=0.02).generate(["Hello"], params, use_tqdm=False)
local = LLM(model=sys.argv[1], kv_cache_memory=0.02).generate(["Hello"], params, use_tqdm=False)
try:
    LLM(model="org/tiny", revision="nope", kv_cache_memory=0.02)
    error = None
except ValueError as e:
    error = str(e)
print(json.dumps({"by_id": by_id[0].outputs[0].token_ids, "local": local[0].outputs[0].token_ids,
                  "error": error}))
"""


def test_llm_by_hub_id_generates_what_the_local_copy_does(fake_hub, tiny_dir, tmp_path):
    result = subprocess.run([sys.executable, "-c", _LLM_SCRIPT, str(tiny_dir)], capture_output=True, text=True,
                            env=hub_env(fake_hub, tmp_path / "hf"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(out["by_id"]) == 6 and out["by_id"] == out["local"]
    assert out["error"] == "revision 'nope' of model 'org/tiny' not found on the Hub (" + fake_hub.url + ")"


@pytest.mark.unit
@pytest.mark.parametrize(("text", "is_id"), [
    ("org/name", True), ("Qwen/Qwen2.5-0.5B-Instruct", True), ("gpt2", True),
    ("/models/x", False), ("./x", False), ("~/x", False), ("a/b/c", False), ("org/", False), ("a--b", False),
])
def test_is_repo_id(text, is_id):
    assert pagoda_hub.is_repo_id(text) is is_id


@pytest.mark.unit
def test_revision_with_a_local_directory_is_refused(tiny_dir):
    from pagoda.config.model_files import resolve_model_path

    with pytest.raises(ValueError, match="applies to Hub model ids"):
        resolve_model_path(str(tiny_dir), "v1")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path("/no/such/model")
