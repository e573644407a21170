"""`pagoda bench serve --matrix`: the loads it names, the order the engines run in, and the one table it
prints. No server: the senders are stand-ins that answer at once."""

import asyncio
from contextlib import contextmanager

import pytest

from pagoda.bench import matrix
from pagoda.bench.figures import RequestResult, summarize
from pagoda.bench.serve import BenchRequest, parse_args, peer_max_model_len, synthetic_requests
from pagoda.bench.vllm_peer import PEER_MAX_MODEL_LEN  # vllm_server's default: every load must fit it

pytestmark = pytest.mark.unit


def test_the_matrix_spans_the_shapes_users_send():
    loads = matrix.MATRIX
    assert len(loads) >= 8 and len({load.name for load in loads}) == len(loads)
    assert min(load.input_len for load in loads) == 32 and max(load.input_len for load in loads) == 1500
    assert min(load.output_len for load in loads) == 16 and max(load.output_len for load in loads) == 512
    closed = {load.concurrency for load in loads if load.request_rate == float("inf")}
    assert {1, 4, 8, 16, 32, 64} <= closed
    assert any(load.request_rate != float("inf") for load in loads)  # Poisson arrivals
    assert any(load.range_ratio > 0 for load in loads)  # random length ratios
    for load in loads:
        longest = (load.input_len + load.output_len) * (1 + load.range_ratio)
        assert longest <= PEER_MAX_MODEL_LEN, load.name
        assert load.num_prompts >= (load.concurrency or 1), load.name  # every slot is used at least once
        assert load.what


def test_named_loads_keep_the_matrix_order_and_unknown_names_are_refused():
    assert [load.name for load in matrix.loads("chat-c32,single")] == ["single", "chat-c32"]
    assert matrix.loads(None) == list(matrix.MATRIX)
    with pytest.raises(ValueError, match="unknown load.*nope"):
        matrix.loads("single,nope")


def test_the_other_loads_run_by_name_only_and_reach_past_the_matrix():
    others = matrix.OTHER_LOADS
    names = [load.name for load in matrix.NAMED_LOADS]
    assert len(set(names)) == len(names)
    assert not set(others) & set(matrix.loads(None))  # the default run is the matrix alone
    assert [load.name for load in matrix.loads("c128,single")] == ["single", "c128"]
    assert max(load.concurrency for load in others) > max(load.concurrency for load in matrix.MATRIX)
    for load in others:
        assert (load.input_len + load.output_len) * (1 + load.range_ratio) <= PEER_MAX_MODEL_LEN, load.name
        assert load.what
    # every load of either set draws its own prompts
    args = parse_args(["--matrix", "--seed", "5"])
    seeds = [matrix.load_args(args, load).seed for load in matrix.NAMED_LOADS]
    assert len(set(seeds)) == len(seeds)


def test_the_engines_run_in_alternating_pairs():
    order = [engine for i in range(4) for engine in matrix.engine_order(i, with_vllm=True)]
    assert order == ["pagoda", "vllm", "vllm", "pagoda", "pagoda", "vllm", "vllm", "pagoda"]
    assert matrix.engine_order(1, with_vllm=False) == ("pagoda",)


def test_each_load_sets_the_run_arguments():
    args = parse_args(["--matrix", "--max-concurrency", "3", "--input-len", "99"])
    load = matrix.loads("poisson-2rps")[0]
    per_load = matrix.load_args(args, load)
    assert (per_load.input_len, per_load.output_len, per_load.max_concurrency, per_load.request_rate,
            per_load.num_prompts) == (256, 128, 64, 2.0, 96)
    assert args.input_len == 99  # the caller's arguments are left as they were


def test_loads_of_one_shape_send_different_prompts():
    # the same prompts twice would meet the first load's in Pagoda's prefix cache (vLLM's peer runs without one)
    args = parse_args(["--matrix", "--seed", "5"])
    single, chat = matrix.loads("single,chat-c32")
    assert (single.input_len, single.output_len) == (chat.input_len, chat.output_len)
    seeds = [matrix.load_args(args, load).seed for load in (single, chat)]
    assert seeds[0] != seeds[1]
    first, second = (synthetic_requests(4, 256, 128, 0.0, seed) for seed in seeds)
    assert all(a.prompt[:64] != b.prompt[:64] for a, b in zip(first, second))


