"""The `pagoda` command: `pagoda serve [MODEL] ...`, `pagoda router ...`, `pagoda download ORG/NAME` and
`pagoda bench {throughput,kernels,serve,...}`.

Heavy imports (torch, the engine, uvicorn) happen only once a subcommand runs, so `--help` is instant.
"""

import argparse
import importlib
import logging
import sys

BENCHMARKS = {
    "throughput": "pagoda.bench.throughput",
    "kernels": "pagoda.bench.kernels",
    "serve": "pagoda.bench.serve",
    "parallel": "pagoda.bench.parallel",
    "spec-decode": "pagoda.bench.spec_decode",
    "router": "pagoda.bench.router",
    "moe": "pagoda.bench.moe",
    "lora": "pagoda.bench.lora",
    "kv-transfer": "pagoda.bench.kv_transfer",
    "schedule": "pagoda.bench.schedule_sim",
}


def build_parser() -> argparse.ArgumentParser:
    from pagoda.entrypoints.openai.cli_args import add_serve_arguments
    from pagoda.router.cli import add_router_arguments

    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda: paged-attention LLM serving.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    commands = parser.add_subparsers(dest="command", metavar="{serve,router,download,bench}")
    serve = commands.add_parser("serve", help="run the OpenAI-compatible server",
                                description="Run the OpenAI-compatible server (vLLM's `vllm serve` flags). "
                                            "Every flag can also come from PAGODA_<FLAG>; flags win.")
    add_serve_arguments(serve)
    router = commands.add_parser("router", help="one OpenAI endpoint in front of several `pagoda serve` replicas",
                                 description="Route OpenAI requests over several `pagoda serve` replicas "
                                             "(docs/router.md). Every flag can also come from "
                                             "PAGODA_ROUTER_<FLAG>; flags win.")
    add_router_arguments(router)
    download = commands.add_parser(
        "download", help="fetch a model from the Hugging Face Hub without serving it",
        description="Fetch the files the engine needs (config, tokenizer, safetensors) of a Hub model into "
                    "the Hub cache or --dir, then print the local path. Honours HF_TOKEN, HF_ENDPOINT, "
                    "HF_HOME and HF_HUB_OFFLINE; files already there are not fetched again.")
    download.add_argument("model", metavar="ORG/NAME", help="a Hub model id")
    download.add_argument("--revision", help="branch, tag or commit (default: main)")
    download.add_argument("--dir", help="a directory to put the files in (default: the Hub cache)")
    bench = commands.add_parser("bench", help="benchmarks: throughput (offline), kernels, serve (HTTP)")
    bench.add_argument("benchmark", choices=sorted(BENCHMARKS), help="which benchmark")
    return parser


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")


def serve(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from pagoda.process.startup_heap import pause_collections

    pause_collections()  # until the model is loaded (the server's or the worker rank's frozen_when_loaded)
    from pagoda.config import create_engine_config
    from pagoda.entrypoints.openai.cli_args import flagify, split_args

    configure_logging(ns.log_level)
    try:
        engine_args, server_args = split_args(ns)
        # validate every flag now, before the port opens: a bad value is a usage error, not a crash later
        create_engine_config(engine_args)
    except (ValueError, OSError) as e:
        parser.error(flagify(str(e)))
    if engine_args.node_rank > 0 or server_args.headless:
        from pagoda.entrypoints.openai.worker_server import run_worker_server

        run_rank = _find_worker_rank_runner()
        if run_rank is None:
            parser.error("--node-rank > 0 (a multi-node worker) is not supported by this build yet")
        return run_worker_server(server_args, lambda ready: run_rank(engine_args, ready))

    from pagoda.entrypoints.openai.api_server import run_server

    return run_server(engine_args, server_args)


def download(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from pagoda.config import hub
    from pagoda.config.model_files import load_hf_config
    from pagoda.entrypoints.openai.cli_args import flagify

    if not hub.is_repo_id(ns.model):
        parser.error(f"argument ORG/NAME: {ns.model!r} is not a Hub model id")
    try:
        path = hub.download_model(ns.model, ns.revision, local_dir=ns.dir, check_config=load_hf_config)
    except ValueError as e:
        parser.error(flagify(str(e)))
    print(path)
    return 0


def _find_worker_rank_runner():
    """The distributed executor plugs in `pagoda.executor.worker.run_worker_rank(engine_args, ready)`."""
    try:
        module = importlib.import_module("pagoda.executor.worker")
    except ImportError:
        return None
    return getattr(module, "run_worker_rank", None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # `pagoda bench X ...`: everything after X belongs to the benchmark's own parser
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHMARKS:
        try:
            module = importlib.import_module(BENCHMARKS[argv[1]])
        except ModuleNotFoundError as e:
            if e.name != BENCHMARKS[argv[1]]:
                raise
            print(f"pagoda bench: error: the {argv[1]} benchmark is not part of this build", file=sys.stderr)
            return 2
        from pagoda.entrypoints.openai.cli_args import flagify
        from pagoda.errors import InvalidParam

        try:
            return module.main(argv[2:]) or 0
        except InvalidParam as e:  # a bad model or engine flag: a usage error, as `pagoda serve` reports it
            print(f"pagoda bench {argv[1]}: error: {flagify(str(e))}", file=sys.stderr)
            return 2
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.version:
        import pagoda

        print(pagoda.__version__)
        return 0
    subparsers = parser._subparsers._group_actions[0].choices
    if ns.command == "serve":
        return serve(subparsers["serve"], ns)
    if ns.command == "router":
        from pagoda.router.cli import run

        configure_logging(ns.log_level)
        return run(subparsers["router"], ns)
    if ns.command == "download":
        return download(subparsers["download"], ns)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
