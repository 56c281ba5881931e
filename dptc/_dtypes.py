"""Codes shared with the C core (csrc/dptc.h): dtypes, reduce ops, collectives."""

import torch
import torch.distributed as dist

__all__ = ["dtype_code", "redop_code", "redop_name", "torch_dtype", "torch_reduce_op",
           "element_size", "is_floating", "BITWISE_REDOPS", "OP_ALL_REDUCE", "OP_BROADCAST",
           "OP_ALL_GATHER", "OP_REDUCE_SCATTER", "OP_BARRIER"]

OP_ALL_REDUCE = 0
OP_BROADCAST = 1
OP_ALL_GATHER = 2
OP_REDUCE_SCATTER = 3
OP_BARRIER = 4

_DTYPES = {
    torch.float32: 0,
    torch.float64: 1,
    torch.bfloat16: 2,
    torch.float16: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.uint8: 6,
    torch.int8: 7,
    torch.bool: 8,
}

_FLOATING = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def dtype_code(dtype, argname="tensor"):
    try:
        return _DTYPES[dtype]
    except KeyError:
        supported = ", ".join(str(d) for d in _DTYPES)
        raise TypeError(f"{argname} has dtype {dtype}, which dptc does not "
                        f"communicate; use one of {supported}") from None


def is_floating(dtype):
    return dtype in _FLOATING


_CODES = {code: dtype for dtype, code in _DTYPES.items()}


def torch_dtype(code):
    return _CODES[code]


def element_size(dtype):
    return dtype.itemsize


# Reduce ops: dptc codes (csrc/dptc.h) for torch.distributed.ReduceOp values.
(REDOP_SUM, REDOP_AVG, REDOP_MAX, REDOP_MIN, REDOP_PRODUCT, REDOP_BAND, REDOP_BOR,
 REDOP_BXOR) = range(8)
_REDOPS = [
    (dist.ReduceOp.SUM, REDOP_SUM),
    (dist.ReduceOp.AVG, REDOP_AVG),
    (dist.ReduceOp.MAX, REDOP_MAX),
    (dist.ReduceOp.MIN, REDOP_MIN),
    (dist.ReduceOp.PRODUCT, REDOP_PRODUCT),
    (dist.ReduceOp.BAND, REDOP_BAND),
    (dist.ReduceOp.BOR, REDOP_BOR),
    (dist.ReduceOp.BXOR, REDOP_BXOR),
]
_REDOP_NAMES = {code: torch_op.name for torch_op, code in _REDOPS}
BITWISE_REDOPS = (REDOP_BAND, REDOP_BOR, REDOP_BXOR)
# torch's names of the integer scalar types, as its casting errors print them.
_TORCH_SCALAR_NAMES = {torch.int64: "Long", torch.int32: "Int", torch.int16: "Short",
                       torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool"}


def redop_name(code):
    """"BAND" for REDOP_BAND: the name torch's messages give the op."""
    return _REDOP_NAMES[code]


def redop_code(op, dtype, argname="op"):
    if not isinstance(op, dist.ReduceOp):
        # ReduceOp.SUM == 0 holds, so a bare int would pass the lookup; torch refuses it.
        raise TypeError(f"{argname} must be a torch.distributed.ReduceOp (dptc.ReduceOp), got "
                        f"{type(op).__name__} {op!r}; pass e.g. ReduceOp.SUM")
    for torch_op, code in _REDOPS:
        if op == torch_op:
            break
    else:
        names = ", ".join(f"ReduceOp.{n}" for n in _REDOP_NAMES.values())
        raise ValueError(f"{argname}={op!r} is not supported by dptc; use one of {names}")
    if code == REDOP_AVG and not is_floating(dtype):
        # RuntimeError and torch's words first, as torch's gloo raises it (its AVG divides the
        # integer sum in place, which torch's casting rules refuse).
        raise RuntimeError(f"result type Float can't be cast to the desired output type "
                           f"{_TORCH_SCALAR_NAMES.get(dtype, dtype)}: {argname}=ReduceOp.AVG "
                           f"needs a floating-point tensor, got {dtype}; use ReduceOp.SUM and "
                           f"divide, or convert the tensor to float")
    if code in BITWISE_REDOPS and is_floating(dtype):
        # RuntimeError and torch's words first, as torch's gloo raises it.
        name = _REDOP_NAMES[code]
        raise RuntimeError(f"Cannot use ReduceOp.{name} with non-integral dtype: "
                           f"{argname}=ReduceOp.{name} needs an integer or bool tensor, got "
                           f"{dtype}; reduce its bytes instead (tensor.view(torch.uint8): a "
                           f"bitwise op acts on every byte alike), or convert it "
                           f"(tensor.bool() for flags, tensor.to(torch.int64) for masks)")
    return code


def torch_reduce_op(code):
    for torch_op, c in _REDOPS:
        if c == code:
            return torch_op
    raise ValueError(f"unknown reduce op code {code}")
