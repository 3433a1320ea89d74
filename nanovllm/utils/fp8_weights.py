"""FP8 weights kept as FP8 (on CUDA, where kernels read them): each linear's `weight` in float8_e4m3fn beside a
float32 `weight_scale`, in one of two layouts, the scheme the model is built under (`fp8_weights`):

- "channel": a scale per output row, [rows, 1]: compressed-tensors' per-channel scales, per-tensor ones (each
  tensor's value repeated over its rows, which is exact) and `quantization="fp8"`;
- "block": a scale per 128x128 block, [ceil(rows / 128), ceil(cols / 128)]: Qwen's block FP8.

W = float(weight) * scale, row by row or block by block. A region of a weight (a rank's share, q's rows of the
fused q/k/v) is a region of its scale: whole blocks, so a split that cuts a block is refused by name.
"""
import re
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
BLOCK = 128
SCHEMES = ("channel", "block")

_scheme: str | None = None
_unquantized: Callable[[str], bool] | None = None  # whether the checkpoint leaves a module in the model's dtype


class FP8Rows(NamedTuple):
    """Activation rows beside their e4m3 copy with a float32 scale per row ([rows, 1]), made by the kernel that
    writes the rows (`elementwise.residual_rms_norm`), so that the per-channel FP8 matmul reading them need not
    quantize them: as `fp8_linear.quantize_groups(rows, per_token=True)` makes them."""
    rows: torch.Tensor
    quantized: torch.Tensor
    scale: torch.Tensor


def split_rows(x: torch.Tensor | FP8Rows) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """The rows, and their (e4m3 copy, scale) where x carries them."""
    return (x.rows, (x.quantized, x.scale)) if isinstance(x, FP8Rows) else (x, None)


def get_fp8_scheme(modules: Sequence[str] = ()) -> str | None:
    """The scheme a layer being built keeps its weights in, None (the model's dtype), "channel" or "block": None
    too where the checkpoint leaves the modules it holds (their names in the checkpoint) unquantized. ValueError
    where it leaves some of a fused layer's modules unquantized and not the others (vLLM refuses them too)."""
    if _scheme is None or _unquantized is None or not modules:
        return _scheme
    left = [_unquantized(module) for module in modules]
    if all(left):
        return None
    if any(left):
        kept = [module for module, unquantized in zip(modules, left) if unquantized]
        quantized = [module for module, unquantized in zip(modules, left) if not unquantized]
        raise ValueError(f"the checkpoint leaves {listed(kept)} unquantized but not {listed(quantized)}, which this "
                         f"engine holds in one weight: one format is served for them all")
    return _scheme


def listed(modules: list[str], most: int = 3) -> str:
    return ", ".join(modules[:most]) + (f" and {len(modules) - most} more" if len(modules) > most else "")


@contextmanager
def fp8_weights(scheme: str | None, unquantized: Sequence[str] = ()):
    """Build the model's linear layers with FP8 weights in `scheme` inside this block (None: unquantized), but
    those of the checkpoint modules named in `unquantized` (`quantization.unquantized_modules`): a name there
    stands for that module and those under it, wherever it sits ("lm_head", "model.layers.0.mlp",
    "mlp.down_proj"); "re:" starts a regular expression matched from the name's start, as compressed-tensors
    reads its `ignore`."""
    global _scheme, _unquantized
    assert scheme in (None, *SCHEMES)
    saved = _scheme, _unquantized
    _scheme, _unquantized = scheme, unquantized_matcher(unquantized)
    try:
        yield
    finally:
        _scheme, _unquantized = saved


def unquantized_matcher(names: Sequence[str]) -> Callable[[str], bool] | None:
    """Whether a module is among `fp8_weights`' unquantized ones: a plain name matches at dots only (so
    "layers.1" is not "layers.10", nor "mlp.gate", a MoE router, "mlp.gate_proj"), a "re:" pattern from the name's
    start."""
    if not names:
        return None
    plain = "|".join(re.escape(name) for name in names if not name.startswith("re:"))
    at_dots = re.compile(rf"(?:^|\.)(?:{plain})(?:\.|$)") if plain else None
    patterns = [name[3:] for name in names if name.startswith("re:")]
    from_start = re.compile("|".join(f"(?:{pattern})" for pattern in patterns)) if patterns else None
    return lambda module: bool(at_dots and at_dots.search(module) or from_start and from_start.match(module))


def scheme_for(method: str | None, quantization_config: dict | None) -> str | None:
    """The layout a checkpoint's weights keep: block for Qwen's block FP8, channel for the rest; None unquantized."""
    if method is None:
        return None
    if method == "fp8" and (quantization_config or {}).get("weight_block_size"):
        return "block"
    return "channel"


def scale_shape(scheme: str, rows: int, cols: int) -> tuple[int, int]:
    return (rows, 1) if scheme == "channel" else (-(-rows // BLOCK), -(-cols // BLOCK))


def quantize(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight in e4m3 and its float32 scale in `scheme`'s layout (amax / 448 per row or per block)."""
    weight = weight.float()
    if scheme == "channel":
        scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX
        return (weight / scale).to(FP8), scale
    rows, cols = weight.shape
    padded = weight.new_zeros(-(-rows // BLOCK) * BLOCK, -(-cols // BLOCK) * BLOCK)
    padded[:rows, :cols] = weight
    blocks = padded.unflatten(0, (-1, BLOCK)).unflatten(2, (-1, BLOCK))  # [row blocks, 128, col blocks, 128]
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX
    return (blocks / scale[:, None, :, None]).flatten(2, 3).flatten(0, 1)[:rows, :cols].to(FP8), scale


def has_row_scales(weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether a weight [..., rows, cols]'s scale is per row ([..., rows, 1]) rather than per 128x128 block."""
    return scale.size(-1) == 1 and scale.size(-2) == weight.size(-2)


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 weight * scale for a weight [..., rows, cols] and its scale in either layout."""
    rows, cols = weight.shape[-2:]
    if has_row_scales(weight, scale):
        return weight.float() * scale
    full = scale.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)
    return weight.float() * full[..., :rows, :cols]


def scale_region(scale: torch.Tensor, scheme: str, dim: int, start: int, size: int, total: int,
                 what: str) -> torch.Tensor:
    """The part of a 2-D scale that holds rows (dim 0) or columns (dim 1) [start, start + size) of its weight,
    whose size along dim is `total`; ValueError naming `what` where the region cuts a 128-block."""
    if scheme == "channel":
        return scale.narrow(0, start, size) if dim == 0 else scale
    end = start + size
    if start % BLOCK or (end % BLOCK and end != total):
        raise ValueError(f"{what}: {'rows' if dim == 0 else 'columns'} {start}-{end} of {total} cut a 128x128 "
                         f"block of its FP8 scales (a tensor-parallel split or a fused projection's share that "
                         f"is not a multiple of 128)")
    return scale.narrow(dim, start // BLOCK, -(-size // BLOCK))

