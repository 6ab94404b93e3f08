"""Token-budget micro-batches (train.pack_micro_batches) and the variable-length attention of packed rows
(vime_core.attention), in plain torch: packed attention == each sample alone, values and gradients, fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vime_core.attention import VIEW_MIN_TOKENS, group_lengths, varlen_attention, varlen_layout
from vime_core.trainer import pack_micro_batches
from vime_core.trainer.batching import lockstep_pads, pad_samples


@pytest.mark.parametrize(
    "lengths, budget",
    [
        ([4136, 4136, 1064, 40, 4100, 900, 900, 12], 9216),
        ([5, 3, 8, 1, 1, 9, 2, 7], 10),
        ([100] * 7, 250),
    ],
)
def test_micro_batches_hold_every_sample_once_within_the_budget(lengths, budget):
    batches = pack_micro_batches(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or sum(lengths[i] for i in b) <= budget


def test_the_budget_counts_tokens_not_padded_rows():
    # one 4,136-token sample and five of 1,000 tokens: 9,136 tokens fit one micro-batch; the padded cost of the same
    # rows would be 6 x 4,136 (the old packer made two micro-batches of it)
    lengths = [1000, 4136, 1000, 1000, 1000, 1000]
    assert pack_micro_batches(lengths, 9216) == [[1, 0, 2, 3, 4, 5]]


def test_a_sample_over_the_budget_gets_its_own_micro_batch():
    batches = pack_micro_batches([50, 300, 40], 100)
    assert [1] in batches
    assert sorted(map(sorted, batches)) == [[0, 2], [1]]


def test_packing_is_deterministic():
    lengths = [7, 3, 7, 3, 9, 1]
    assert pack_micro_batches(lengths, 12) == pack_micro_batches(list(lengths), 12)


@pytest.mark.parametrize("lens", [[5, 9, 5, 2, 16, 16, 1], [40, 3], [12]])
def test_groups_bound_the_padding(lens):
    groups = group_lengths(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        padded = len(g) * max(lens[i] for i in g)
        assert len(g) == 1 or padded <= 1.25 * sum(lens[i] for i in g)


def _alone(q, k, v, lens, scale):
    """Each sample on its own: [t, h, d] -> [t, h, d], GQA by repeating k/v heads."""
    rep = q.size(1) // k.size(1)
    outs, start = [], 0
    for n in lens:
        qs, ks, vs = (x[start : start + n].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(outs)


# view_min_tokens: VIEW_MIN_TOKENS keeps these short samples in padded groups (views only for equal neighbours and
# lone samples); 0 attends every sample on a view; 30 mixes views and padded groups in one row
@pytest.mark.parametrize("view_min_tokens", [VIEW_MIN_TOKENS, 0, 30])
@pytest.mark.parametrize("lens", [[5, 9, 5, 2, 16, 16, 1], [7], [3, 30], [6, 6, 6, 3], [40, 3, 5, 4]])
def test_varlen_attention_equals_each_sample_alone(lens, view_min_tokens):
    g = torch.Generator().manual_seed(len(lens))
    t, heads, groups, d = sum(lens), 4, 2, 8
    q, k, v = (
        torch.randn(t, n, d, generator=g, dtype=torch.float32).requires_grad_(True) for n in (heads, groups, groups)
    )
    upstream = torch.randn(t, heads, d, generator=g, dtype=torch.float32)
    scale = d**-0.5
    got = varlen_attention(q, k, v, varlen_layout(lens, "cpu", view_min_tokens), scale)
    grads = torch.autograd.grad((got * upstream).sum(), (q, k, v))
    want = _alone(q, k, v, lens, scale)
    want_grads = torch.autograd.grad((want * upstream).sum(), (q, k, v))
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    for a, b in zip(grads, want_grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "lens, view_min_tokens, views, in_order",
    [
        ([4136, 4136], VIEW_MIN_TOKENS, [(2, 4136, 0)], True),  # equal neighbours: one [2, 4136] view
        ([4150, 4090], VIEW_MIN_TOKENS, [(1, 4150, 0), (1, 4090, 4150)], True),  # long: a view each, no padding
        ([5, 9, 5, 2], VIEW_MIN_TOKENS, [(1, 9, 5)], False),  # short, uneven: a padded group (and a lone view)
        ([40, 3, 5, 4], 30, [(1, 40, 0)], False),  # a view among padded groups: assembled by token index
    ],
)
def test_layout_attends_long_and_equal_samples_on_views(lens, view_min_tokens, views, in_order):
    layout = varlen_layout(lens, "cpu", view_min_tokens)
    assert [(g.rows, g.width, g.start) for g in layout.groups if g.dst is None] == views
    assert layout.in_order is in_order
    assert sum(g.rows for g in layout.groups if g.dst is None) + sum(
        g.rows for g in layout.groups if g.dst is not None
    ) == len(lens)
    assert layout.positions.tolist() == [i for n in lens for i in range(n)]


def test_lockstep_pads_fill_each_place_up_to_the_longest_and_add_the_missing_ones():
    # this rank packed 3 micro-batches of 20, 9 and 4 tokens; the EP ranks' longest at each of 4 places: 20, 12, 4, 7
    assert lockstep_pads([20, 9, 4], [20, 12, 4, 7]) == [0, 3, 0, 7]
    assert lockstep_pads([5], [5]) == [0]
    with pytest.raises(ValueError, match="below this rank's micro-batch sizes"):
        lockstep_pads([20, 9], [20])  # fewer places than this rank packs: not a max over the ranks


def test_a_pad_sample_is_prompt_only_and_none_for_no_tokens():
    (pad,) = pad_samples(3)
    assert (pad.tokens, pad.prompt_len, pad.response_len, pad.loss_mask, pad.rollout_logprobs) == (
        [0] * 3,
        3,
        0,
        [],
        [],
    )
    assert pad_samples(0) == []


def test_a_replayed_pad_routes_every_token_to_fixed_experts_and_passes_the_checks():
    from vime_core.trainer.routing import check_routed_experts, packed_routing

    (pad,) = pad_samples(3, routing=(2, 2))
    assert pad.routed_experts.shape == (2, 2, 2) and pad.routed_experts.tolist() == [[[0, 1]] * 2] * 2
    (one,) = pad_samples(1, routing=(2, 2))  # one token: no engine row, the packed row still gets its experts
    check_routed_experts([pad, one], num_layers=2, top_k=2, num_experts=4)
    packed = packed_routing([pad, one])
    assert packed.shape == (4, 2, 2) and packed[3].tolist() == [[0, 1], [0, 1]]
    assert pad_samples(3)[0].routed_experts is None  # without replay the padding carries none
