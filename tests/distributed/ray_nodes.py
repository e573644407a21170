"""Ray nodes for tests: `ray start --block` in a session of its own, with its own --temp-dir, stopped by its
pid (SIGTERM makes it stop the processes it started) and then every process left in its session, never by
`ray stop` (which would stop every Ray process on the machine)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RAY = str(Path(sys.executable).parent / "ray")


class RayNode:
    def __init__(self, temp_dir: Path, log_path: Path, *args: str, prefix: list[str] | None = None,
                 env: dict | None = None):
        self.log_path = log_path
        temp_dir.mkdir(parents=True, exist_ok=True)
        command = (prefix or []) + [RAY, "start", "--block", "--disable-usage-stats", f"--temp-dir={temp_dir}",
                                    *args]
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def session_pids(self) -> list[int]:
        """Processes in this node's session (the `ray start` process is its leader)."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == self.process.pid:  # field 6 of stat: the session id
                pids.append(int(stat.parent.name))
        return pids

    def kill_all(self) -> None:
        """Every process of the node at once: a node lost (no clean shutdown)."""
        for pid in self.session_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 5
        while self.session_pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.kill_all()


def wait_for_nodes(address: str, nodes: list[RayNode], timeout: float = 120, env: dict | None = None) -> None:
    """Until the cluster at `address` has all `nodes` live (checked from a child process, so this one
    never joins the cluster; env: added to the child's environment)."""
    probe = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='error'); "
             "print(sum(n['Alive'] for n in ray.nodes()))")
    deadline = time.monotonic() + timeout
    alive = ""
    count = len(nodes)
    while time.monotonic() < deadline:
        for node in nodes:
            if node.process.poll() is not None:
                raise RuntimeError(f"a Ray node exited with {node.process.returncode}:\n{node.log()}")
        result = subprocess.run([sys.executable, "-c", probe, address], capture_output=True, text=True,
                                env={**os.environ, **(env or {})})
        alive = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-500:]
        if alive == str(count):
            return
        time.sleep(1)
    raise TimeoutError(f"the Ray cluster at {address} did not reach {count} nodes in {timeout}s: {alive}")
