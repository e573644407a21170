"""scripts/gpu-check.sh without a GPU and without running it: the wheel list covers every module the check
imports that the GPU machine lacks, the arguments are checked, the plan keeps to the limits of what comes
back from the machine, and the wheels install only where a module is missing. (The whole rehearsal,
PAGODA_GPU_CHECK_DRY_RUN=1 scripts/gpu-check.sh, takes minutes: docs/gpu.md.)"""

import ast
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

RUNTIME = ROOT / "runtime"
# what the check runs: these runtime modules, and these files (the test files and the script itself)
ENTRY_MODULES = ["pagoda", "pagoda.entrypoints.cli", "pagoda.bench.kernels", "pagoda.bench.throughput",
                 "pagoda.engine.async_llm_engine", "pagoda.entrypoints.openai.api_server"]
LOCAL_MODULES = {"pagoda", "checkpoints", "paged_batch", "gpu_compile", "conftest", "gpu_check"}


def module_file(name: str) -> Path | None:
    base = RUNTIME.joinpath(*name.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.exists():
            return candidate
    return None


def catches_import_error(node: ast.Try) -> bool:
    names = {ast.unparse(h.type) for h in node.handlers if h.type is not None}
    return bool(names & {"ImportError", "ModuleNotFoundError", "(ImportError, ModuleNotFoundError)"})


def imports(tree: ast.AST, module: str, top_level_only: bool) -> set[str]:
    """Absolute names imported; at module level only (what importing the module runs) where asked; imports
    guarded by `except ImportError` are optional and left out."""
    found = set()

    def visit(node, guarded):
        for child in ast.iter_child_nodes(node):
            if top_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            child_guarded = guarded or (isinstance(child, ast.Try) and catches_import_error(child))
            if isinstance(child, ast.Import) and not guarded:
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and not guarded:
                base = child.module or ""
                if child.level:
                    parts = module.split(".")[: len(module.split(".")) - child.level + (module_is_package(module))]
                    base = ".".join(parts + ([child.module] if child.module else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in child.names)  # a submodule, where it is one
            visit(child, child_guarded)

    visit(tree, False)
    return found


def module_is_package(name: str) -> int:
    f = module_file(name)
    return int(f is not None and f.name == "__init__.py")


def third_party_imports() -> dict[str, set[str]]:
    """Top-level third-party modules imported by the check's files (any import) and, transitively, at
    module level by the runtime modules they reach: {module: the files importing it}."""
    stdlib = set(sys.stdlib_module_names)
    found: dict[str, set[str]] = {}
    seen: set[str] = set()
    queue: list[str] = list(ENTRY_MODULES)

    def note(name: str, where: str):
        top = name.split(".")[0]
        if top == "pagoda":
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a, a.b and a.b.c
                if module_file(".".join(parts[:i])) is not None:
                    queue.append(".".join(parts[:i]))
        elif top and top not in stdlib and top not in LOCAL_MODULES and not top.startswith("test_"):
            found.setdefault(top, set()).add(where)

    files = [ROOT / "scripts" / "gpu_check.py", ROOT / "tests" / "checkpoints.py", ROOT / "tests" / "conftest.py",
             *sorted((ROOT / "tests" / "gpu").glob("*.py")),
             *(p for p in sorted((ROOT / "tests" / "kernels").glob("*.py"))
               if p.name not in gpu_check.CPU_ONLY_KERNEL_TESTS),
             ROOT / "tests" / "model" / "test_fp8_kv_cache.py", ROOT / "tests" / "model" / "test_hf_parity.py"]
    for path in files:
        for name in imports(ast.parse(path.read_text()), path.stem, top_level_only=False):
            note(name, str(path.relative_to(ROOT)))
    while queue:
        name = queue.pop()
        if name in seen:
            continue
        seen.add(name)
        path = module_file(name)
        for imported in imports(ast.parse(path.read_text()), name, top_level_only=True):
            note(imported, str(path.relative_to(ROOT)))
    return found


def test_the_wheel_list_covers_what_the_machine_lacks():
    specs = gpu_check.read_wheel_list()
    brought = {m for s in specs for m in s.modules}
    needed = third_party_imports()
    assert {"torch", "triton", "transformers", "fastapi", "pydantic", "xgrammar"} <= needed.keys()
    uncovered = {m: sorted(w) for m, w in needed.items() if m not in gpu_check.MACHINE_HAS | brought}
    assert not uncovered, f"imported by the check, neither on the GPU machine nor in scripts/gpu-wheels.txt: {uncovered}"


def test_the_wheel_list_brings_no_torch_and_pins_every_wheel():
    specs = gpu_check.read_wheel_list()
    names = [s.name.lower() for s in specs]
    assert len(names) == len(set(names))
    assert not {"torch", "triton", "nvidia-cuda-runtime-cu12"} & set(names)
    assert all(s.version and s.modules for s in specs)
    assert gpu_check.WheelSpec("pydantic-core==2.50.5", ["pydantic_core"]).file_prefix() == "pydantic_core-2.50.5-"


def test_a_malformed_wheel_list_line_is_named(tmp_path):
    bad = tmp_path / "list.txt"
    bad.write_text("# comment\nfastapi  # modules: fastapi\n")
    with pytest.raises(ValueError, match=r"list.txt:2: expected 'name==version"):
        gpu_check.read_wheel_list(bad)


def test_install_unpacks_only_the_wheels_whose_modules_are_missing(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name, module in (("pagoda_absent_mod", "pagoda_absent_mod"), ("json_again", "json")):
        with zipfile.ZipFile(wheels / f"{name}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"{module}/__init__.py", "VALUE = 1\n")
    specs = [gpu_check.WheelSpec("pagoda-absent-mod==1.0", ["pagoda_absent_mod"]),
             gpu_check.WheelSpec("json-again==1.0", ["json"]),
             gpu_check.WheelSpec("nowhere==2.0", ["pagoda_nowhere_mod"])]
    report = gpu_check.install(wheels, tmp_path / "site", specs)
    assert [r["action"].split(" ")[0] for r in report] == ["installed", "present", "MISSING"]
    assert (tmp_path / "site" / "pagoda_absent_mod" / "__init__.py").exists()
    assert not (tmp_path / "site" / "json").exists()  # the standard library's json is not shadowed


def test_plan_keeps_to_what_comes_back(tmp_path):
    """At most 8 files under OUT (log, JSON, junit XML, bench JSON); limits inside the budget; the order of
    value (the kernels first, the server last)."""
    for dry_run in (False, True):
        steps = gpu_check.plan(tmp_path, dry_run, 8)
        assert [s.name for s in steps] == ["environment", "kernels", "engine", "cuda-graphs", "bench-kernels",
                                           "bench-throughput", "serve", "data-parallel", "pd-disaggregation"]
        outputs = {"gpu-check.log", "gpu-check.json"} | {s.junit for s in steps if s.junit} | \
            {s.json_file for s in steps if s.json_file}
        assert len(outputs) <= 8
        assert all(str(tmp_path) not in " ".join(s.argv) or "--out" in s.argv or "--junitxml" in " ".join(s.argv)
                   or "--json" in s.argv for s in steps)
        slower = gpu_check.DRY_RUN_SLOWER if dry_run else 1
        assert sum(s.limit_s for s in steps[:3]) < gpu_check.DEFAULT_BUDGET_S * slower
    assert not str(gpu_check.SCRATCH).startswith(str(tmp_path))


def test_check_args_and_errors(tmp_path, capsys):
    assert gpu_check.main(["check-args", "--out", str(tmp_path / "out")]) == 0
    assert "9 steps: environment, kernels" in capsys.readouterr().out
    for argv, message in ((["--only", "nope"], "--only: unknown step(s) nope"),
                          (["--budget", "10"], "--budget must be at least 60"),
                          (["--workers", "0"], "--workers must be >= 1"),
                          (["--wheels", str(tmp_path / "none"), "--target", str(tmp_path)], "run make gpu-wheels")):
        with pytest.raises(SystemExit) as exit_info:
            gpu_check.main(["run", "--out", str(tmp_path), *argv])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_the_shell_entry_point_checks_its_arguments_without_torch(tmp_path):
    """scripts/gpu-check.sh --check-args and --plan, with this Python: no step runs, nothing is installed."""
    env = {**os.environ, "PAGODA_GPU_CHECK_PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    env.pop("PAGODA_GPU_CHECK_DRY_RUN", None)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--check-args"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert ("9 steps: environment, kernels, engine, cuda-graphs, bench-kernels, bench-throughput, serve, "
            "data-parallel, pd-disaggregation") in done.stdout
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--plan", "--only", "engine"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("engine (limit") and "tests/gpu" in done.stdout
    assert "-m pytest" in done.stdout and "kernels (limit" not in done.stdout


def test_the_pd_step_brings_nixl_and_runs_alone(tmp_path):
    """pd-disaggregation: the NIXL wheel is on the list (its modules imported only inside the step, so the
    coverage test above cannot see them), and the plan runs the step's own subcommand; --only picks it alone."""
    assert "nixl_cu13" in {m for s in gpu_check.read_wheel_list() for m in s.modules}
    step = {s.name: s for s in gpu_check.plan(tmp_path, False, 8)}["pd-disaggregation"]
    assert step.argv[-1] == "pd-disaggregation" and not step.json_file  # one JSON line in the log
    args = gpu_check.parse_args(["run", "--out", str(tmp_path), "--only", "pd-disaggregation"])
    assert args.only == ["pd-disaggregation"]


def test_results_summaries_read_what_the_steps_write(tmp_path):
    junit = tmp_path / "j.xml"
    junit.write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
                     '<testcase classname="tests.gpu.t" name="a"/><testcase classname="tests.gpu.t" name="b">'
                     '<failure message="assert [1] == [2]">x</failure></testcase>'
                     '<testcase classname="tests.gpu.t" name="c"><skipped/></testcase></testsuite></testsuites>')
    counts = gpu_check.junit_counts(junit)
    assert (counts["passed"], counts["failures"], counts["skipped"]) == (1, 1, 1)
    assert counts["failed_tests"] == ["tests.gpu.t::b: assert [1] == [2]"]
    bench = tmp_path / "bench.json"
    row = dict(layout="llama3-8b", variant="split-K", microseconds=10.0, gbs=2500.0, pct_peak_gbs=75.0, tflops=1.0,
               pct_peak_tflops=0.1, torch_microseconds=30.0)
    bench.write_text(json.dumps({"device": {"name": "H100"}, "dtype": "bfloat16", "results": [
        dict(row, kernel="decode", shape="batch   1 q     1 ctx  8192", note="dispatch"),
        dict(row, kernel="decode", shape="batch   1 q     1 ctx  1024", note="dispatch", pct_peak_gbs=40.0),
        dict(row, kernel="prefill", shape="batch   1 q  2048 ctx  2048", note="", tflops=400.0)]}))
    summary = gpu_check.summarize_bench_kernels(bench)
    assert summary["decode_long_context_pct_peak_gbs"] == [75.0, 75.0]
    assert summary["best_prefill"]["tflops"] == 400.0
    throughput = tmp_path / "throughput.json"
    throughput.write_text(json.dumps({"results": [
        {"name": "pagoda", "output_tokens_per_s": 900.0, "dtype": "bfloat16"},
        {"name": "transformers, one at a time", "output_tokens_per_s": 100.0},
        {"name": "transformers, static batches of 16", "output_tokens_per_s": 300.0}]}))
    summary = gpu_check.summarize_throughput(throughput)
    assert summary["pagoda_over_best_transformers"] == 3.0 and summary["above_the_floor"]


def test_the_torch_name_probe_survives_lookups_that_raise():
    """torch.classes.NS.Cls raises RuntimeError, not AttributeError, while its library is not loaded: the
    environment step's probe must name such a name as missing, never die of it."""
    pytest.importorskip("torch")
    names = gpu_check.torch_names_used()
    assert "torch.classes" in names  # the runtime's shm all-reduce; its class itself is no torch API
    assert not [n for n in names if n.startswith(("torch.ops.", "torch.classes."))]
    unknown = ["torch.classes.pagoda_nowhere.Nothing", "torch.nn.functional.pagoda_nowhere"]
    assert gpu_check.missing_torch_names([*names, *unknown]) == unknown
