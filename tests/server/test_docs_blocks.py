"""The README's and docs' code blocks, the first thing a newcomer runs: every python, bash, console and sh
block either runs here, as written, or is marked, on the line before its fence, with
`<!-- not run by tests: WHY -->` (a GPU, a cluster, Kubernetes, the Hub, checkpoints a test cannot write).

How blocks run (each in a subprocess, on the default model):
- python blocks as scripts; bash blocks with bash -e; console blocks are their `$ ` commands (with their
  `\\` continuations) run by bash -e, the lines they print being left out.
- Blocks that talk to a server run against one `pagoda serve` of the default model started here on a free
  port, not 8000 (other servers share this machine): `localhost:8000`, `127.0.0.1:8000` and `--port 8000`
  become that port. The commands that start such a server (`make serve`, `pagoda serve --port 8000 &`)
  are that server, and are left out.
- Substituted model paths (the only other change): in docs/speculative-decoding.md the draft
  `/models/small-draft` is the default model itself.
- A block that continues the one above it (docs/server.md's embeddings use its `client`) runs after it.
"""

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from live_server import free_port

from pagoda.config.default_model import default_model_path

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = ("python", "bash", "console", "sh")
NOT_RUN = re.compile(r"<!-- not run by tests: (.+?) -->\s*$")
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.S | re.M)
SERVER_STARTS = ("make serve", "pagoda serve --port 8000 &")
SUBSTITUTIONS = {"/models/small-draft": "{default_model}"}
CONTINUES_ABOVE: set[tuple[str, str]] = set()  # (file, a block's start): blocks that run after the one above
# (file, text in the block): blocks that take a minute or more on CPU each, run by make test-all (heavy); make
# test runs the others, docs/speculative-decoding.md's LLM() on the default model and docs/server.md's console ones
HEAVY: set[tuple[str, str]] = {
    ("README.md", "llm = LLM()"),  # the quick start: LLM() and generate in one process
    ("docs/engine-args.md", "engine = AsyncLLMEngine.from_engine_args(engine_args)"),
    ("docs/server.md", "$ pagoda bench serve --base-url http://127.0.0.1:8000"),
}


@dataclass
class Block:
    path: str  # relative to the repository
    line: int
    language: str
    text: str
    not_run: str | None  # why, when marked

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def uses_server(self) -> bool:
        return ":8000" in self.text or "--port 8000" in self.text


def blocks() -> list[Block]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) not in LANGUAGES:
                continue
            line = text[:m.start()].count("\n") + 1
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marked = NOT_RUN.search(before)
            found.append(Block(str(doc.relative_to(ROOT)), line, m.group(1), m.group(2),
                               marked.group(1) if marked else None))
    return found


def console_commands(text: str) -> str:
    """The `$ ` commands of a console block and their continuations, without what they print."""
    commands, continuing = [], False
    for line in text.splitlines():
        if line.startswith("$ ") or continuing:
            commands.append(line[2:] if line.startswith("$ ") else line)
            continuing = line.rstrip().endswith("\\")
    return "\n".join(commands)


def script_of(block: Block, port: int, above: Block | None) -> str:
    text = console_commands(block.text) if block.language == "console" else block.text
    text = "\n".join(line for line in text.splitlines() if not line.strip().startswith(SERVER_STARTS))
    for old, new in SUBSTITUTIONS.items():
        text = text.replace(old, new.format(default_model=default_model_path()))
    text = (text.replace("localhost:8000", f"127.0.0.1:{port}").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
            .replace("--port 8000", f"--port {port}"))
    if above is not None:
        text = script_of(above, port, None) + "\n" + text
    return text


def continued(block: Block, all_blocks: list[Block]) -> Block | None:
    if not any(block.path == path and block.text.startswith(start) for path, start in CONTINUES_ABOVE):
        return None
    earlier = [b for b in all_blocks if b.path == block.path and b.line < block.line and b.language == block.language]
    return earlier[-1]


def names(block: Block, entry: tuple[str, str]) -> bool:
    path, text = entry
    return block.path == path and text in block.text


def heavy(block: Block) -> bool:
    return any(names(block, entry) for entry in HEAVY)


ALL = blocks()
RUN = [b for b in ALL if b.not_run is None]


def test_every_block_runs_here_or_says_why_not():
    assert len(ALL) > 20 and len(RUN) >= 8, [b.name for b in ALL]
    for block in ALL:
        if block.not_run is not None:
            assert len(block.not_run) > 10, block.name
    for entry in HEAVY:  # a block edited away from its entry would otherwise fall back into make test unseen
        assert sum(names(b, entry) for b in RUN) == 1, f"{entry} names no block that runs, or several"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`make serve`: pagoda serve on the default model, on a free port."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("docs-serve") / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--host", "127.0.0.1",
                                    "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        deadline = time.monotonic() + 600
        while True:
            assert process.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield port
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@pytest.mark.parametrize("block", [pytest.param(b, id=b.name, marks=[pytest.mark.heavy] if heavy(b) else [])
                                   for b in RUN])
def test_block_runs_as_written(block, request, tmp_path):
    port = request.getfixturevalue("server") if block.uses_server or continued(block, ALL) else 0
    script = script_of(block, port, continued(block, ALL))
    if block.language == "python":
        command = [sys.executable, "-c", script]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", script]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert result.returncode == 0, f"{block.name}:\n{script}\n--- stderr:\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
