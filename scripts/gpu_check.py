"""The body of scripts/gpu-check.sh: Pagoda's GPU path checked in one run of a few minutes (docs/gpu.md).

Standard library only at the top, so that it starts on any Python: every step that needs torch runs in a
child process with its own time limit, and a step that fails, hangs or crashes is named in the results
without stopping the steps after it. Steps go in order of value; the JSON of figures is rewritten after each
one, so a run cut short still returns what it measured.

    gpu_check.py install --wheels DIR --target DIR   the wheels whose modules this Python lacks, unpacked
    gpu_check.py run --out DIR [--wheels DIR --target DIR] [--dry-run]
                                                     (install, then) every step, results under DIR
    gpu_check.py plan [--dry-run]                    the steps and their commands, without running them
    gpu_check.py check-args [...]                    the arguments parsed and checked, nothing run
"""

import argparse
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEEL_LIST = ROOT / "scripts" / "gpu-wheels.txt"

# What the lent GPU machine has (Python 3.12.3, no network): its packages' top-level modules, with those of
# their own dependencies. The check brings everything else it imports as wheels (scripts/gpu-wheels.txt);
# tests/unit/test_gpu_check.py holds the two lists against the modules the check imports.
MACHINE_HAS = {
    "torch", "torchgen", "functorch", "triton", "transformers", "safetensors", "tokenizers", "huggingface_hub",
    "accelerate", "peft", "numpy", "jinja2", "prometheus_client", "httpx", "aiohttp", "psutil", "yaml",
    "pytest", "_pytest", "pytest_timeout", "xdist",
    # their dependencies
    "typing_extensions", "filelock", "fsspec", "packaging", "regex", "tqdm", "markupsafe", "httpcore",
    "certifi", "sympy", "networkx", "mpmath", "multidict", "yarl", "aiosignal", "frozenlist", "attr",
    "aiohappyeyeballs", "propcache", "pluggy", "iniconfig", "execnet", "pygments", "typer", "hf_xet",
    "httpx2", "httpcore2", "truststore", "setuptools", "pkg_resources",
}

# the kernel tier's files that test the CPU's C++ kernels, not Triton's (they need a compiler, ninja, qemu)
CPU_ONLY_KERNEL_TESTS = ["test_cpu_attention_variants.py", "test_cpu_isa_levels.py", "test_neon_kernels_qemu.py"]

# SmolLM2-135M-Instruct's shape (the default model): its GGUF file (98 MB) cannot travel to the GPU machine
# within the 64 MiB the tree may carry, so the throughput step writes random weights of the same shape.
DEFAULT_MODEL_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                           num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                           rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)

# checkpoints the steps write (a 270 MB one among them) stay out of OUT, whose every file comes back
SCRATCH = Path(tempfile.gettempdir()) / "pagoda-gpu-check"

DEFAULT_BUDGET_S = 450  # the 8 minutes, less the install and the machine's own overhead
LOG_CAP = 12 << 20  # bytes of step output kept in gpu-check.log
DRY_RUN_SLOWER = 4  # the rehearsal's limits and budget: the interpreter on two shared CPU cores


# ---- the wheel list ----

@dataclass
class WheelSpec:
    requirement: str  # name==version
    modules: list[str]

    @property
    def name(self) -> str:
        return self.requirement.split("==")[0]

    @property
    def version(self) -> str:
        return self.requirement.split("==")[1]

    def file_prefix(self) -> str:
        """A wheel file name's start: the name normalised as wheels spell it (PEP 427), then the version."""
        return f"{re.sub(r'[-_.]+', '_', self.name).lower()}-{self.version}-"


def read_wheel_list(path: Path = WHEEL_LIST) -> list[WheelSpec]:
    specs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        requirement, _, comment = line.partition("#")
        requirement = requirement.strip()
        if not requirement:
            continue
        modules = comment.split("modules:", 1)[1].replace(",", " ").split() if "modules:" in comment else []
        if "==" not in requirement or not modules:
            raise ValueError(f"{path}:{number}: expected 'name==version  # modules: module ...', got {line!r}")
        specs.append(WheelSpec(requirement, modules))
    return specs


def find_wheel(spec: WheelSpec, wheels: Path) -> Path | None:
    found = sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(spec.file_prefix()))
    return found[0] if found else None


def install(wheels: Path, target: Path, specs: list[WheelSpec] | None = None) -> list[dict]:
    """Unpacks into target each listed wheel one of whose modules this Python cannot find (a wheel is a zip
    of its files as they lie in site-packages): nothing the machine has is shadowed, and no pip is needed."""
    target.mkdir(parents=True, exist_ok=True)
    report = []
    for spec in read_wheel_list() if specs is None else specs:
        missing = [m for m in spec.modules if importlib.util.find_spec(m) is None]
        wheel = find_wheel(spec, wheels)
        if not missing:
            report.append({"wheel": spec.requirement, "action": "present on this machine"})
        elif wheel is None:
            report.append({"wheel": spec.requirement, "action": f"MISSING from {wheels} (run make gpu-wheels)"})
        else:
            with zipfile.ZipFile(wheel) as z:
                z.extractall(target)
            report.append({"wheel": spec.requirement, "action": f"installed ({', '.join(missing)} missing)",
                           "file": wheel.name})
    importlib.invalidate_caches()
    return report


# ---- the steps ----

@dataclass
class Step:
    name: str
    what: str
    argv: list[str]
    limit_s: int
    env: dict[str, str] = field(default_factory=dict)
    junit: str | None = None  # a junit XML file under OUT the step writes
    json_file: str | None = None  # a JSON file under OUT the step writes


