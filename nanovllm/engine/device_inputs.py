import numpy as np
import torch

ALIGNMENT = 8


class DeviceInputs:
    """Copies a step's host arrays to the device in one transfer.

    On CUDA the arrays are packed into pinned staging memory, copied in one non-blocking transfer
    and viewed in place on the device. The host may pack the next step while the device still runs
    this one, so there are two staging buffers, each reused only once its last copy is done.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.staging: list[torch.Tensor | None] = [None, None]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.on_device = torch.empty(0, dtype=torch.uint8, device=device)

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            return [torch.from_numpy(a) for a in arrays]
        offsets, num_bytes = _layout(arrays)
        staging = self._staging(num_bytes)
        packed = staging.numpy()
        for array, offset in zip(arrays, offsets):
            packed[offset:offset + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if self.on_device.numel() < num_bytes:
            self.on_device = torch.empty(2 * num_bytes, dtype=torch.uint8, device=self.device)
        self.on_device[:num_bytes].copy_(staging[:num_bytes], non_blocking=True)
        self.copied[self.turn] = torch.cuda.Event()
        self.copied[self.turn].record()
        self.turn ^= 1
        return [self.on_device[offset:offset + a.nbytes].view(torch.from_numpy(a[:0]).dtype).view(a.shape)
                for a, offset in zip(arrays, offsets)]

    def _staging(self, num_bytes: int) -> torch.Tensor:
        if self.copied[self.turn] is not None:
            self.copied[self.turn].synchronize()
        staging = self.staging[self.turn]
        if staging is None or staging.numel() < num_bytes:
            staging = self.staging[self.turn] = torch.empty(2 * num_bytes, dtype=torch.uint8, pin_memory=True)
        return staging


def _layout(arrays: list[np.ndarray]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for array in arrays:
        offsets.append(end)
        end += -(-array.nbytes // ALIGNMENT) * ALIGNMENT
    return offsets, max(end, ALIGNMENT)
