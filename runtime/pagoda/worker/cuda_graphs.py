"""CUDA graphs for decode-only steps: the model's forward captured once per batch size and replayed.

A small decode step on a GPU is mostly kernel launches (several per layer, a few microseconds of CPU each);
a replayed graph launches them all at once. What is captured: the model's forward (embedding, layers, final
norm; not the logits or sampling) over static input buffers: token ids, positions, slot mapping, sequence
lengths, block tables and the query start offsets (fixed: one token per sequence). Each size of
`cudagraph_capture_sizes` gets its graph, largest first, all in one memory pool. A decode-only step of n
sequences is copied into the buffers, padded to the next captured size and replayed; its first n rows are
the step's hidden states. Padding rows get the null slot (-1: every KV-write kernel skips it), a context of
one token and block 0 (read, never written), so they never write a real KV block.

What runs eagerly, and why (docs/gpu.md):
- steps with a prefill chunk or draft tokens (a query longer than one token: other kernel tiles per step),
  batches above the largest captured size, and block tables wider than the buffers;
- decode steps the Triton backend sends to split-K (a long context, few sequences): its partition count and
  scratch buffers follow the step's longest context, known on the host only;
- the whole engine (no graphs captured) with the torch attention backend on CUDA (it reads the lengths'
  host copies), pipeline parallelism (stages exchange hidden states through host-driven sends), LoRA (its
  per-row adapter indices are rebuilt each step), mixture-of-experts layers (routing reads expert counts on
  the host), calculate_kv_scales (calibration reads the first batch on the host), and tensor parallelism
  off CUDA (gloo and the shared-memory all-reduce are host code; NCCL, on CUDA, is captured in the graph).

The capture mechanism is injectable: ``CudaGraphCapture`` (torch.cuda.CUDAGraph) on CUDA; on a CPU, with
PAGODA_CUDA_GRAPH_STAND_IN=1 (tests, the GPU check's rehearsal), ``StandInCapture``, which records the forward
as a closure over the same static buffers and replays it by running it again. With the Triton backend the
stand-in keeps the metadata's host copies as they were at capture, as a graph would: the replay then proves
that the captured path reads every length from the device buffers.
"""

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagoda.attention import AttentionMetadata
from pagoda.config.compilation import cuda_graph_stand_in
from pagoda.layers.attention import forward_context
from pagoda.layers.moe import SparseMoE

logger = logging.getLogger(__name__)

NULL_SLOT = -1  # a padding row's KV slot: the write kernels skip it


class CudaGraphCapture:
    """torch.cuda.CUDAGraph; every graph allocates from one shared memory pool (captured largest first, the
    smaller ones reuse its memory)."""

    stand_in = False

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay


class StandInCapture:
    """A CPU's stand-in: the forward itself, a closure over the static buffers, replayed by running it."""

    stand_in = True

    def capture(self, forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return forward


@dataclass
class GraphStats:
    sizes: tuple[int, ...]
    capture_seconds: float
    capture_bytes: int | None  # device memory the graphs' pool holds (None off CUDA)
    replays_by_size: Counter = field(default_factory=Counter)
    eager_steps: int = 0  # decode steps that ran eagerly while graphs were on (too large, split-K, ...)


def eager_reason(config, model, device: torch.device, lora: bool) -> str | None:
    """Why this engine captures no graph, or None. config: the EngineConfig."""
    if not config.cudagraph_capture_sizes:
        return "enforce_eager, no capture sizes, or no CUDA"
    if device.type != "cuda" and not cuda_graph_stand_in():
        return f"no CUDA graphs on {device.type}"
    if device.type == "cuda" and config.attention_backend != "triton":
        return "the torch attention backend reads the batch's lengths on the host"
    if config.parallel.pipeline_parallel_size > 1:
        return "pipeline parallelism: stages hand hidden states over host-driven sends"
    if config.parallel.tensor_parallel_size > 1 and device.type != "cuda":
        return "tensor parallelism off CUDA: gloo and the shared-memory all-reduce cannot be captured"
    if lora:
        return "LoRA: each step rebuilds its rows' adapter indices"
    if config.cache.calculate_kv_scales:
        return "calculate_kv_scales: the first batch's scales are read on the host"
    if any(isinstance(m, SparseMoE) for m in model.modules()):
        return "mixture-of-experts layers read their routing counts on the host"
    return None


class DecodeGraphs:
    """The captured decode forwards and their static buffers (see the module docstring)."""

    def __init__(self, model, sizes: tuple[int, ...], max_blocks_per_seq: int, device: torch.device,
                 attn_backend, triton_ops: bool, capture, num_kv_heads: int):
        self.model = model
        self.sizes = tuple(sorted(sizes))
        self.device = device
        self.attn_backend = attn_backend
        self.triton_ops = triton_ops
        self.capturer = capture
        self.num_kv_heads = num_kv_heads
        # the torch backend loops over the host copies of the lengths: it runs only under the stand-in (never
        # on CUDA, eager_reason), which gives it this step's; a graph (and the stand-in for Triton) keeps
        # those of the capture
        self.refresh_host_copies = not triton_ops
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), NULL_SLOT, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(largest, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)  # one token each
        self.metadata: dict[int, AttentionMetadata] = {}
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
        self.stats: GraphStats | None = None

    def _metadata(self, size: int) -> AttentionMetadata:
        """Views of the buffers; host copies as at capture: every context one token long."""
        return AttentionMetadata(query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
                                 block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
                                 max_query_len=1, max_seq_len=1, query_lens_cpu=[1] * size,
                                 seq_lens_cpu=[1] * size)

    def _forward(self, size: int) -> torch.Tensor:
        with forward_context(self.metadata[size], self.attn_backend, self.triton_ops):
            return self.model(self.input_ids[:size], self.positions[:size])

    @torch.inference_mode()
    def capture(self) -> GraphStats:
        cuda = self.device.type == "cuda"
        if cuda:  # the graphs' pools: what torch's allocator holds more, the warm-ups' freed activations given
            # back (the device's free memory also moves with the driver's own allocations: it read -2 MiB once)
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            reserved_before = torch.cuda.memory_reserved(self.device)
        start = time.perf_counter()
        for size in reversed(self.sizes):
            self.metadata[size] = self._metadata(size)
            forward = lambda size=size: self._forward(size)  # noqa: E731
            forward()  # warm-up outside the capture: Triton compiles, cuBLAS picks its kernels
            self.replays[size] = self.capturer.capture(forward)
        if cuda:
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        if cuda:
            torch.cuda.empty_cache()
        pools = torch.cuda.memory_reserved(self.device) - reserved_before if cuda else None
        self.stats = GraphStats(self.sizes, seconds, pools)
        logger.info("CUDA graphs%s: decode batch sizes %s captured in %.1f s%s", " (stand-in)" if
                    self.capturer.stand_in else "", _ranges(self.sizes), seconds,
                    f", {self.stats.capture_bytes / 2**20:.0f} MiB" if cuda else "")
        return self.stats

    def size_for(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds num_seqs, or None: run eagerly."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def runs(self, metadata: AttentionMetadata, num_tokens: int) -> int | None:
        """The captured size this step replays, or None when it runs eagerly (the module docstring's list)."""
        if metadata.max_query_len != 1 or num_tokens != metadata.num_seqs or num_tokens == 0:
            return None
        size = self.size_for(num_tokens)
        if size is None or metadata.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        if self.triton_ops:
            from pagoda.attention import triton_backend

            if triton_backend.use_split_k(metadata, self.num_kv_heads, self.device):
                return None
        return size

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
            ) -> torch.Tensor | None:
        """The step's hidden states [n, hidden] from the graph of its size, or None: run it eagerly."""
        n = len(input_ids)
        size = self.runs(metadata, n)
        if size is None:
            if metadata.max_query_len == 1:
                self.stats.eager_steps += 1
            return None
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:size].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:size].zero_()
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.slot_mapping[n:size].fill_(NULL_SLOT)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.seq_lens[n:size].fill_(1)
        width = metadata.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(metadata.block_tables)
        self.block_tables[n:size].zero_()
        if self.refresh_host_copies:
            captured = self.metadata[size]
            captured.seq_lens_cpu = list(metadata.seq_lens_cpu) + [1] * (size - n)
            captured.max_seq_len = metadata.max_seq_len
        self.stats.replays_by_size[size] += 1
        return self.replays[size]()[:n]


def capture_decode_graphs(model, config, device: torch.device, attn_backend, triton_ops: bool, lora: bool,
                          max_blocks_per_seq: int, num_kv_heads: int) -> DecodeGraphs | None:
    """The engine's decode graphs, captured now (after the KV cache exists), or None (logged why)."""
    reason = eager_reason(config, model, device, lora)
    if reason is not None:
        if config.cudagraph_capture_sizes:
            logger.info("CUDA graphs off, every step eager: %s", reason)
        return None
    capture = CudaGraphCapture() if device.type == "cuda" else StandInCapture()
    graphs = DecodeGraphs(model, config.cudagraph_capture_sizes, max_blocks_per_seq, device, attn_backend,
                          triton_ops, capture, num_kv_heads)
    try:
        graphs.capture()
    except Exception:  # noqa: BLE001 - a server that runs eagerly beats one that does not start
        logger.exception("CUDA graph capture failed: every step runs eagerly (--enforce-eager skips the capture)")
        return None
    return graphs


def _ranges(sizes: tuple[int, ...]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 8 else \
        f"{', '.join(map(str, sizes[:5]))}, ... {sizes[-1]} ({len(sizes)} graphs)"