def pytest_argv(paths: list[str], out: Path, junit: str, per_test_s: int, workers: int, extra=()) -> list[str]:
    argv = [sys.executable, "-m", "pytest", *paths, "-p", "no:cacheprovider", "-q", "-rfE",
            f"--timeout={per_test_s}", f"--junitxml={out / junit}", "-o", "addopts=", *extra]
    if workers > 1 and importlib.util.find_spec("xdist") is not None:  # pytest-xdist: the GPU machine's, or not
        argv += ["-n", str(workers)]
    return argv


def cli_argv(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from pagoda.entrypoints.cli import main; sys.exit(main())", *args]


def plan(out: Path, dry_run: bool, workers: int) -> list[Step]:
    """The steps in order of value. The dry run (a CPU through Triton's interpreter) takes the same paths
    with smaller selections: it proves the imports, the wheels and the files, not the kernels' speed."""
    kernel_dir = ROOT / "tests" / "kernels"
    slower = DRY_RUN_SLOWER if dry_run else 1
    ignore = [f"--ignore={kernel_dir / name}" for name in CPU_ONLY_KERNEL_TESTS]
    engine_env = {}
    if dry_run:
        # Triton 3.6's interpreter (the GPU machine's Triton) cannot run the attention kernels (a loop bound
        # of shape [1], which 3.9's interpreter and every compiler take): the rehearsal compiles every kernel
        # for sm_80/86/90 with it instead, and runs the engine tier on the torch backend (docs/gpu.md)
        kernel_paths = [str(kernel_dir / f) for f in ("test_kv_cache.py", "test_gpu_compile.py")]
        per_test_s = 900
        engine_env = {"PAGODA_GPU_TEST_BACKEND": "torch"}
    else:
        # on the device the kernels compile for it as they run: the compile-only check adds nothing but time
        kernel_paths, per_test_s = [str(kernel_dir)], 90
        ignore.append(f"--ignore={kernel_dir / 'test_gpu_compile.py'}")
    model_dir = SCRATCH / "default-shape-model"
    throughput = ["--num-requests", "64", "--hf-sequential-requests", "4", "--hf-batch-size", "16"]
    if dry_run:  # the default shape on two CPU cores: a few short requests
        throughput = ["--num-requests", "4", "--prompt-len", "16", "32", "--output-len", "8", "8",
                      "--hf-sequential-requests", "1", "--hf-batch-size", "4"]
    # decode first (the JSON grows row by row): batch 1 and 64 at 1k, 8k and 32k of context, both layouts
    bench_kernels = ["--batch-sizes", "1", "64", "--context-lens", "1024", "8192", "32768",
                     "--iters", "10", "--warmup", "2"]
    here = str(Path(__file__).resolve())
    steps = [
        Step("environment", "nvidia-smi; Python, torch, triton, CUDA; the torch names the runtime uses",
             [sys.executable, here, "environment", "--out", str(out)], 60, json_file="environment.json"),
        Step("kernels", "the kernel tier on the device (compiled Triton kernels vs the torch references)",
             pytest_argv(kernel_paths, out, "junit-kernels.xml", per_test_s, workers, ignore), 200,
             junit="junit-kernels.xml"),
        Step("engine", "the engine on the Triton backend vs transformers: Llama, Qwen3, MoE, sliding window, "
                       "chunked prefill + prefix cache, fp8 KV cache, LoRA",
             pytest_argv([str(ROOT / "tests" / "gpu")], out, "junit-engine.xml", 150 * slower, 1), 150,
             env=engine_env, junit="junit-engine.xml"),
        Step("cuda-graphs", "decode CUDA graphs vs eager on the Triton engine: greedy tokens equal; TPOT at batch "
                            "1 and 32 with and without graphs (the default model's shape, bf16); capture time "
                            "and memory",
             [sys.executable, here, "cuda-graphs", "--model-dir", str(model_dir), "--out", str(out)], 120,
             json_file="cuda-graphs.json"),
        Step("bench-kernels", "pagoda bench kernels, short: decode GB/s vs HBM, prefill TFLOP/s",
             cli_argv("bench", "kernels", *bench_kernels, "--json", str(out / "bench-kernels.json")), 120,
             json_file="bench-kernels.json"),
        Step("bench-throughput", "pagoda bench throughput, the default model's shape in bf16, with "
                                 "transformers' generate as the floor",
             [sys.executable, here, "throughput", "--model-dir", str(model_dir), "--out", str(out), "--",
              *throughput], 150, json_file="bench-throughput.json"),
        Step("serve", "pagoda serve on the device (engine core process), one completion over HTTP",
             [sys.executable, here, "serve-smoke", "--out", str(out)], 60),
        Step("data-parallel", "a tiny MoE with experts split over the ranks (enable_expert_parallel) vs not: "
                              "greedy tokens equal, tokens/s of each; DP=1 with EP over TP on one GPU, DP=2 + EP "
                              "too where two GPUs answer",
             [sys.executable, here, "data-parallel"], 60),
        Step("pd-disaggregation", "P/D over NIXL with VRAM KV caches: a prefill engine and a decode engine in two "
                                  "processes, greedy tokens equal one engine's; pagoda bench kv-transfer "
                                  "--device cuda (a Llama-3-8B layout): READ GB/s and latency",
             [sys.executable, here, "pd-disaggregation"], 90),
    ]
    if dry_run:  # the interpreter on a shared CPU: the same steps, slower
        for step in steps:
            step.limit_s *= DRY_RUN_SLOWER
    return steps


# ---- the run ----

class Results:
    """gpu-check.json: rewritten whole after every change, so a cut-short run still leaves valid JSON."""

    def __init__(self, path: Path, header: dict):
        self.path = path
        self.data = {**header, "steps": {}}
        self.save()

    def save(self):
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        tmp.replace(self.path)

    def step(self, name: str, **fields):
        self.data["steps"].setdefault(name, {}).update(fields)
        self.save()


class Log:
    """gpu-check.log, and stdout. A file over 16 MiB would not come back: past LOG_CAP only the check's own
    lines (steps, totals) go on into the file."""

    def __init__(self, path: Path):
        self.file = path.open("a", buffering=1)
        self.lock = threading.Lock()
        self.written = 0
        self.capped = False

    def write(self, text: str, own: bool = False):
        with self.lock:
            sys.stdout.write(text)
            sys.stdout.flush()
            if self.written + len(text) > LOG_CAP and not own:
                if not self.capped:
                    self.file.write(f"\n[gpu-check.log: over {LOG_CAP >> 20} MiB; steps' output goes on to "
                                    "stdout only]\n")
                    self.capped = True
                return
            self.file.write(text)
            self.written += len(text)


def run_step(step: Step, limit_s: float, log: Log, env: dict) -> tuple[int | None, float, bool]:
    """Runs one step in its own process group, its output into the log; (exit code, seconds, timed out)."""
    log.write(f"\n==== {step.name}: {step.what} (limit {limit_s:.0f} s)\n$ {shlex.join(step.argv)}\n", own=True)
    start = time.monotonic()
    proc = subprocess.Popen(step.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**env, **step.env}, start_new_session=True, text=True, errors="replace")
    reader = threading.Thread(target=lambda: [log.write(line) for line in proc.stdout], daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(limit_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever the step left running in its group
    except (ProcessLookupError, PermissionError):
        pass
    reader.join(10)
    if timed_out:
        log.write(f"\n[{step.name}: stopped after {limit_s:.0f} s]\n", own=True)
    seconds = time.monotonic() - start
    return proc.returncode, seconds, timed_out


def junit_counts(path: Path) -> dict:
    """Totals and the failed tests' ids from pytest's junit XML."""
    import xml.etree.ElementTree as ET

    if not path.exists():
        return {"error": f"{path.name} not written"}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = []
    for case in root.iter("testcase"):
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            message = (problem.get("message") or "").splitlines()[:1]
            failed.append(f"{case.get('classname')}::{case.get('name')}: {message[0][:300] if message else ''}")
    counts["failed_tests"] = failed[:40]
    return counts


def summarize_bench_kernels(path: Path) -> dict:
    if not path.exists():
        return {"note": "no JSON written (no CUDA device: the benchmark skips)"}
    data = json.loads(path.read_text())
    results = data["results"]

    def best(kernel, key):
        rows = [r for r in results if r["kernel"] == kernel]
        return max(rows, key=lambda r: r[key]) if rows else None

    out = {"device": data["device"], "dtype": data["dtype"], "cases": len(results)}
    long_decode = [r for r in results if r["kernel"] == "decode" and r["note"] == "dispatch"
                   and int(r["shape"].split("ctx")[1]) >= 8192]
    if long_decode:
        out["decode_long_context_pct_peak_gbs"] = [min(r["pct_peak_gbs"] for r in long_decode),
                                                   max(r["pct_peak_gbs"] for r in long_decode)]
    for kernel, key in (("decode", "gbs"), ("prefill", "tflops"), ("mixed", "tflops"), ("kv-write", "gbs")):
        row = best(kernel, key)
        if row:
            out[f"best_{kernel}"] = {k: row[k] for k in ("layout", "variant", "shape", "microseconds", "gbs",
                                                        "pct_peak_gbs", "tflops", "pct_peak_tflops",
                                                        "torch_microseconds")}
    return out


def summarize_throughput(path: Path) -> dict:
    if not path.exists():
        return {"note": "no JSON written"}
    data = json.loads(path.read_text())
    rows = {r["name"]: r for r in data["results"]}
    out = {"model": data.get("model"), "rows": {name: {k: r.get(k) for k in ("output_tokens_per_s", "seconds",
                                                                             "requests", "peak_memory_gib")}
                                                for name, r in rows.items()}}
    pagoda = data["results"][0]
    floor = [r for r in data["results"][1:] if r["name"].startswith("transformers")]
    if floor:
        best_hf = max(r["output_tokens_per_s"] for r in floor)
        out["pagoda_over_best_transformers"] = pagoda["output_tokens_per_s"] / best_hf
        out["above_the_floor"] = pagoda["output_tokens_per_s"] > best_hf
    for key in ("tpot_ms", "decode_step_ms", "decode_flops_per_s", "dtype", "device"):
        out[key] = pagoda.get(key)
    return out


def run(args) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "gpu-check.log")
    started = time.monotonic()
    report = install(Path(args.wheels), Path(args.target)) if args.wheels else "not asked (--wheels not given)"
    results = Results(out / "gpu-check.json", {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "dry_run": args.dry_run, "budget_s": args.budget,
        "git": git_describe(), "python": sys.version.split()[0], "install": report,
    })
    log.write(f"gpu-check: Python {sys.version.split()[0]} at {sys.executable}; wheels: "
              + (json.dumps(report, indent=1) if isinstance(report, list) else report) + "\n")
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    # the C++ CPU kernels are no part of the GPU path, and their first build takes minutes (and ninja, which
    # the GPU machine lacks): the CPU-side references use torch's ops
    env.setdefault("PAGODA_CPU_KERNELS", "0")
    # Pagoda from the source tree, then the unpacked wheels (which hold only what this Python lacks)
    paths = [str(ROOT / "runtime"), str(ROOT / "operator")] + ([str(Path(args.target).resolve())]
                                                               if args.wheels else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if args.dry_run:  # Triton's interpreter stands in for the GPU
        env["PAGODA_GPU_CHECK_DRY_RUN"] = "1"
        env["TRITON_INTERPRET"] = "1"
    steps = [s for s in plan(out, args.dry_run, args.workers) if not args.only or s.name in args.only]
    failed = []
    for step in steps:
        left = args.budget - (time.monotonic() - started)
        if left < 15:
            results.step(step.name, status="not run: out of time", what=step.what)
            failed.append(step.name)
            continue
        results.step(step.name, status="running", what=step.what)
        rc, seconds, timed_out = run_step(step, min(step.limit_s, left), log, env)
        status = "timed out" if timed_out else ("passed" if rc == 0 else f"failed (exit {rc})")
        fields = {"status": status, "seconds": round(seconds, 1)}
        try:
            if step.junit:
                fields["tests"] = junit_counts(out / step.junit)
            if step.name == "environment" and (out / "environment.json").exists():
                fields.update(json.loads((out / "environment.json").read_text()))
                (out / "environment.json").unlink()  # folded into gpu-check.json: fewer files come back
            if step.name == "cuda-graphs" and (out / "cuda-graphs.json").exists():
                fields["summary"] = json.loads((out / "cuda-graphs.json").read_text())
                (out / "cuda-graphs.json").unlink()  # folded into gpu-check.json, as environment.json
            if step.name == "bench-kernels":
                fields["summary"] = summarize_bench_kernels(out / "bench-kernels.json")
            if step.name == "bench-throughput":
                fields["summary"] = summarize_throughput(out / "bench-throughput.json")
        except Exception as e:  # a summary that cannot be read is itself a finding
            fields["summary_error"] = f"{type(e).__name__}: {e}"
        results.step(step.name, **fields)
        if status != "passed":
            failed.append(step.name)
        log.write(f"==== {step.name}: {status} in {seconds:.0f} s\n", own=True)
        if step.name == "environment" and not args.dry_run and not fields.get("cuda_available"):
            log.write("gpu-check: no CUDA device: the kernels would run interpreted and time nothing; stopping\n")
            for later in steps[steps.index(step) + 1:]:
                results.step(later.name, status="not run: no CUDA device", what=later.what)
                failed.append(later.name)
            break
    total = time.monotonic() - started
    results.data.update(finished=time.strftime("%Y-%m-%d %H:%M:%S %Z"), seconds=round(total, 1),
                        failed_steps=failed)
    results.save()
    log.write(f"\ngpu-check: {len(steps) - len(failed)} of {len(steps)} steps passed in {total:.0f} s"
              + (f"; not passed: {', '.join(failed)}" if failed else "") + f"; files in {out}:\n", own=True)
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        log.write(f"  {path.relative_to(out)}  {path.stat().st_size} bytes\n", own=True)
    return 1 if failed else 0


def git_describe() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %cs %s"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown (no git)"
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"


# ---- step bodies that run in their own process ----

# The torch names the runtime's source uses (torch.x.y, and through aliases: `import torch.nn.functional as F`,
# `from torch import nn`), each looked up on this torch: the APIs newer than the machine's torch 2.11 show.
def torch_names_used() -> list[str]:
    import ast

    names = set()
    for path in (ROOT / "runtime" / "pagoda").rglob("*.py"):
        tree = ast.parse(path.read_text())
        aliases = {"torch": "torch"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "torch":
                        names.add(a.name)
                        if a.asname:
                            aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" \
                    and not node.level:
                for a in node.names:
                    names.add(f"{node.module}.{a.name}")
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                chain = []
                inner = node
                while isinstance(inner, ast.Attribute):
                    chain.append(inner.attr)
                    inner = inner.value
                if isinstance(inner, ast.Name) and inner.id in aliases:
                    names.add(".".join([aliases[inner.id], *reversed(chain)]))
    # custom ops and classes (torch.ops.NS.op, torch.classes.NS.Cls) exist once their library loads; not torch's API
    return sorted(n for n in names if not n.startswith(("torch.ops.", "torch.classes.")))


def missing_torch_names(names: list[str]) -> list[str]:
    """The dotted names that do not resolve on this torch (submodules imported as needed)."""
    import importlib

    import torch

    missing = []
    for name in names:
        parts = name.split(".")
        obj = torch
        for i, part in enumerate(parts[1:], 1):
            # not hasattr: a lookup may raise other than AttributeError (torch.classes: RuntimeError)
            try:
                obj = getattr(obj, part)
                continue
            except Exception:
                pass
            try:
                obj = importlib.import_module(".".join(parts[: i + 1]))
            except Exception:
                # a method or attribute of an instance (torch.Tensor.x, torch.cuda.Event.y) is not a module
                missing.append(name)
                break
    return missing


def environment(args) -> int:
    out = Path(args.out)
    info: dict = {}
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        print(smi.stdout or smi.stderr)
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm,"
                                "clocks.max.memory", "--format=csv,noheader"], capture_output=True, text=True,
                               timeout=30)
        info["nvidia_smi"] = query.stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        info["nvidia_smi"] = f"not available: {e}"
        print(f"nvidia-smi: {info['nvidia_smi']}")
    import shutil

    import torch
    import transformers
    import triton

    # Triton builds its launcher with the host's C compiler (CC, else cc/gcc/clang): none, and no kernel runs
    info["c_compiler"] = next((shutil.which(c) for c in (os.environ.get("CC"), "cc", "gcc", "clang")
                               if c and shutil.which(c)), "none found")
    info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, triton=triton.__version__,
                transformers=transformers.__version__, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"sm_{props.major}{props.minor}",
                    gpu_memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count)
    names = torch_names_used()
    missing = missing_torch_names(names)
    info["torch_names_checked"] = len(names)
    info["torch_names_missing"] = missing
    from pagoda.kernels import paged_attention
    from pagoda.kernels._checks import is_interpreted

    info["kernels_interpreted"] = is_interpreted(paged_attention._mixed_batch_kernel)
    for key, value in info.items():
        print(f"{key}: {value}")
    (out / "environment.json").write_text(json.dumps(info))
    if os.environ.get("PAGODA_GPU_CHECK_DRY_RUN", "") in ("", "0") and not torch.cuda.is_available():
        print("environment: no CUDA device (nvidia-smi above; CUDA_VISIBLE_DEVICES, the driver, a CPU build of torch?)")
        return 1
    # the interpreter on a GPU machine would time nothing real: a finding, not a pass
    return 1 if torch.cuda.is_available() and info["kernels_interpreted"] else 0


