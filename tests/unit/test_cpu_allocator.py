"""Freed activation-sized CPU tensors are reused, not faulted in afresh, once keep_freed_memory() ran."""

import platform
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")]

SCRIPT = """
import resource, torch
from pagoda.process.cpu_allocator import keep_freed_memory

def faults_per_allocation():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        torch.ones(2 * 2**20)  # 8 MB, written, then freed: an MLP activation of a prefill chunk
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20

print(faults_per_allocation())
assert keep_freed_memory()
faults_per_allocation()  # the first allocations may still fault the heap in
print(faults_per_allocation())
"""


def test_freed_tensors_are_reused_without_page_faults():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout.split()
    default_faults, kept_faults = float(out[0]), float(out[1])

    assert default_faults > 200  # up to 2048 pages of 4 KiB per 8 MB allocation, faulted in every time
    assert kept_faults < 50
