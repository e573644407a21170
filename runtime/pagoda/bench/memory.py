"""Peak resident memory of this process over a block of code (Linux /proc), or CUDA peak allocation."""

import threading
import time


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:
        return 0


class PeakMemory:
    """with PeakMemory() as m: ...; m.peak_bytes is the peak RSS seen (sampled every 20 ms)."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.peak_bytes = 0
        self._stop = threading.Event()

    def __enter__(self):
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.peak_bytes = _rss_bytes()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, _rss_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc):
        import torch

        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, _rss_bytes())
        if torch.cuda.is_available():
            self.peak_bytes = torch.cuda.max_memory_allocated()
        return False