@pytest.mark.parametrize("argv, message", [
    (["--matrix", "--matrix-loads", "single,bogus"], "unknown load"),
    (["--matrix", "--dataset", "jsonl", "--dataset-path", "x.jsonl"], "--matrix runs synthetic loads"),
    (["--table", "t.md"], "apply to --matrix"),
])
def test_bad_matrix_arguments_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def summary(ttft_s: float, itl_s: float, tokens: int, duration: float = 10.0) -> dict:
    results = [RequestResult(ok=True, ttft=ttft_s * (1 + i / 10), latency=ttft_s + 1.0, itl=[itl_s * (1 + i / 10)] * 3,
                             prompt_tokens=8, output_tokens=tokens) for i in range(10)]
    return summarize(results, duration)


def test_the_table_puts_each_figure_beside_vllms_with_the_throughput_ratio():
    single, chat = matrix.loads("single,chat-c32")
    mine, theirs = summary(0.2, 0.010, 40), summary(0.5, 0.030, 30)
    text = matrix.table([(single, mine, theirs), (chat, summary(2.0, 0.05, 40), summary(1.0, 0.06, 20))])
    lines = text.splitlines()
    assert lines[0].startswith("| load | prompt/answer tokens | arrivals | output tok/s (ratio) | TTFT median, Pagoda")
    assert len(lines) == 4 and all(line.count("|") == 9 for line in lines)
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:4] == ["single", "256/128", "c=1", "40 / 30 (**1.33x**)"]
    assert cells[4] == f"{mine['ttft_ms']['median']:.0f} ms / {theirs['ttft_ms']['median']:.0f} ms"
    assert cells[7] == f"{mine['itl_ms']['p99']:.0f} ms / {theirs['itl_ms']['p99']:.0f} ms"
    chat_cells = [c.strip() for c in lines[3].strip("|").split("|")]
    assert chat_cells[3].endswith("(**2.00x**)") and chat_cells[4].endswith(" s")  # seconds past 1,000 ms


def test_the_table_without_vllm_and_the_empty_one_for_the_docs():
    (poisson,) = matrix.loads("poisson-2rps")
    failed = summarize([RequestResult(error="HTTP 500")], 1.0)
    text = matrix.table([(poisson, failed, None)])
    assert "Pagoda / vLLM" not in text and "| poisson-2rps (1 failed) | 256/128 | 2/s, c≤64 | 0 |" in text
    empty = matrix.empty_table().splitlines()
    assert len(empty) == 2 + len(matrix.MATRIX) and all(line.count("|") == 9 for line in empty)
    assert "| random-ratio-c16 | 512/256 ±90% | c=16 | – |" in matrix.empty_table()


