"""``compile.engine.sampling``: ``SamplingParams`` rejects what it cannot honour (before the fix
``max_new_tokens=0`` still generated a token and a negative or NaN temperature became greedy),
``sample`` is greedy at temperature 0, and the module's docstring examples run."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest
import torch

import compile.engine.sampling
from compile.engine import SamplingParams, sample


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(max_new_tokens=0), ValueError,
     r"^SamplingParams: max_new_tokens is below 1; expected an integer >= 1 \(tokens to "
     r"generate\), got 0\. Ask for at least one new token\.$"),
    (dict(max_new_tokens=-4), ValueError, r"max_new_tokens is below 1; .*, got -4\."),
    (dict(max_new_tokens=2.5), TypeError, r"max_new_tokens has type float; .*got 2\.5\."),
    (dict(max_new_tokens=True), TypeError, r"max_new_tokens has type bool"),
    (dict(max_new_tokens="8"), TypeError, r"max_new_tokens has type str; .*got '8'\."),
    (dict(temperature=-1.0), ValueError,
     r"^SamplingParams: temperature is not a finite number >= 0; expected >= 0 \(0 = greedy\), "
     r"got -1\.0\. Pass 0 for greedy decoding or a positive temperature\.$"),
    (dict(temperature=math.nan), ValueError, r"temperature is not a finite .*, got nan\."),
    (dict(temperature=math.inf), ValueError, r"temperature is not a finite .*, got inf\."),
    (dict(temperature=-1e-9), ValueError, r"temperature is not a finite .*, got -1e-09\."),
    (dict(temperature="hot"), TypeError, r"temperature has type str; .*got 'hot'\."),
    (dict(temperature=None), TypeError, r"temperature has type NoneType"),
    (dict(stop_token_ids=(2, -1)), ValueError,
     r"stop_token_ids holds -1; expected integer token ids >= 0, got \(2, -1\)\."),
    (dict(stop_token_ids=("a",)), TypeError, r"stop_token_ids holds 'a'"),
])
def test_sampling_params_reject_bad_values(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        SamplingParams(**kwargs)


def test_sampling_params_accept_the_documented_range():
    greedy = SamplingParams(max_new_tokens=1, temperature=0)  # 0 = greedy, an int is fine
    assert (greedy.max_new_tokens, greedy.temperature) == (1, 0)
    hot = SamplingParams(max_new_tokens=np.int64(3), temperature=np.float32(0.5),
                         stop_token_ids=[0, 7])
    assert hot.max_new_tokens == 3 and hot.stop_token_ids == [0, 7]


def test_sample_greedy_rows_stay_greedy_next_to_sampled_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 11)
    temps = torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0, 0.5])
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        tokens = sample(logits, temps, g)
        assert tokens.dtype == torch.int64 and tokens.shape == (6,)
        greedy = temps == 0
        assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])
        assert bool(((tokens >= 0) & (tokens < 11)).all())


def test_docstring_examples():
    result = doctest.testmod(compile.engine.sampling, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3 and result.failed == 0, result
