import dataclasses

import numpy as np
import torch

ALIGNMENT = 16  # every array starts 16-byte aligned, as compiled kernels prefer


class PinnedStaging:
    """Pinned host memory that the device copies from while the host goes on.

    The host may fill the next step's inputs while the device still copies this step's, so there are
    two buffers, used in turn, each filled again only once its last copy is done.
    """

    def __init__(self):
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def host(self, num_bytes: int) -> np.ndarray:
        """The buffer to fill now, as bytes."""
        if self.copied[self.turn] is not None:
            self.copied[self.turn].synchronize()
        buffer = self.buffers[self.turn]
        if buffer is None or buffer.numel() < num_bytes:
            buffer = self.buffers[self.turn] = torch.empty(2 * num_bytes, dtype=torch.uint8, pin_memory=True)
        return buffer.numpy()

    def copy_to(self, destination: torch.Tensor, num_bytes: int):
        """Copy the first num_bytes of the buffer just filled into `destination`, without waiting."""
        destination[:num_bytes].copy_(self.buffers[self.turn][:num_bytes], non_blocking=True)
        self.copied[self.turn] = torch.cuda.Event()
        self.copied[self.turn].record()
        self.turn ^= 1


class DeviceInputs:
    """Copies a step's host arrays to the device in one transfer: packed into pinned memory, copied
    without waiting, and viewed in place on the device. On a CPU the arrays are used as they are."""

    def __init__(self, device: torch.device):
        self.device = device
        self.staging = PinnedStaging()
        self.on_device = torch.empty(0, dtype=torch.uint8, device=device)

    def upload(self, *values):
        """The values (dataclasses, tuples, arrays, None) with every numpy array in them on the device."""
        arrays = [a for value in values for a in _arrays_in(value)]
        tensors = iter(self._upload(arrays))
        return tuple(_with_tensors(value, tensors) for value in values)

    def _upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            return [torch.from_numpy(a) for a in arrays]
        if not arrays:
            return []
        offsets, num_bytes = aligned_offsets([a.nbytes for a in arrays])
        packed = self.staging.host(num_bytes)
        for array, offset in zip(arrays, offsets):
            packed[offset:offset + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if self.on_device.numel() < num_bytes:
            self.on_device = torch.empty(2 * num_bytes, dtype=torch.uint8, device=self.device)
        self.staging.copy_to(self.on_device, num_bytes)
        return [view_as(self.on_device, offset, a.dtype, a.shape) for a, offset in zip(arrays, offsets)]


def _arrays_in(value):
    """The numpy arrays in a value, in field order: itself, a tuple's members, a dataclass's fields."""
    if isinstance(value, np.ndarray):
        yield value
    elif isinstance(value, tuple):
        for member in value:
            yield from _arrays_in(member)
    elif dataclasses.is_dataclass(value):
        for field in dataclasses.fields(value):
            yield from _arrays_in(getattr(value, field.name))


def _with_tensors(value, tensors):
    """`value` with its arrays replaced, in `_arrays_in`'s order, by the next of `tensors`."""
    if isinstance(value, np.ndarray):
        return next(tensors)
    if isinstance(value, tuple):
        return tuple(_with_tensors(member, tensors) for member in value)
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{field.name: _with_tensors(getattr(value, field.name), tensors)
                                             for field in dataclasses.fields(value)})
    return value


def aligned_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets that lay buffers of these byte sizes one after another, each ALIGNMENT-aligned; and the end."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // ALIGNMENT) * ALIGNMENT
    return offsets, max(end, ALIGNMENT)


def view_as(buffer: torch.Tensor, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A typed view of a byte buffer (a torch or numpy uint8 array) at `offset`."""
    num_bytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if isinstance(buffer, np.ndarray):
        return buffer[offset:offset + num_bytes].view(dtype).reshape(shape)
    return buffer[offset:offset + num_bytes].view(torch.from_numpy(np.empty(0, dtype)).dtype).view(shape)
