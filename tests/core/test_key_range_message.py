"""The error for a key the random features cannot represent states the key's own norm, its log
feature scale and the largest norm allowed, consistently: the refused norm exceeds the stated
bound, and for ``trf`` the log scale is |x|^2 / (2 sqrt(d)) of that same norm."""

from __future__ import annotations

import math
import re

import pytest
import torch

from hf_kernattn.modeling.feature_maps import KEY_MAX_LOG_SCALE, FeatureMap

PATTERN = (r"cannot represent a key of norm (?P<norm>[\d.e+]+) in float32: its log feature scale is (?P<scale>[-\d.e+]+|-inf \(every feature underflows\)), "
           r".* key norms up to about (?P<bound>[\d.e+]+) for head_dim=(?P<d>\d+)")


@pytest.mark.parametrize("kind, norm", [("trf", 40.0), ("trf", 25.0), ("prf", 200.0)])
def test_the_refused_norm_is_the_keys_own_and_exceeds_the_stated_bound(kind, norm):
    d = 16
    fm = FeatureMap(d, kind, num_random_features=32)
    direction = torch.randn(d, generator=torch.Generator().manual_seed(0))
    keys = torch.zeros(1, 1, 3, d)
    keys[0, 0, 1] = direction / direction.norm() * norm  # one key out of range, the others zero
    with pytest.raises(ValueError) as err:
        fm(keys, is_query=False)
    m = re.search(PATTERN, str(err.value))
    assert m, str(err.value)
    stated, scale, bound = float(m["norm"]), float(m["scale"].split()[0]), float(m["bound"])
    assert int(m["d"]) == d
    assert stated == pytest.approx(norm, rel=5e-3)  # printed with 3 significant digits
    assert bound == pytest.approx(math.sqrt(2 * KEY_MAX_LOG_SCALE[torch.float32]) * d ** 0.25, rel=5e-3)
    assert stated > bound
    if kind == "trf":  # the log amplitude |u|^2 / 2 with u = x d^-1/4
        assert scale == pytest.approx(norm ** 2 / (2 * math.sqrt(d)), rel=1e-3)
        assert scale > KEY_MAX_LOG_SCALE[torch.float32]
    else:  # max_m (w_m . u) - |u|^2 / 2 below the range (-inf: every feature underflowed)
        assert scale < -KEY_MAX_LOG_SCALE[torch.float32]
