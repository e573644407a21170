"""`pagoda bench serve`'s summary: percentiles as vllm bench serve computes them (numpy's linear interpolation
between ranks), so the two clients' figures compare on one load."""

import numpy as np
import pytest

from pagoda.bench.figures import RequestResult, percentile, summarize
from pagoda.bench.serve import compare, report

pytestmark = pytest.mark.unit


def test_percentiles_match_numpys_default():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100, 1001):
        values = sorted(rng.exponential(0.05, n).tolist())
        for q in (0.5, 0.9, 0.99):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, 100 * q)))


def test_summary_reports_p90_beside_the_median_and_p99():
    results = [RequestResult(ok=True, ttft=0.1 * (i + 1), latency=0.1 * (i + 1) + 1.0, itl=[0.01 * (i + 1)] * 3,
                             prompt_tokens=8, output_tokens=4) for i in range(10)]
    results.append(RequestResult(error="HTTP 500: boom"))
    summary = summarize(results, duration=2.0)
    assert summary["completed"] == 10 and summary["failed"] == 1
    ttfts = [r.ttft for r in results[:10]]
    assert summary["ttft_ms"]["p90"] == pytest.approx(1000 * float(np.percentile(ttfts, 90)))
    assert summary["ttft_ms"]["median"] < summary["ttft_ms"]["p90"] < summary["ttft_ms"]["p99"]
    text = report(summary, "Serving Benchmark Result")
    assert "TTFT (ms) mean / median / p90 / p99:" in text and "error: HTTP 500: boom" in text
    slower = summarize([RequestResult(ok=True, ttft=2 * r.ttft, latency=2 * r.latency, itl=r.itl,
                                      prompt_tokens=8, output_tokens=4) for r in results[:10]], duration=2.0)
    assert "Pagoda / vLLM p90 TTFT:                 0.50x" in compare(summary, slower)


def test_a_chunk_brings_tokens_as_vllm_bench_serve_counts_them():
    from pagoda.bench.serve import _brings_tokens

    assert _brings_tokens([{"index": 0, "text": " the"}])
    assert _brings_tokens([{"index": 0, "text": ""}])  # a token whose text is held back: still a token
    assert _brings_tokens([{"index": 0, "delta": {"content": ""}}])
    assert _brings_tokens([{"index": 0, "delta": {"reasoning": "so"}}])
    assert not _brings_tokens([{"index": 0, "delta": {"role": "assistant", "content": ""}}])  # the role only
    assert not _brings_tokens([{"index": 0, "delta": {}, "finish_reason": "stop"}])
    assert not _brings_tokens([])  # the usage chunk
    assert not _brings_tokens(None)


def test_a_base_url_without_a_server_is_a_cli_error_naming_it():
    import socket

    from pagoda.bench.serve import main

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit, match=rf"--base-url: no model list at http://127.0.0.1:{port}/v1/models"):
        main(["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1"])


def test_a_base_url_that_is_not_an_openai_server_is_a_cli_error_naming_it():
    import http.server
    import threading

    from pagoda.bench.serve import discover_model

    class NotOpenAI(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"hello": "world"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotOpenAI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(SystemExit, match="--base-url: .* did not answer a model list"):
            discover_model(f"http://127.0.0.1:{server.server_address[1]}", None)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "jsonl", "--dataset-path", "{tmp}/missing.jsonl"], "--dataset-path: no file at {tmp}/missing.jsonl"),
    (["--tokenizer", "{tmp}"], "--tokenizer: no Hugging Face tokenizer in {tmp}"),
    (["--vllm-python", "{tmp}/no-python"], "--vllm-python {tmp}/no-python: cannot import vllm"),
])
def test_bad_inputs_are_refused_before_any_request(argv, message, tmp_path, capsys):
    """Checked with the flags, before the server is asked anything (--base-url points nowhere here)."""
    from pagoda.bench.serve import main

    with pytest.raises(SystemExit) as exited:
        main(["--base-url", "http://127.0.0.1:9", *[a.format(tmp=tmp_path) for a in argv]])
    assert exited.value.code == 2
    assert f"pagoda bench serve: error: {message.format(tmp=tmp_path)}" in capsys.readouterr().err


@pytest.mark.parametrize("line, problem", [("not json", "not JSON"), ('{"text": "hi"}', "every line needs")])
def test_a_bad_jsonl_line_is_named(line, problem, tmp_path):
    from pagoda.bench.serve import jsonl_requests

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=f"prompts.jsonl, line 3: {problem}"):
        jsonl_requests(str(path), None, 16)
