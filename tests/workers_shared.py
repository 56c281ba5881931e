"""Rank-side functions for tests/test_shared.py: shared buffers (csrc/engine.h)."""

import torch

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32,
          torch.int64, torch.uint8)
COUNTS = (1, 7, 1000, 65537, 300001)


def _inputs(count, rank, dtype):
    return ((torch.arange(count) * 7 + rank) % 13).to(dtype)


def _scatter_input(count, rank, block, dtype):
    """Block `block` of rank `rank`'s reduce-scatter input: different for every (rank, block),
    so reducing the wrong block, or rank r's block q in place of rank q's block r, shows.  The
    values and every partial sum over up to 4 ranks are integers the dtype holds exactly: up to
    1000 * 3 + 10 * 3 + 6 for the wide dtypes; 16 * rank + 4 * block + (0..3) <= 63, with sums
    <= 156, for the 8-bit mantissas of bfloat16 and for uint8."""
    index = torch.arange(count)
    if dtype in (torch.bfloat16, torch.float16, torch.uint8):
        values = 16 * rank + 4 * block + index % 4
    else:
        values = 1000 * rank + 10 * block + index % 7
    return values.to(dtype)


def all_reduce_cases():
    """In-place all-reduces at several offsets of shared buffers; returns failures."""
    import dptc
    pg = dptc.group.default_group()
    rank, size = pg.rank, pg.size
    failures = []
    for dtype in DTYPES:
        ops = [dptc.ReduceOp.SUM, dptc.ReduceOp.MAX, dptc.ReduceOp.MIN]
        if dtype.is_floating_point:
            ops.append(dptc.ReduceOp.AVG)
        for count in COUNTS:
            pad = 33
            buffer = pg.empty_shared(count + 2 * pad, dtype)
            if buffer.abs().sum().item() != 0:
                failures.append(f"{dtype} {count}: new buffer not zero")
            for op in ops:
                tensor = buffer[pad:pad + count]
                tensor.copy_(_inputs(count, rank, dtype))
                dptc.all_reduce(tensor, op=op)
                every = torch.stack([_inputs(count, r, dtype).double() for r in range(size)])
                want = {dptc.ReduceOp.SUM: every.sum(0), dptc.ReduceOp.MAX: every.max(0).values,
                        dptc.ReduceOp.MIN: every.min(0).values,
                        dptc.ReduceOp.AVG: every.sum(0) / size}[op]
                # Rounding of one division (AVG) or one 16-bit rounding; integers are exact.
                tolerance = {torch.bfloat16: 1e-2, torch.float16: 1e-3,
                             torch.float32: 1e-6, torch.float64: 1e-12}.get(dtype, 0.0)
                error = (tensor.double() - want).abs().max().item()
                if error > tolerance * max(1.0, want.abs().max().item()):
                    failures.append(f"{dtype} count={count} op={op}: max error {error}")
                if buffer[:pad].abs().sum().item() or buffer[pad + count:].abs().sum().item():
                    failures.append(f"{dtype} count={count} op={op}: wrote outside the tensor")
    return failures


def shared_against_plain():
    """Rank 0 reduces a shared tensor, the others a plain one: a mismatch, not garbage."""
    import dptc
    pg = dptc.group.default_group()
    shared = pg.empty_shared(10, torch.float32)
    tensor = shared if pg.rank == 0 else torch.zeros(10)
    dptc.all_reduce(tensor)
    return "completed"


def outlives_group():
    """A shared tensor stays usable memory after destroy_process_group."""
    import dptc
    pg = dptc.group.default_group()
    tensor = pg.empty_shared(1000, torch.float32)
    tensor.fill_(pg.rank + 1)
    dptc.all_reduce(tensor)
    dptc.destroy_process_group()
    tensor += 1
    return tensor.sum().item()


def gather_scatter_cases():
    """all_gather_into_tensor into shared outputs and reduce_scatter_tensor from shared inputs,
    out of place and in place (the shard being the rank's own block); returns failures."""
    import dptc
    pg = dptc.group.default_group()
    rank, size = pg.rank, pg.size
    failures = []
    for dtype in DTYPES:
        for count in COUNTS:
            shards = [_inputs(count, r, dtype) for r in range(size)]
            gathered = torch.cat(shards)
            for in_place in (False, True):
                out = pg.empty_shared(size * count, dtype)
                out.fill_(1)
                shard = out[rank * count:(rank + 1) * count] if in_place else shards[rank].clone()
                shard.copy_(shards[rank])
                dptc.all_gather_into_tensor(out, shard)
                if not torch.equal(out, gathered):
                    failures.append(f"all_gather {dtype} count={count} in_place={in_place}")
                full = pg.empty_shared(size * count, dtype)
                full.copy_(torch.cat([_scatter_input(count, rank, b, dtype)
                                      for b in range(size)]))
                block = full[rank * count:(rank + 1) * count] if in_place \
                    else torch.full((count,), 99, dtype=dtype)
                dptc.reduce_scatter_tensor(block, full, op=dptc.ReduceOp.SUM)
                want = sum(_scatter_input(count, q, rank, dtype).double() for q in range(size))
                wrong = int((block.double() != want).sum().item())
                if wrong:
                    failures.append(f"reduce_scatter {dtype} count={count} in_place={in_place}: "
                                    f"{wrong} of {count} elements differ")
    return failures
