"""MoE parallel folding at run time (codegen/expert_folding.py): the folded ep groups, the expert
gradients' divisor, what the runtime refuses, and the example inputs of the local export. The
numerics against one process are tests/dist/test_expert_folding_runs.py."""

from types import SimpleNamespace

import torch

from autopar.codegen.expert_folding import _first_tokens, expert_gradient_divisor, folding_blocker, folds_experts
from autopar.codegen.runtime import folded_expert_ranks


def _plan(tp=2, dp=2, pp=1, ep=2, etp=1, recompute="none", cp=1):
    return SimpleNamespace(mesh={"pp": pp, "dp": dp, "tp": tp, "cp": cp}, ep=ep, etp=etp, recompute=recompute)


def test_folded_ep_groups_are_consecutive_ranks_of_the_dp_tp_grid() -> None:
    ranks = folded_expert_ranks((1, 2, 2), 2)  # (pp, dp, tp): rank = 2 dp + tp
    assert ranks.shape == (1, 2, 1, 2)
    assert ranks[0, :, 0].tolist() == [[0, 1], [2, 3]]  # ep groups: the tp pair of each dp rank
    assert ranks[0, :, 0, 0].tolist() == [0, 2]  # replicas of expert block 0 (dp_rep)
    assert folded_expert_ranks((1, 2, 2), 4)[0, 0, 0].tolist() == [0, 1, 2, 3]
    assert folded_expert_ranks((2, 2, 2), 2)[1, :, 0].tolist() == [[4, 5], [6, 7]]  # per pipeline stage


def test_expert_gradients_are_averaged_over_dp() -> None:
    # FSDP averages over dp_rep = dp x tp / ep; the gradient wanted is the sum over them / dp.
    assert expert_gradient_divisor(_plan(tp=2, dp=2, ep=2)) == 1
    assert expert_gradient_divisor(_plan(tp=2, dp=2, ep=4)) == 2
    assert expert_gradient_divisor(_plan(tp=4, dp=2, ep=2)) == 0.5
    assert expert_gradient_divisor(_plan(tp=2, dp=4, ep=2, etp=None)) == 2  # not folded: ep


def test_what_runs_folded() -> None:
    assert folds_experts(_plan()) and not folds_experts(_plan(etp=None)) and not folds_experts(_plan(tp=1))
    assert folding_blocker(_plan()) == folding_blocker(_plan(pp=2, recompute="full")) == ""
    assert "recompute='modules:moe_act'" in folding_blocker(_plan(recompute="modules:moe_act"))


def test_local_export_inputs_keep_the_first_tokens_of_each_sequence() -> None:
    ids, mask, other = torch.arange(32).view(2, 16), torch.ones(2, 16), torch.zeros(2, 3)
    cut = _first_tokens((ids, mask, other, 7), 16, 8)
    assert cut[0].tolist() == ids[:, :8].tolist() and cut[1].shape == (2, 8)
    assert cut[2] is other and cut[3] == 7
