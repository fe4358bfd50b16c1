"""The fused-linear op's one Triton kernel: a gradient formed in the forward pass, times the
incoming gradient, rounded once to the leaf's dtype (`scaled`).

``torch.mul`` of a bf16 ``[V, H]`` gradient by an fp32 ``[1]`` scale (so that the scale is not
rounded to bf16 first) falls back to PyTorch's dynamically casting elementwise loop: on an H100
the two products of one fused-linear backward (``d hidden``, ``d weight``) took 3.16 ms there at
``V = 151,936``, ``H = 4096``, where reading and writing the ``[V, H]`` bf16 gradient takes about
0.8 ms at the bandwidth. This kernel reads the scale once per program, multiplies in fp32 and
stores in the output dtype (round to nearest even, as PyTorch's cast): the same bits as
``torch.mul(grad, scale.float(), out=out)`` for every product in the normal range (tested under
the Triton interpreter, which flushes subnormal products to zero, and on a GPU).
Imported only by ``op.py`` on CUDA (or by tests under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from echoloss.ops._launch import on_tensor_device

#: Elements per program: 16 KiB of bf16 per program in and out, 4 warps.
BLOCK = 8192


@triton.jit
def _scaled_kernel(
    X, S, Y, n, ROUND_BF16_BY_BITS: tl.constexpr, BLOCK: tl.constexpr
):  # pragma: no cover - runs in triton
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    inside = offs < n
    s = tl.load(S).to(tl.float32)
    y = tl.load(X + offs, mask=inside, other=0.0).to(tl.float32) * s
    if ROUND_BF16_BY_BITS:
        # Round to nearest even on the fp32 bits: the interpreter's own fp32 -> bf16 cast
        # truncates; a GPU rounds to nearest even, which this reproduces bit for bit.
        bits = y.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        tl.store(Y + offs, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=inside)
    else:
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=inside)


def interpreter_active() -> bool:
    """Whether the kernel of this module was defined under the Triton interpreter.

    Examples:
        >>> isinstance(interpreter_active(), bool)
        True
    """
    return type(_scaled_kernel).__name__ == "InterpretedFunction"


def scaled(grad: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(grad · scale)`` computed in fp32 and rounded once to ``dtype``.

    Args:
        grad: contiguous, bf16, fp16 or fp32, any shape (``[N, H]`` or ``[V, H]``).
        scale: one element (the incoming gradient of the loss), any float dtype.
        dtype: bf16, fp16 or fp32.

    Returns:
        A new tensor of ``grad``'s shape in ``dtype``.

    Examples:
        >>> g = torch.ones(2, 3, dtype=torch.bfloat16, device="cuda")  # doctest: +SKIP
        >>> scaled(g, torch.tensor([0.5], device="cuda"), torch.bfloat16)  # doctest: +SKIP
        tensor([[0.5000, 0.5000, 0.5000],
                [0.5000, 0.5000, 0.5000]], device='cuda:0', dtype=torch.bfloat16)
    """
    assert grad.is_contiguous() and scale.numel() == 1  # op.py
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    n = grad.numel()
    if n == 0:
        return out
    s = scale.reshape(1).to(torch.float32)
    with on_tensor_device(grad):
        _scaled_kernel[(triton.cdiv(n, BLOCK),)](
            grad,
            s,
            out,
            n,
            ROUND_BF16_BY_BITS=interpreter_active() and dtype == torch.bfloat16,
            BLOCK=BLOCK,
            num_warps=4,
        )
    return out
