"""torchtitan's chunked loss over a fully_shard unit of two modules, against torch's fully_shard;
and a freed unsharded parameter fails loudly where it is read.

Layer: several ranks (rank code in tests/workers_fsdp_chunked_loss.py).  The pattern of
torchtitan 0.3.0's Llama 3 with its default loss: ``fully_shard([model.norm, model.output],
reshard_after_forward=False)``, the model's forward ending at the norm, the head unsharded
explicitly and run chunk by chunk with a backward each, resharded explicitly, then the
backward through the norm.  That backward reads the norm's weight, which the explicit
reshard freed: dptc used to segfault there, on every rank, every time ([Note: a unit of
several modules] in dptc/fsdp/_state.py).  Each variant trains 4 steps with clip_grad_norm_
and AdamW on dptc's fully_shard and on torch's, in the same processes, and compares losses
and parameters.
"""

import pytest

from tests._compare import max_rel
from tests._launch import once, run_ranks

TIMEOUT_S = 240
# name: (bf16 MixedPrecisionPolicy, activation checkpointing on the blocks, chunks)
VARIANTS = {
    "fp32": (False, False, 2),
    "fp32_one_chunk": (False, False, 1),
    "bf16": (True, False, 2),
    "fp32_checkpointed": (False, True, 3),
}
# The same sums in the same order: every variant measured bit-identical (0.0) to torch's,
# losses and parameters, on both ranks (2026-12-07).
TOLERANCE = 1e-6

_launches = {}


def _results():
    return once(_launches, "chunked",
                lambda: run_ranks("tests.workers_fsdp_chunked_loss:chunked_loss_case", 2,
                                  args={"variants": VARIANTS}, timeout=TIMEOUT_S),
                "the chunked-loss launch at 2 ranks")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_loss_matches_torch(variant):
    for rank, per_rank in enumerate(_results()):
        ours, theirs = per_rank[variant]["dptc"], per_rank[variant]["torch"]
        assert len(ours["losses"]) == len(theirs["losses"]) == 4
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], theirs["losses"]))
        assert loss_diff <= TOLERANCE, (rank, ours["losses"], theirs["losses"])
        assert max_rel(ours["params"], theirs["params"]) <= TOLERANCE, rank
    # Training moved the parameters, and both ranks hold the same model.
    first, second = (r[variant]["dptc"] for r in _results())
    assert max_rel(first["params"], second["params"]) == 0.0
    assert first["losses"][0] != first["losses"][-1]


def test_freed_parameter_fails_loudly():
    results = run_ranks("tests.workers_fsdp_chunked_loss:freed_parameter_case", 2,
                        timeout=TIMEOUT_S)
    for rank, result in enumerate(results):
        held = result["held"]
        assert held["type"] == "RuntimeError", (rank, held)
        assert "freed when the unit resharded" in held["message"]
        assert "FreedParameter" in result["repr"] and result["held_shape"] == [32, 16]
        backward = result["backward"]
        assert backward["type"] == "RuntimeError", (rank, backward)
        # autograd's own check, on the version the reshard moved (FREED_VERSION = 2 ** 30).
        assert "is at version 1073741824" in backward["message"], backward["message"]
        assert len(result["after"]) == 2 and result["grads"]
