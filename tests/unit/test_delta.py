"""The weight delta codec (common/delta.py): a round trip reproduces the new version bit for bit whatever changed,
and the encoding is never much larger than the full copy.

    .venv/bin/python -m pytest -q tests/unit/test_delta.py
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbus.common.delta import ALL, IDX, VAL, apply_delta, encode_delta


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12)), min_size=1, max_size=4),
       frac=st.floats(0.0, 1.0), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))  # fmt: skip
def test_round_trip_is_bit_exact(shapes: list[tuple[int, int]], frac: float, seed: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    old = {f"t{i}": torch.randn(*s, generator=g).to(dtype) for i, s in enumerate(shapes)}
    new = {}
    for name, t in old.items():
        change = torch.rand(t.shape, generator=g) < frac
        moved = (t.float() + 1e-3 * torch.randn(t.shape, generator=g)).to(dtype)
        new[name] = torch.where(change, moved, t)
    # bit patterns a float compare would miss: -0.0 for 0.0 and a NaN payload
    first = next(iter(new))
    old[first].view(-1)[0], new[first].view(-1)[0] = 0.0, -0.0
    delta = encode_delta(old, new)
    fresh = apply_delta(old, delta.tensors)
    for name, t in new.items():
        got = fresh.get(name, old[name])
        assert torch.equal(got.view(torch.int16 if t.element_size() == 2 else torch.int32),
                           t.view(torch.int16 if t.element_size() == 2 else torch.int32)), name
    assert set(fresh) == {n for n in new if not torch.equal(new[n].view(-1).view(torch.uint8),
                                                            old[n].view(-1).view(torch.uint8))}  # fmt: skip
    full = sum(t.numel() * t.element_size() for t in new.values())
    assert delta.num_bytes <= full  # the dense fallback bounds it
    assert 0.0 < delta.density <= 1.0


def test_sparse_where_few_changed_dense_where_many() -> None:
    old = {"a": torch.zeros(1000), "b": torch.zeros(10), "c": torch.ones(3)}
    new = {"a": old["a"].clone(), "b": torch.arange(10.0), "c": torch.ones(3)}
    new["a"][[3, 500]] = 7.0
    delta = encode_delta(old, new)
    assert set(delta.tensors) == {"a" + IDX, "a" + VAL, "b" + ALL}  # c unchanged: absent
    assert delta.tensors["a" + IDX].tolist() == [3, 500] and delta.tensors["a" + IDX].dtype == torch.int32
    assert delta.num_changed == 2 + 9 and delta.num_values == 1013
    assert delta.num_bytes == 2 * 4 + 2 * 4 + 10 * 4


def test_versions_that_do_not_match_are_refused() -> None:
    with pytest.raises(ValueError, match="other tensors"):
        encode_delta({"a": torch.zeros(2)}, {"b": torch.zeros(2)})
    with pytest.raises(ValueError, match="shape or dtype"):
        encode_delta({"a": torch.zeros(2)}, {"a": torch.zeros(2, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="does not fit"):
        apply_delta({"a": torch.zeros(2)}, {"a" + ALL: torch.zeros(3)})