def write_default_shape_model(path: Path) -> Path:
    """Random bfloat16 weights in the default model's shape, with a word-level tokenizer over its whole
    vocabulary (so every id the synthetic workload draws detokenizes)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = DEFAULT_MODEL_SHAPE["vocab_size"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[2],
                            pad_token=specials[0], unk_token=specials[0]).save_pretrained(path)
    config = LlamaConfig(**DEFAULT_MODEL_SHAPE, bos_token_id=0, eos_token_id=2, pad_token_id=0,
                         initializer_range=0.02)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def throughput(args) -> int:
    from pagoda.entrypoints.cli import main

    model = write_default_shape_model(Path(args.model_dir))
    out = Path(args.out) / "bench-throughput.json"
    code = main(["bench", "throughput", "--model", str(model), "--dtype", "bfloat16", "--json", str(out),
                 *args.bench_args]) or 0
    if not out.exists():
        return code or 1
    data = json.loads(out.read_text())
    data["model"] = ("random weights in SmolLM2-135M-Instruct's shape (the default model's GGUF cannot "
                     "travel within the tree's 64 MiB)")
    out.write_text(json.dumps(data, indent=2))
    pagoda, floor = data["results"][0], [r for r in data["results"][1:] if r["name"].startswith("transformers")]
    if pagoda["device"].startswith("cuda") and floor:
        best = max(r["output_tokens_per_s"] for r in floor)
        if pagoda["output_tokens_per_s"] <= best:
            print(f"bench throughput: Pagoda's {pagoda['output_tokens_per_s']:.0f} output tokens/s do not clear "
                  f"transformers' {best:.0f}: below the floor")
            return 1
    return code


GRAPH_TOKEN_SIZES = [1, 2, 4, 8]  # the token check's captured sizes: batches of 1 and 8 on them, 3 between, 11 above
GRAPH_TPOT_BATCHES = (1, 32)


def cuda_graphs_check(args) -> int:
    """Decode CUDA graphs (runtime/pagoda/worker/cuda_graphs.py) against eager steps on this device's engine:
    greedy tokens equal (a float32 tiny Llama, batches on, between and above the captured sizes), then TPOT at
    batch 1 and 32 with and without graphs, and what the capture cost (the default model's shape, bf16). The dry
    run takes the stand-in capture on the CPU's torch backend, the tiny model for both."""
    import gc

    import torch

    from pagoda import LLM, SamplingParams
    from pagoda.config.compilation import STAND_IN_ENV

    dry_run = os.environ.get("PAGODA_GPU_CHECK_DRY_RUN", "") not in ("", "0")
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ[STAND_IN_ENV] = "1"  # the rehearsal: the stand-in capture on the CPU
    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoints import write_tiny_model

    tiny = SCRATCH / "graphs-tiny-llama"
    if not (tiny / "config.json").exists():
        write_tiny_model(tiny, "llama")
    result: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (stand-in capture)"}
    out = Path(args.out) / "cuda-graphs.json"

    def save():
        out.write_text(json.dumps(result, indent=2))

    def free(llm):
        llm.shutdown()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    def engine(path, graphs: bool, **kwargs) -> LLM:
        return LLM(str(path), enforce_eager=not graphs, **kwargs)

    def generate(llm, prompts, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    # 1. tokens: the same prompts with graphs and eagerly
    prompts = ["Hello, my name is", "Paris is the capital of", "The quick brown fox", "a", "héllo wörld",
               "Paged attention stores keys", "San Francisco is", "Continuous batching lets new", "numbers 0123",
               "The lazy dog", "Kubernetes"]
    tokens, replays = {}, {}
    for graphs in (False, True):
        llm = engine(tiny, graphs, dtype="float32", kv_cache_memory=0.05, max_num_seqs=16,
                     compilation_config={"cudagraph_capture_sizes": GRAPH_TOKEN_SIZES})
        tokens[graphs] = {batch: generate(llm, prompts[:batch], 12) for batch in (1, 3, 8, 11)}
        runner_graphs = llm.engine.executor.runner.graphs
        if graphs:
            replays = dict(runner_graphs.stats.replays_by_size) if runner_graphs is not None else None
        free(llm)
    equal = {str(batch): tokens[True][batch] == tokens[False][batch] for batch in tokens[False]}
    result["tokens"] = {"model": "tiny random Llama, float32", "captured_sizes": GRAPH_TOKEN_SIZES,
                        "equal_by_batch": equal, "replays_by_size": replays}
    save()
    ok = all(equal.values()) and bool(replays) and set(replays) == {1, 4, 8}
    print(f"cuda-graphs: tokens equal by batch {equal}; replays by size {replays}")

    # 2. TPOT at batch 1 and 32, with and without graphs (the default ladder up to max_num_seqs 32)
    if dry_run:
        model, dtype, steps = tiny, "float32", 4
        words = prompts
    else:
        model, dtype, steps = write_default_shape_model(Path(args.model_dir)), "bfloat16", 64
        words = [" ".join(f"w{100 + 37 * i + j}" for j in range(16)) for i in range(32)]
    batch_prompts = [words[i % len(words)] for i in range(max(GRAPH_TPOT_BATCHES))]
    tpot: dict = {}
    for graphs in (False, True):
        name = "graphs" if graphs else "eager"
        llm = engine(model, graphs, dtype=dtype, kv_cache_memory=2.0 if cuda else 0.05, max_num_seqs=32)
        stats = llm.engine.executor.runner.graphs
        if graphs:
            if stats is None:
                print("cuda-graphs: no graphs captured on the default-shape model")
                ok = False
            else:
                result["capture"] = {"sizes": list(stats.sizes), "seconds": round(stats.stats.capture_seconds, 2),
                                     "memory_mib": None if stats.stats.capture_bytes is None
                                     else round(stats.stats.capture_bytes / 2**20, 1)}
        for batch in GRAPH_TPOT_BATCHES:
            chosen = batch_prompts[:batch]
            generate(llm, chosen, steps + 1)  # warm-up
            best = float("inf")
            for _ in range(2):
                start = time.perf_counter()
                generate(llm, chosen, 1)
                prefill = time.perf_counter() - start
                start = time.perf_counter()
                generate(llm, chosen, steps + 1)
                best = min(best, (time.perf_counter() - start - prefill) / steps)
            tpot.setdefault(f"batch_{batch}", {})[f"{name}_ms"] = round(best * 1e3, 3)
        free(llm)
        result["tpot"] = {"model": "tiny random Llama (the rehearsal: CPU timings, meaningless)" if dry_run else
                          "random weights in SmolLM2-135M-Instruct's shape, bfloat16", "decode_steps": steps, **tpot}
        save()
    for row in tpot.values():
        if "graphs_ms" in row and row.get("eager_ms"):
            row["speedup"] = round(row["eager_ms"] / row["graphs_ms"], 2)
    result["passed"] = ok
    save()
    print(f"cuda-graphs: {json.dumps(result)}")
    return 0 if ok else 1


def serve_smoke(args) -> int:
    """pagoda serve on a tiny checkpoint (the device's default backend), /health, one completion."""
    import socket

    import httpx

    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoints import write_tiny_model

    model = write_tiny_model(SCRATCH / "serve-model", "llama")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # in this step's process group: a step stopped at its limit takes the server with it
    server = subprocess.Popen(cli_argv("serve", str(model), "--host", "127.0.0.1", "--port", str(port),
                                       "--kv-cache-memory", "0.05", "--max-model-len", "256",
                                       "--max-num-seqs", "16"))  # 5 decode graphs captured before /health
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 50
        while True:
            if server.poll() is not None:
                print(f"serve-smoke: the server exited with {server.returncode}")
                return 1
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                print("serve-smoke: /health not 200 within 50 s")
                return 1
            time.sleep(0.5)
        name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        reply = httpx.post(f"{url}/v1/completions", timeout=30, json={
            "model": name, "prompt": "Hello, my name is", "max_tokens": 8, "temperature": 0})
        print(f"serve-smoke: {reply.status_code} {reply.text[:400]}")
        return 0 if reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8 else 1
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def data_parallel_check(args) -> int:
    """Data parallelism with experts over every rank (docs/distributed.md) on this device: a float32 tiny
    Mixtral (4 experts, top-2), its experts split over the ranks (enable_expert_parallel) against one process
    without: greedy tokens equal, and each one's generated tokens/s over a batch. One GPU holds DP=1 (EP over
    its TP group); DP=2 + EP runs where two GPUs answer (NCCL takes one device per rank), and in the CPU
    rehearsal. Prints one JSON line."""
    import gc

    import torch

    from pagoda import LLM, SamplingParams

    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoints import write_tiny_model

    cuda = torch.cuda.is_available()
    model = SCRATCH / "dp-tiny-mixtral"
    if not (model / "config.json").exists():
        write_tiny_model(model, "mixtral", num_layers=2)
    prompts = [f"Prompt {i}: the experts of layer {i % 3} answer" for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def run(**kwargs) -> tuple[list, float]:
        llm = LLM(str(model), dtype="float32", kv_cache_memory=0.2 if cuda else 0.05, max_num_seqs=16, **kwargs)
        try:
            # a warm-up batch of the timed one's size: Triton compiles per shape, and the first engine of the
            # process would otherwise pay the compiles the later ones find cached
            llm.generate([p.replace("Prompt", "Warm-up") for p in prompts], SamplingParams(temperature=0.0,
                         max_tokens=4), use_tqdm=False)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
        finally:
            llm.shutdown()
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        tokens = [o.outputs[0].token_ids for o in outs]
        return tokens, sum(map(len, tokens)) / seconds

    result: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (rehearsal: timings meaningless)",
                    "model": "tiny random Mixtral, float32", "requests": len(prompts), "max_tokens": 32}
    reference, result["one_process_tok_s"] = run()
    shapes = {"dp1_ep": dict(enable_expert_parallel=True)}
    if not cuda or torch.cuda.device_count() >= 2:  # (the rehearsal: two CPU processes over gloo)
        shapes["dp2_ep"] = dict(enable_expert_parallel=True, data_parallel_size=2)
    else:
        result["dp2_ep"] = "skipped: DP=2 needs two devices (one GPU: DP=1 with EP over TP is the comparison)"
    ok = True
    for name, kwargs in shapes.items():
        tokens, rate = run(**kwargs)
        equal = tokens == reference
        ok &= equal
        result[name] = {"tokens_equal_one_process": equal, "tok_s": round(rate, 1),
                        "vs_one_process": round(rate / result["one_process_tok_s"], 2)}
    result["one_process_tok_s"] = round(result["one_process_tok_s"], 1)
    result["passed"] = ok
    print(f"data-parallel: {json.dumps(result)}")
    return 0 if ok else 1


# the prefill engine's process (pd-disaggregation): prompts as JSON on stdin, its kv_transfer_params on stdout
_PD_PREFILL_PROCESS = """
import json, sys
from pagoda import LLM, SamplingParams
llm = LLM(sys.argv[1], kv_transfer_config=json.loads(sys.argv[2]), **json.loads(sys.argv[3]))
print("PD ready", flush=True)
prompts = json.loads(sys.stdin.readline())
outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1,
                                               kv_transfer_params={"do_remote_decode": True}), use_tqdm=False)
print("PD " + json.dumps([o.kv_transfer_params for o in outputs]), flush=True)
sys.stdin.readline()  # held until the decode side has pulled: its engine frees the blocks then
llm.shutdown()
"""


def pd_disaggregation_check(args) -> int:
    """P/D disaggregation (docs/disaggregation.md) on this device: a float32 tiny Llama served by a prefill
    engine (kv_producer) in its own process and a decode engine (kv_consumer) here, their KV caches in VRAM, so
    the NIXL READ moves GPU memory (UCX: cuda_ipc or cuda_copy); the decode engine's greedy tokens must equal a
    single engine's, with every prompt pulled, none recomputed. Then `pagoda bench kv-transfer --device cuda` on
    a Llama-3-8B KV layout (32 layers x 8 KV heads x 128, bf16) for GB/s. The CPU rehearsal takes the same paths
    in DRAM at a tiny layout. Prints one JSON line."""
    import gc

    import torch

    from pagoda.kv_transfer.nixl_backend import nixl_api

    try:
        nixl_api()
    except ImportError as e:  # the wheel for this torch's CUDA: scripts/gpu-wheels.txt, make gpu-wheels
        print(f"pd-disaggregation: {e}")
        return 1
    from pagoda import LLM, SamplingParams

    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoints import write_tiny_model

    cuda = torch.cuda.is_available()
    model = SCRATCH / "pd-tiny-llama"
    if not (model / "config.json").exists():
        write_tiny_model(model, "llama")
    device = "cuda" if cuda else "cpu"
    common = dict(dtype="float32", kv_cache_memory=0.05, block_size=16)
    prompts = [f"Prompt {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 4) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    result: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (rehearsal: DRAM, timings meaningless)",
                    "model": "tiny random Llama, float32", "requests": len(prompts), "max_tokens": 16}

    with LLM(str(model), **common) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    gc.collect()
    producer = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": device,
                "kv_connector_extra_config": {"side_channel_port": 0}}
    consumer = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": device}
    # in this step's process group: a step stopped at its limit takes the prefill engine with it
    prefill = subprocess.Popen([sys.executable, "-c", _PD_PREFILL_PROCESS, str(model), json.dumps(producer),
                                json.dumps(common)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def answer():
        for line in prefill.stdout:
            if line.startswith("PD "):
                return line[3:].strip()
        raise RuntimeError(f"the prefill engine's process ended (exit {prefill.wait()})")

    try:
        if answer() != "ready":
            raise RuntimeError("the prefill engine's process did not start")
        prefill.stdin.write(json.dumps(prompts) + "\n")
        prefill.stdin.flush()
        transfer_params = json.loads(answer())
        with LLM(str(model), kv_transfer_config=consumer, enable_prefix_caching=False, **common) as llm:
            start = time.perf_counter()
            outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                         kv_transfer_params=p) for p in transfer_params],
                                use_tqdm=False)
            result["decode_seconds"] = round(time.perf_counter() - start, 3)
            scheduler_stats = llm.engine.core.kv_connector.stats
            worker_stats = llm.engine.executor.runner.kv_connector.stats
            result["kv_memory"] = llm.engine.executor.runner.kv_connector.mem_type
            result["transfers"] = worker_stats.num_transfers
            result["bytes_transferred"] = worker_stats.bytes_transferred
            result["recomputed_prompts"] = scheduler_stats.num_recomputed_prompts
        tokens = [o.outputs[0].token_ids for o in outs]
    finally:
        try:
            prefill.stdin.close()
            prefill.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            prefill.kill()
            prefill.wait()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    result["tokens_equal_one_engine"] = tokens == reference
    ok = (result["tokens_equal_one_engine"] and result["transfers"] == len(prompts)
          and result["recomputed_prompts"] == 0 and result["kv_memory"] == ("VRAM" if cuda else "DRAM"))

    shape = (["--num-layers", "32", "--num-kv-heads", "8", "--head-size", "128", "--blocks", "1", "16", "128",
              "--iters", "10"] if cuda else
             ["--num-layers", "2", "--num-kv-heads", "2", "--head-size", "16", "--blocks", "1", "8", "--iters", "3"])
    bench_json = SCRATCH / "pd-kv-transfer.json"
    bench_json.unlink(missing_ok=True)
    bench = subprocess.run(cli_argv("bench", "kv-transfer", "--device", device, "--dtype", "bfloat16", *shape,
                                    "--output-json", str(bench_json)), capture_output=True, text=True)
    print(bench.stdout, end="")
    if bench.returncode != 0 or not bench_json.exists():
        print(bench.stderr[-3000:])
        result["kv_transfer_bench"] = f"failed (exit {bench.returncode})"
        ok = False
    else:
        report = json.loads(bench_json.read_text())
        result["kv_transfer_bench"] = {"mem_type": report["mem_type"], "block_bytes": report["block_bytes"],
                                       "results": [{k: round(v, 3) if isinstance(v, float) else v
                                                    for k, v in r.items()} for r in report["results"]]}
    if cuda:  # which UCX protocols the READs took (2026-11-30 on an H200: 0.3-0.4 GB/s, not CUDA IPC's pace)
        print_ucx_protocols(cli_argv("bench", "kv-transfer", "--device", device, "--dtype", "bfloat16",
                                     *shape[:6], "--blocks", "16", "--iters", "2"))
    result["passed"] = ok
    print(f"pd-disaggregation: {json.dumps(result)}")
    return 0 if ok else 1


