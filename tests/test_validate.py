"""The shared config validators (megatron_pdm._validate): what they accept, and errors that name the field and value."""

import math

import pytest

from megatron_pdm._validate import check_bool, check_choice, check_int, check_number, is_int, is_number


def test_integers_are_not_bools_and_respect_the_bound():
    assert is_int(3) and not is_int(True) and not is_int(3.0) and not is_int("3")
    assert check_int("rollout.n", 3) == 3 and check_int("rollout.sglang.retries", 0, lo=0) == 0
    assert check_int("model.num_experts", -5, lo=None) == -5
    for bad, message in ((True, "True"), (0, "0"), (2.0, "2.0"), ("4", "'4'"), (None, "None")):
        with pytest.raises(ValueError, match=rf"^rollout\.n: expected an integer >= 1, got {message}$"):
            check_int("rollout.n", bad)
    with pytest.raises(ValueError, match=r"^model\.hidden_size: expected an integer, got False$"):
        check_int("model.hidden_size", False, lo=None)


def test_integer_with_a_special_value():
    assert check_int("rollout.top_k", -1, special=-1) == -1 and check_int("rollout.top_k", 5, special=-1) == 5
    with pytest.raises(ValueError, match=r"^rollout\.top_k: expected -1 \(no truncation\) or an integer >= 1, got 0$"):
        check_int("rollout.top_k", 0, special=-1, special_note="no truncation")
    with pytest.raises(ValueError, match=r"^sampling\.top_k: expected -1 or an integer >= 1, got -2$"):
        check_int("sampling.top_k", -2, special=-1)


def test_numbers_and_their_ranges():
    assert is_number(1) and is_number(0.5) and is_number(math.inf)
    assert not is_number(True) and not is_number(math.nan) and not is_number("1")
    assert check_number("optim.lr", 1e-3, lo=0.0, lo_open=True) == 1e-3
    assert check_number("objective.eps_low", 1.0, lo=0.0, hi=1.0) == 1.0
    for bad in (True, math.nan, "big", None):
        with pytest.raises(ValueError, match=r"^objective\.delta: expected a number, got "):
            check_number("objective.delta", bad)
    with pytest.raises(ValueError, match=r"^sampling\.temperature: expected a finite number, got inf$"):
        check_number("sampling.temperature", math.inf, lo=0, lo_open=True, finite=True)
    with pytest.raises(ValueError, match=r"^optim\.lr: 0\.0 must be > 0\.0$"):
        check_number("optim.lr", 0.0, lo=0.0, lo_open=True)
    with pytest.raises(ValueError, match=r"^objective\.ratio_cap: 0\.5 must be >= 1\.0$"):
        check_number("objective.ratio_cap", 0.5, lo=1.0)
    with pytest.raises(ValueError, match=r"^rollout\.top_p: 1\.5 must be <= 1$"):
        check_number("rollout.top_p", 1.5, lo=0.0, hi=1, lo_open=True)
    with pytest.raises(ValueError, match=r"^optim\.adam_beta2: 1 must be < 1$"):
        check_number("optim.adam_beta2", 1, lo=0.0, hi=1, hi_open=True)


def test_bools_and_choices():
    assert check_bool("train.refill", False) is False
    for bad in (1, "true", None):
        with pytest.raises(ValueError, match=rf"^train\.refill: expected true or false, got {bad!r}$"):
            check_bool("train.refill", bad)
    assert check_choice("train.init", "hf", ("random", "hf")) == "hf"
    with pytest.raises(ValueError, match=r"^train\.init: 'HF' is not one of random, hf$"):
        check_choice("train.init", "HF", ("random", "hf"))
    with pytest.raises(ValueError, match=r"^train\.init: \['hf'\] is not one of random, hf$"):
        check_choice("train.init", ["hf"], ("random", "hf"))
