"""DDP and gradient-accumulation equivalence on the real model: the loss is normalised by the trainable tokens of
the whole global batch, so how the global batch of 4 sequences is split must not matter:

    A  torchrun, 2 processes x batch 2                 (DDP, static_graph)
    C  torchrun, 2 processes x batch 1 x accumulation 2 (DDP with no_sync on the first micro-batch)
    B  one plain process x batch 4                      (no process group)
    D  one plain process x batch 2 x accumulation 2

All four must log the same per-step losses and end with the same adapter. Tolerances (fp32 on CPU; sums over
differently shaped padded batches and ranks round differently, ~1e-7 relative per step):

- per-step losses within 1e-5 relative (measured: ~1e-7);
- each adapter tensor within 1e-4 relative Frobenius norm (measured: <= 1.7e-5 after 12 AdamW steps) and
  1e-4 absolute per element (measured: <= 2.7e-5; lr is 5e-3, and AdamW turns rounding noise on a ~0
  gradient into a fraction of lr).

The run crosses an epoch boundary (1.5 epochs of 8 steps), so set_epoch's reshuffle is covered too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.helpers import adapter_tensors, assert_same_adapter, train_losses

LOSS_RTOL = 1e-5
ADAPTER_REL_FROBENIUS, ADAPTER_MAX_ABS = 1e-4, 1e-4


#: The runs come from the session's shared equivalence runs (tests/trainer/conftest.py): test_fsdp.py and
#: test_multinode.py assert on some of the same runs, so the three files share one xdist worker
#: (tests/support/suite.py).
pytestmark = [
    pytest.mark.two_ranks,
    pytest.mark.budget(120, reason="the first test trains the four runs (two of them 2-process torchrun jobs)"),
]
SHAPES = {"A": "ddp_2x2", "C": "ddp_2x1x2", "B": "plain_4", "D": "plain_2x2"}


@pytest.fixture(scope="module")
def runs(equivalence_run) -> dict[str, Path]:
    return {name: equivalence_run(shape) for name, shape in SHAPES.items()}


@pytest.mark.parametrize("name", ["A", "C", "D"])
def test_same_losses_as_one_process_with_the_whole_batch(runs, name):
    reference = train_losses(runs["B"])
    losses = train_losses(runs[name])
    assert len(losses) == len(reference) == 12
    assert losses == pytest.approx(reference, rel=LOSS_RTOL)


@pytest.mark.parametrize("name", ["A", "C", "D"])
def test_same_adapter_as_one_process_with_the_whole_batch(runs, name):
    reference = adapter_tensors(runs["B"] / "adapter")
    assert_same_adapter(
        adapter_tensors(runs[name] / "adapter"), reference, rel_frobenius=ADAPTER_REL_FROBENIUS, max_abs=ADAPTER_MAX_ABS
    )
    # and training did move the adapter: lora_B starts at zero
    assert any(v.abs().max() > 1e-3 for k, v in reference.items() if "lora_B" in k)


def test_reports_agree_on_the_work_done(runs):
    import json

    reports = {k: json.loads((v / "train_report.json").read_text()) for k, v in runs.items()}
    assert {r["global_batch_size"] for r in reports.values()} == {4}
    assert {r["tokens_seen"] for r in reports.values()} == {reports["B"]["tokens_seen"]}
    assert {r["world_size"] for r in reports.values()} == {1, 2}