def print_ucx_protocols(argv: list[str], most: int = 120) -> None:
    """Runs argv with UCX_PROTO_INFO=y (UCX prints the protocol it selects for each operation) and prints the
    selection lines that involve GPU memory: a diagnosis for the log, never a failure."""
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "UCX_PROTO_INFO": "y"})
    except subprocess.TimeoutExpired:
        print("pd-disaggregation: UCX protocol info: timed out")
        return
    lines, keep, endpoint = [], False, ""
    for line in (run.stdout + run.stderr).splitlines():
        text = line.split("]   ", 1)[-1]  # past UCX's "[time] [host:pid:thread]" prefix
        if "cfg#" in text:  # a table's first line: the endpoint (self, intra-node, inter-node)
            endpoint, keep = text, False
        elif " from " in text and "memory" in text:  # its title: the operation and the memory types
            keep = "cuda" in text.lower()
            lines += [endpoint, text] if keep else []
        elif keep and text.startswith("|") and "Description" not in text:
            lines.append(text)
    print(f"pd-disaggregation: UCX protocols for GPU memory ({len(lines)} lines, the first {most}):")
    print("\n".join(lines[:most]))


# ---- the command line ----

def parse_args(argv):
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("install", help="unpack the wheels whose modules are missing into --target")
    i.add_argument("--wheels", required=True)
    i.add_argument("--target", required=True)
    for name in ("run", "plan", "check-args"):
        r = sub.add_parser(name)
        r.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "build" / "gpu-check"))
        r.add_argument("--dry-run", action="store_true",
                       default=os.environ.get("PAGODA_GPU_CHECK_DRY_RUN", "") not in ("", "0"))
        r.add_argument("--budget", type=float, default=None,
                       help=f"seconds for all the steps (default {DEFAULT_BUDGET_S}; the dry run's "
                            f"{DRY_RUN_SLOWER} times that)")
        r.add_argument("--workers", type=int, default=None, help="pytest-xdist workers for the kernel tier")
        r.add_argument("--only", nargs="+", default=None, metavar="STEP", help="run only these steps")
        r.add_argument("--wheels", default=None, help="first unpack the wheels of this folder that this Python lacks")
        r.add_argument("--target", default=None, help="... into this folder, put on PYTHONPATH")
    e = sub.add_parser("environment")
    e.add_argument("--out", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--model-dir", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("bench_args", nargs="*")
    s = sub.add_parser("serve-smoke")
    s.add_argument("--out", required=True)
    g = sub.add_parser("cuda-graphs")
    g.add_argument("--model-dir", required=True)
    g.add_argument("--out", required=True)
    sub.add_parser("data-parallel")
    sub.add_parser("pd-disaggregation")
    args = p.parse_args(argv)
    if args.command in ("run", "plan", "check-args"):
        if args.budget is None:
            args.budget = DEFAULT_BUDGET_S * (DRY_RUN_SLOWER if args.dry_run else 1)
        if args.budget < 60:
            p.error("--budget must be at least 60 seconds")
        if args.workers is None:
            args.workers = 1 if args.dry_run else 8
        if args.workers < 1:
            p.error("--workers must be >= 1")
        if args.wheels and not args.target:
            p.error("--wheels needs --target")
        if args.wheels and not Path(args.wheels).is_dir():
            p.error(f"--wheels: no folder {args.wheels} (run make gpu-wheels)")
        names = [s.name for s in plan(Path(args.out), args.dry_run, args.workers)]
        unknown = sorted(set(args.only or []) - set(names))
        if unknown:
            p.error(f"--only: unknown step(s) {', '.join(unknown)}; the steps are {', '.join(names)}")
    return args


def check_args(args) -> int:
    """What the rehearsal's fast test runs: the wheel list parses and covers the check's imports (see
    tests/unit/test_gpu_check.py), the steps are planned, and the output folder can be written."""
    specs = read_wheel_list()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = plan(out, args.dry_run, args.workers)
    print(f"gpu-check: {len(specs)} wheels listed; {len(steps)} steps: {', '.join(s.name for s in steps)}; "
          f"budget {args.budget:.0f} s; results in {out}" + (" (dry run)" if args.dry_run else ""))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "install":
        report = install(Path(args.wheels), Path(args.target))
        print(json.dumps(report))
        return 1 if any(r["action"].startswith("MISSING") for r in report) else 0
    if args.command == "plan":
        for step in plan(Path(args.out), args.dry_run, args.workers):
            if args.only and step.name not in args.only:
                continue
            print(f"{step.name} (limit {step.limit_s} s): {step.what}\n  $ {shlex.join(step.argv)}")
        return 0
    if args.command == "check-args":
        return check_args(args)
    return {"run": run, "environment": environment, "throughput": throughput,
            "serve-smoke": serve_smoke, "cuda-graphs": cuda_graphs_check,
            "data-parallel": data_parallel_check,
            "pd-disaggregation": pd_disaggregation_check}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
