"""A second "host" for multi-node tests: a network namespace joined to this one by a veth pair."""

import os
import shutil
import subprocess
from dataclasses import dataclass


@dataclass
class TwoHosts:
    namespace: str  # the worker host; the head is this (root) namespace
    head_ip: str
    worker_ip: str
    head_ifname: str
    worker_ifname: str

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def make_two_hosts() -> TwoHosts:
    """Raises OSError/CalledProcessError where namespaces cannot be made (not root, no iproute2)."""
    if shutil.which("ip") is None:
        raise OSError("iproute2 (the `ip` command) is not installed")
    if os.geteuid() != 0:
        raise OSError("creating network namespaces needs root")
    tag = os.getpid() % 10000
    # a subnet no interface holds: two runs' pids can map to the same one, and a run killed before its
    # teardown leaves its namespace and address behind
    in_use = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    subnet = next(s for s in ((10 + tag + i) % 200 + 10 for i in range(200)) if f" 10.213.{s}." not in in_use)
    hosts = TwoHosts(f"pagoda-w{tag}", f"10.213.{subnet}.1", f"10.213.{subnet}.2", f"pgdh{tag}", f"pgdw{tag}")
    remove_two_hosts(hosts)
    _ip("netns", "add", hosts.namespace)
    _ip("link", "add", hosts.head_ifname, "type", "veth", "peer", "name", hosts.worker_ifname)
    _ip("link", "set", hosts.worker_ifname, "netns", hosts.namespace)
    _ip("addr", "add", f"{hosts.head_ip}/30", "dev", hosts.head_ifname)
    _ip("link", "set", hosts.head_ifname, "up")
    _ip("-n", hosts.namespace, "addr", "add", f"{hosts.worker_ip}/30", "dev", hosts.worker_ifname)
    _ip("-n", hosts.namespace, "link", "set", hosts.worker_ifname, "up")
    _ip("-n", hosts.namespace, "link", "set", "lo", "up")
    return hosts


def remove_two_hosts(hosts: TwoHosts) -> None:
    subprocess.run(["ip", "link", "del", hosts.head_ifname], capture_output=True)
    subprocess.run(["ip", "netns", "del", hosts.namespace], capture_output=True)