class StandInSender:
    """Answers every request at once, logging which engine ran when."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log


def test_run_matrix_alternates_the_engines_on_one_vllm_server(monkeypatch, tmp_path):
    import pagoda.bench.vllm_peer as vllm_peer

    log, started = [], []

    @contextmanager
    def fake_vllm_server(python, model_dir, served_name, **kwargs):
        started.append(model_dir)
        yield "http://127.0.0.1:1"

    monkeypatch.setattr(vllm_peer, "check_vllm_python", lambda python: python)
    monkeypatch.setattr(vllm_peer, "vllm_server", fake_vllm_server)

    async def fake_measure(sender, warmup, requests, args):
        log.append((sender.name, args.max_concurrency, len(requests), len(warmup)))
        return summary(0.1, 0.01, 4)

    args = parse_args(["--matrix", "--matrix-loads", "single,mid-c8,chat-c32", "--vllm-python", "py",
                       "--warmup", "2"])
    results = asyncio.run(matrix.run_matrix(
        args, StandInSender("pagoda", log), None, "m", str(tmp_path), measure=fake_measure,
        synthetic_requests=synthetic_requests, http_sender=lambda url, name: StandInSender("vllm", log)))
    assert started == [str(tmp_path)]  # one vLLM server for the whole matrix
    assert [(name, c) for name, c, _, _ in log] == [("pagoda", 1), ("vllm", 1), ("vllm", 8), ("pagoda", 8),
                                                    ("pagoda", 32), ("vllm", 32)]
    assert [(n, w) for _, _, n, w in log][:2] == [(16, 2), (16, 2)]
    assert [load.name for load, _, theirs in results if theirs is not None] == ["single", "mid-c8", "chat-c32"]


def test_a_short_loads_rounds_alternate_and_each_engines_are_pooled(monkeypatch, tmp_path):
    import pagoda.bench.vllm_peer as vllm_peer

    @contextmanager
    def fake_vllm_server(python, model_dir, served_name, **kwargs):
        yield "http://127.0.0.1:1"

    monkeypatch.setattr(vllm_peer, "check_vllm_python", lambda python: python)
    monkeypatch.setattr(vllm_peer, "vllm_server", fake_vllm_server)
    log = []

    async def fake_measure(sender, warmup, requests, args):
        # each run's TTFTs set apart by its order (1, 2, 3, ... s), so the pooled median shows every run counted
        n = len(log) + 1
        log.append((sender.name, args.seed, requests[0].prompt))
        results = [RequestResult(ok=True, ttft=float(n), latency=n + 1.0, itl=[0.1], prompt_tokens=32,
                                 output_tokens=2) for _ in requests]
        figures = summarize(results, duration=float(n))
        return {**figures, "results": results, "preemptions": 1}

    tiny = next(load for load in matrix.MATRIX if load.rounds > 1)
    args = parse_args(["--matrix", "--matrix-loads", f"single,{tiny.name}", "--vllm-python", "py", "--seed", "7"])
    results = asyncio.run(matrix.run_matrix(
        args, StandInSender("pagoda", log), None, "m", str(tmp_path), measure=fake_measure,
        synthetic_requests=synthetic_requests, http_sender=lambda url, name: StandInSender("vllm", log)))
    order = [name for name, _, _ in log]
    # single is the first pair; the short load's rounds go on alternating: vllm-pagoda, pagoda-vllm, ...
    assert order == ["pagoda", "vllm"] + ["vllm", "pagoda", "pagoda", "vllm"] * (tiny.rounds // 2)
    seeds = [seed for _, seed, _ in log[2:]]
    assert seeds[0::2] == seeds[1::2] and len(set(seeds)) == tiny.rounds  # a round's prompts to both engines
    assert len({prompt for _, _, prompt in log[2::2]}) == tiny.rounds  # each round new ones (the prefix cache)
    (_, mine, theirs), = [(load, m, t) for load, m, t in results if load.name == tiny.name]
    runs = {engine: [i + 1 for i, (name, _, _) in enumerate(log) if name == engine][1:] for engine in ("pagoda", "vllm")}
    for figures, engine in ((mine, "pagoda"), (theirs, "vllm")):
        assert "results" not in figures and figures["rounds"] == tiny.rounds
        assert figures["completed"] == figures["num_prompts"] == tiny.rounds * tiny.num_prompts
        assert figures["duration_s"] == sum(runs[engine])  # the throughput over the runs' summed time
        assert figures["output_token_throughput"] == pytest.approx(2 * tiny.rounds * tiny.num_prompts
                                                                   / sum(runs[engine]))
        assert figures["ttft_ms"]["mean"] == pytest.approx(1000 * sum(runs[engine]) / tiny.rounds)
        assert figures["preemptions"] == tiny.rounds
    single = results[0][1]
    assert "results" not in single and "rounds" not in single  # one run: its figures as measured


def test_the_line_printed_per_load_carries_every_cell_of_the_table():
    # a matrix cut short keeps what it printed: each engine's line must hold the row's figures and the E2E latency
    figures = summary(0.2, 0.010, 40)
    line = matrix.progress(figures)
    for key, stat in (("ttft_ms", "median"), ("ttft_ms", "p90"), ("itl_ms", "median"), ("itl_ms", "p99"),
                      ("e2e_ms", "median")):
        assert f"{figures[key][stat]:.0f}" in line
    assert line.startswith(f"{figures['output_token_throughput']:.0f} tok/s")


# --- --client vllm: vLLM's own `vllm bench serve` measures both servers ------------------------------------

# the fields vLLM 0.32's `vllm bench serve --save-result --percentile-metrics ttft,tpot,itl,e2el
# --metric-percentiles 50,90,99` writes (a chat-c32 run against Pagoda, 2026-11-30), less its per-request lists
VLLM_RESULT = {
    "date": "20261130-152539", "backend": "openai", "model_id": "SmolLM2-135M-Instruct", "num_prompts": 96,
    "request_rate": "inf", "max_concurrency": 32, "duration": 32.265, "completed": 96, "failed": 0,
    "total_input_tokens": 24576, "total_output_tokens": 12288, "request_throughput": 2.975,
    "output_throughput": 380.84, "total_token_throughput": 1142.53,
    "mean_ttft_ms": 1111.7, "median_ttft_ms": 388.0, "p50_ttft_ms": 388.0, "p90_ttft_ms": 3543.5, "p99_ttft_ms": 5069.4,
    "mean_tpot_ms": 75.0, "median_tpot_ms": 79.8, "p50_tpot_ms": 79.8, "p90_tpot_ms": 85.2, "p99_tpot_ms": 86.3,
    "mean_itl_ms": 76.2, "median_itl_ms": 48.4, "p50_itl_ms": 48.4, "p90_itl_ms": 185.6, "p99_itl_ms": 215.9,
    "mean_e2el_ms": 10635.0, "median_e2el_ms": 10300.0, "p50_e2el_ms": 10300.0, "p90_e2el_ms": 13900.0,
    "p99_e2el_ms": 14500.0,
}


def test_vllm_bench_serve_runs_each_load_at_its_shape():
    from pagoda.bench.vllm_client import VllmBenchClient

    client = VllmBenchClient("/venv/bin/python", "/models/m", "served")
    ratio, poisson = matrix.loads("random-ratio-c16,poisson-2rps")
    cmd = client.command("http://h:8000/", poisson, seed=68, warmup=4, result_dir="/tmp/r", result_name="x.json")
    assert cmd[:5] == ["/venv/bin/python", "-m", "vllm.entrypoints.cli.main", "bench", "serve"]

    def flag(cmd, name):
        return cmd[cmd.index(name) + 1]

    assert [flag(cmd, f) for f in ("--base-url", "--model", "--tokenizer", "--random-input-len",
                                   "--random-output-len", "--num-prompts", "--max-concurrency", "--request-rate",
                                   "--seed", "--num-warmups", "--result-dir", "--result-filename")] == \
        ["http://h:8000", "served", "/models/m", "256", "128", "96", "64", "2.0", "68", "4", "/tmp/r", "x.json"]
    assert "--ignore-eos" in cmd and "--save-result" in cmd and flag(cmd, "--endpoint") == "/v1/completions"
    closed = client.command("http://h:8000", ratio, seed=1, warmup=0, result_dir="/r", result_name="y.json")
    assert "--request-rate" not in closed  # a closed loop: all at once, bounded by its concurrency
    assert (flag(closed, "--random-range-ratio"), flag(closed, "--max-concurrency")) == ("0.9", "16")


def test_a_vllm_bench_serve_result_fills_the_same_table():
    from pagoda.bench.vllm_client import summary_of

    figures = summary_of(VLLM_RESULT)
    assert figures["output_token_throughput"] == 380.84 and figures["failed"] == 0 and figures["errors"] == []
    assert figures["ttft_ms"] == {"mean": 1111.7, "median": 388.0, "p90": 3543.5, "p99": 5069.4}
    assert figures["itl_ms"]["p99"] == 215.9 and figures["e2e_ms"]["median"] == 10300.0
    theirs = summary_of({**VLLM_RESULT, "output_throughput": 300.0, "failed": 2, "completed": 94,
                         "errors": ["", "Bad Request", "Bad Request"]})
    assert theirs["errors"] == ["Bad Request"]
    (chat,) = matrix.loads("chat-c32")
    row = matrix.table([(chat, figures, theirs)]).splitlines()[2]
    assert row.startswith("| chat-c32 (2 failed) | 256/128 | c=32 | 381 / 300 (**1.27x**) | 388 ms / 388 ms |")
    assert matrix.progress(figures)  # the line printed as the matrix goes


@pytest.mark.parametrize("argv, message", [
    (["--matrix", "--client", "vllm"], "needs --matrix and --vllm-python"),
    (["--client", "vllm", "--vllm-python", "py"], "needs --matrix and --vllm-python"),
    (["--matrix", "--client", "vllm", "--vllm-python", "py", "--endpoint", "chat"], "cannot be combined"),
    (["--matrix", "--client", "curl"], "invalid choice"),
])
def test_bad_client_arguments_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_run_matrix_with_vllms_client_measures_both_servers_in_alternating_pairs(monkeypatch, tmp_path):
    import pagoda.bench.vllm_client as vllm_client
    import pagoda.bench.vllm_peer as vllm_peer

    measured = []

    @contextmanager
    def fake_vllm_server(python, model_dir, served_name, **kwargs):
        yield "http://127.0.0.1:1"

    async def record(self, base_url, load, seed, warmup):
        measured.append((base_url, load.name, seed, warmup, self.tokenizer, self.model))
        return summary(0.1, 0.01, 4)

    monkeypatch.setattr(vllm_peer, "check_vllm_python", lambda python: python)
    monkeypatch.setattr(vllm_peer, "vllm_server", fake_vllm_server)
    monkeypatch.setattr(vllm_client.VllmBenchClient, "measure", record)

    async def pagodas_client(*args):
        raise AssertionError("Pagoda's client measured a load that vLLM's client was asked to")

    args = parse_args(["--matrix", "--matrix-loads", "single,mid-c8", "--vllm-python", "py", "--client", "vllm",
                       "--base-url", "http://127.0.0.1:2", "--seed", "10", "--warmup", "4"])
    results = asyncio.run(matrix.run_matrix(
        args, StandInSender("pagoda", []), None, "m", str(tmp_path), measure=pagodas_client,
        synthetic_requests=synthetic_requests, http_sender=lambda url, name: StandInSender("vllm", [])))
    assert measured == [("http://127.0.0.1:2", "single", 10, 4, str(tmp_path), "m"),
                        ("http://127.0.0.1:1", "single", 10, 4, str(tmp_path), "m"),
                        ("http://127.0.0.1:1", "mid-c8", 12, 4, str(tmp_path), "m"),
                        ("http://127.0.0.1:2", "mid-c8", 12, 4, str(tmp_path), "m")]
    assert [load.name for load, _, theirs in results if theirs is not None] == ["single", "mid-c8"]


def test_the_peer_is_served_at_the_length_a_single_load_needs(tmp_path):
    """A load past vLLM's default --max-model-len got 400s from the peer (3,000-token prompts) and a comparison of
    nothing: the peer takes the longest request's length, within the model's own."""
    from transformers import LlamaConfig

    LlamaConfig(max_position_embeddings=4096, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    short = [BenchRequest(list(range(1500)), 64, 1500), BenchRequest("a b c", 16)]
    assert peer_max_model_len(short, str(tmp_path / "never read")) == PEER_MAX_MODEL_LEN
    assert peer_max_model_len([*short, BenchRequest(list(range(3000)), 64, 3000)], str(tmp_path)) == 3064
    assert peer_max_model_len([BenchRequest(list(range(5000)), 64, 5000)], str(tmp_path)) == 4096
    assert peer_max_model_len([BenchRequest(" ".join(["word"] * 1200), 100)], str(tmp_path)) == 2500
