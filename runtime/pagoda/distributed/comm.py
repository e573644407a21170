"""Point-to-point transfer of Python objects and tensors between ranks (pipeline stages, results)."""

import pickle

import torch
import torch.distributed as dist


class PendingSends:
    """Keeps isend buffers alive until their transfers complete. Never blocks on them mid-run: the peer
    may itself be blocked sending to us, and waiting here would deadlock the pipeline."""

    def __init__(self):
        self._works: list[tuple[object, object]] = []

    def add(self, work, buffer) -> None:
        self._works = [(w, b) for w, b in self._works if not w.is_completed()]
        self._works.append((work, buffer))

    def wait_all(self) -> None:
        for work, _ in self._works:
            work.wait()
        self._works.clear()


def send_object(obj, dst: int, group=None, pending: PendingSends | None = None) -> None:
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    if pending is None:
        dist.send(size, dst, group=group)
        dist.send(payload, dst, group=group)
        return
    pending.add(dist.isend(size, dst, group=group), size)
    pending.add(dist.isend(payload, dst, group=group), payload)


def recv_object(src: int, group=None):
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src, group=group)
    return pickle.loads(payload.numpy().tobytes())


def send_tensor(tensor: torch.Tensor, dst: int, group=None, pending: PendingSends | None = None) -> None:
    tensor = tensor.contiguous()
    if pending is None:
        dist.send(tensor, dst, group=group)
    else:
        pending.add(dist.isend(tensor, dst, group=group), tensor)


def recv_tensor(shape, dtype, device, src: int, group=None) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(tensor, src, group=group)
    return tensor
