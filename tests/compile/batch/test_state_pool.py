"""``LinearStatePool``: slots allocated and freed with requests, forked prefixes, verify
rollback."""

from __future__ import annotations

import pytest
import torch

from compile.batch import LinearStateLayout, LinearStatePool

LAYOUT = LinearStateLayout(layer_ids=(0, 2), conv_dim=6, conv_width=4, num_v_heads=2,
                           head_k_dim=3, head_v_dim=5)


def pool(num_slots: int = 3, rows: int = 4) -> LinearStatePool:
    return LinearStatePool(LAYOUT, num_slots, rows, torch.float32, "cpu")


def test_slots_are_zeroed_on_alloc_and_returned_on_free():
    p = pool()
    assert p.conv.shape == (2, 4, 6, 3) and p.ssm.shape == (2, 4, 2, 3, 5)  # + padding slot 0
    slots = p.alloc([2, 0])
    assert sorted(slots) == [1, 2] and p.req_to_slot.tolist() == [slots[1], 0, slots[0], 0]
    p.conv.fill_(7.0)
    p.ssm.fill_(7.0)
    p.free([2])
    assert p.req_to_slot[2] == 0 and p.available_size() == 2
    again = p.alloc([3])[0]
    assert again in (slots[0], 3)
    for i in range(2):
        assert torch.all(p.conv[i, again] == 0) and torch.all(p.ssm[i, again] == 0)
        assert torch.all(p.conv[i, slots[1]] == 7.0)  # row 0's slot untouched


def test_alloc_beyond_the_free_slots_raises_and_allocates_nothing():
    p = pool(num_slots=2)
    with pytest.raises(RuntimeError, match="out of state slots; asked for 3, 2 free"):
        p.alloc([0, 1, 2])
    assert p.available_size() == 2 and torch.all(p.req_to_slot == 0)


def test_fork_copies_every_layer_of_the_source_slot():
    p = pool()
    src = p.alloc([1])[0]
    p.conv[:, src] = torch.randn(2, 6, 3)
    p.ssm[:, src] = torch.randn(2, 2, 3, 5)
    dst = p.fork(1, 3)
    assert dst != src and p.req_to_slot[3] == dst
    assert torch.equal(p.conv[:, dst], p.conv[:, src]) and torch.equal(p.ssm[:, dst], p.ssm[:, src])
    with pytest.raises(RuntimeError, match="row 0 holds no state slot"):
        p.fork(0, 2)


def test_layer_states_and_unknown_layers():
    p = pool()
    conv, ssm = p.layer_states(2)
    assert conv.data_ptr() == p.conv[1].data_ptr() and ssm.data_ptr() == p.ssm[1].data_ptr()
    with pytest.raises(KeyError, match="layer 1 has no state"):
        p.layer_states(1)


def test_state_bytes_per_request():
    # 2 layers x (conv 6 x 3 + ssm 2 x 3 x 5) x 4 bytes
    assert pool().state_bytes_per_request() == 2 * (6 * 3 + 2 * 3 * 5) * 4
    assert LAYOUT.state_bytes(torch.bfloat16) == 2 * (6 * 3 * 2 + 2 * 3 * 5 * 4)


def test_commit_verified_takes_the_states_after_the_accepted_tokens():
    """Request r (row r of the verify buffers) accepted n tokens: its recurrent state becomes
    ``intermediate_ssm[r, n - 1]`` and its conv window columns ``n .. n + 2`` of its inputs."""
    p = pool()
    a, b = p.alloc([0, 1])
    spec = p.spec_buffers(3, rows=2)
    assert spec.intermediate_ssm.shape == (2, 4, 3, 2, 3, 5)  # rows: max(2, num_slots + 1)
    assert spec.conv_inputs.shape == (2, 4, 6, 3 + 3)
    spec.intermediate_ssm.copy_(torch.randn(spec.intermediate_ssm.shape))
    spec.conv_inputs.copy_(torch.randn(spec.conv_inputs.shape))
    p.commit_verified(torch.tensor([a, b], dtype=torch.int32), torch.tensor([3, 1]))
    for layer in range(2):
        assert torch.equal(p.ssm[layer, a], spec.intermediate_ssm[layer, 0, 2])
        assert torch.equal(p.ssm[layer, b], spec.intermediate_ssm[layer, 1, 0])
        assert torch.equal(p.conv[layer, a], spec.conv_inputs[layer, 0, :, 3:6])
        assert torch.equal(p.conv[layer, b], spec.conv_inputs[layer, 1, :, 1:4])
    assert p.spec_buffers(3, rows=1) is spec  # same tensors while D and rows fit


def test_commit_without_a_verify_step_raises():
    p = pool()
    with pytest.raises(RuntimeError, match="no verify buffers"):
        p.commit_verified(torch.tensor([1]), torch.tensor([1]))


def test_bad_layout_and_sizes_are_rejected():
    with pytest.raises(TypeError, match="expected a LinearStateLayout"):
        LinearStatePool(object(), 2, 2, torch.float32, "cpu")
    with pytest.raises(ValueError, match="num_slots and num_rows must be >= 1"):
        LinearStatePool(LAYOUT, 0, 2, torch.float32, "cpu")
