"""Schemathesis against a live `pagoda serve`: requests generated from the published OpenAPI document,
valid and invalid. No answer is a server error, every status and body is the one the document
describes (400 for bad bodies, in OpenAI's error shape), every schema-violating request is refused.

The `positive_data_acceptance` check is left out: limits the schema cannot state (token ids within the
vocabulary, prompt plus max_tokens within the context, top_logprobs only with logprobs) make some
schema-valid requests a correct 400.

`PAGODA_FUZZ_EXAMPLES` (default 15) sets examples per operation; `PAGODA_FUZZ_PHASES` (default
`fuzzing`) the schemathesis phases: `make fuzz` runs every phase with many more examples."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.server, pytest.mark.fuzz]


def test_schemathesis_finds_no_mismatch(server_factory, tmp_path):
    # a short context keeps every generated request (no max_tokens: up to the context) quick
    server = server_factory("--max-model-len", "64", "--max-num-seqs", "16")
    st = Path(sys.executable).parent / "st"
    command = [str(st), "run", server.url + "/openapi.json", "--checks", "all",
               "--exclude-checks", "positive_data_acceptance", "--max-examples",
               os.environ.get("PAGODA_FUZZ_EXAMPLES", "15"), "--phases",
               os.environ.get("PAGODA_FUZZ_PHASES", "fuzzing"), "--generation-deterministic",
               "--request-timeout", "60", "--max-response-time", "60", "--no-color"]
    # run in a temporary directory: schemathesis keeps a cache of what it found in the working directory
    proc = subprocess.run(command, capture_output=True, text=True, timeout=3000, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert server.process.poll() is None, "the server died"
