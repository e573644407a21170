"""The flags the operator writes into pod commands parse with the runtime's own `pagoda serve` parser.

The parser is imported from the runtime, not copied: a flag renamed or removed there fails here."""

from __future__ import annotations

import os

import pytest

from pagoda_operator import builders as b
from pagoda_operator.spec import parse_spec

pytestmark = pytest.mark.operator

cli = pytest.importorskip("pagoda.entrypoints.cli", reason="the runtime package is not importable")

SPECS = [
    {},
    {"tensorParallelSize": 8, "pipelineParallelSize": 2, "replicas": 3,
     "model": {"path": "/models/llama", "servedName": "llama-3",
               "volume": {"persistentVolumeClaim": {"claimName": "w"}}},
     "engine": {"maxModelLen": 8192, "maxNumSeqs": 256, "blockSize": 32, "enablePrefixCaching": False,
                "gpuMemoryUtilization": 0.85, "dtype": "bfloat16", "extraArgs": ["--kv-cache-memory", "4"]},
     "terminationGracePeriodSeconds": 300},
    {"engine": {"enablePrefixCaching": True}, "resources": {"requests": {"cpu": "2"}}},
    {"model": {"name": "org/base"}, "engine": {"extraArgs": ["--max-loras", "4"]},
     "adapters": [{"name": "sql", "model": {"name": "org/sql-lora", "revision": "r1"}},
                  {"name": "chat", "model": {"path": "/models/chat-lora"}}]},
]


@pytest.mark.parametrize("spec", SPECS)
def test_pod_args_parse_with_the_runtime_cli(spec, monkeypatch):
    for var in [v for v in os.environ if v.startswith("PAGODA_")]:
        monkeypatch.delenv(var)  # the parser reads PAGODA_* defaults; test the arguments alone
    body = {"metadata": {"name": "demo", "namespace": "serving"}, "spec": spec}
    parsed = parse_spec(body, default_image="i")
    for manifest in b.build_all(parsed, body):
        if manifest["kind"] != "StatefulSet":
            continue
        container = manifest["spec"]["template"]["spec"]["containers"][0]
        # Kubernetes expands $(PAGODA_NODE_RANK) from the pod-index label before the process starts.
        rank = str(manifest["spec"]["ordinals"]["start"])
        args = [a.replace("$(PAGODA_NODE_RANK)", rank) for a in container["args"]]
        ns = cli.build_parser().parse_args(args)
        assert ns.command == "serve"
        assert ns.tensor_parallel_size == parsed.tensor_parallel_size
        assert ns.pipeline_parallel_size == ns.nnodes == parsed.pipeline_parallel_size
        assert ns.node_rank == int(rank) and ns.master_port == b.MASTER_PORT and ns.port == b.HTTP_PORT
        assert ns.served_model_name == parsed.model_name and ns.model == parsed.model_path
        assert ns.shutdown_timeout == b.drain_seconds(parsed)
        if parsed.engine.max_num_seqs:
            assert ns.max_num_seqs == parsed.engine.max_num_seqs and ns.dtype == parsed.engine.dtype
        if parsed.adapters is not None:
            assert ns.enable_lora and ns.allow_runtime_lora_updating and ns.max_loras == 4
            assert [(m.name, m.path) for m in ns.lora_modules] == [(a.name, a.directory) for a in parsed.adapters]
        if parsed.engine.enable_prefix_caching is not None:
            assert ns.enable_prefix_caching is parsed.engine.enable_prefix_caching


@pytest.mark.parametrize("spec", [
    {},
    {"pipelineParallelSize": 2},
    {"model": {"path": "/models/moe", "volume": {"persistentVolumeClaim": {"claimName": "w"}}},
     "parallelism": {"data": 4, "dataLocal": 1, "expert": True}},
    {"model": {"path": "/models/moe", "volume": {"persistentVolumeClaim": {"claimName": "w"}}},
     "parallelism": {"data": 4, "dataLocal": 2}},
])
def test_pod_args_validate_with_the_pods_own_environment(spec, monkeypatch):
    """Every PAGODA_* variable is also a flag's default in the runtime: the pod's env (PAGODA_NODE_RANK, its index)
    must agree with its args. A DP worker once failed with `--node-rank must be in [0, --nnodes=1); got 1`."""
    from pagoda.entrypoints.openai.cli_args import split_args

    body = {"metadata": {"name": "demo", "namespace": "serving"}, "spec": spec}
    parsed = parse_spec(body, default_image="i")
    for manifest in b.build_all(parsed, body):
        if manifest["kind"] != "StatefulSet":
            continue
        pod = manifest["spec"]["template"]["spec"]
        container = pod["containers"][0]
        for ordinal in range(manifest["spec"]["ordinals"]["start"],
                             manifest["spec"]["ordinals"]["start"] + manifest["spec"]["replicas"]):
            for var in [v for v in os.environ if v.startswith("PAGODA_")]:
                monkeypatch.delenv(var)
            monkeypatch.setenv("PAGODA_NODE_RANK", str(ordinal))  # from the pod-index label
            for env in container.get("env", []):
                if "value" in env:
                    monkeypatch.setenv(env["name"], env["value"])
            args = container["args"]
            if container.get("command"):  # the start-rank shell: `exec pagoda "$@" --data-parallel-start-rank N`
                args = [*args, "--data-parallel-start-rank", str(ordinal * parsed.data_parallel_size_local)]
            ns = cli.build_parser().parse_args([a.replace("$(PAGODA_NODE_RANK)", str(ordinal)) for a in args])
            engine_args, _ = split_args(ns)
            engine_args.validate()
