"""I-BLM's regression targets: the refusals of observations that the
likelihood's targets cannot be made from, by message."""

import re

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.infer.autoguide import AutoNormal

from pyro_vinit import init_guide_iblm


def _model(kind, k):
    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([k, 4]).to_event(2))
        b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([k]).to_event(1))
        out = F.linear(x, w, b)
        with pyro.plate("data", x.shape[0]):
            if kind == "categorical":
                pyro.sample("obs", dist.Categorical(logits=out), obs=y)
            elif kind == "onehot":
                pyro.sample("obs", dist.OneHotCategorical(logits=out), obs=y)
            elif kind == "bernoulli":
                pyro.sample("obs", dist.Bernoulli(logits=out[:, 0]), obs=y)
            else:
                pyro.sample("obs", dist.Normal(out.sum(-1), 1.0), obs=y)

    return model


_LABELS = torch.tensor([0, 1, 2, 1, 0, 2, 1, 0])


@pytest.mark.parametrize("kind, k, y, message", [
    ("categorical", 3, _LABELS + 0.5, "Categorical labels must be integers"),
    ("categorical", 3, torch.where(_LABELS == 2, 3, _LABELS),
     "labels out of range: the Categorical likelihood has 3 classes, so labels must be "
     "integers in [0, 2]; got values in [0, 3]"),
    ("categorical", 3, _LABELS - 1,
     "labels out of range: the Categorical likelihood has 3 classes, so labels must be "
     "integers in [0, 2]; got values in [-1, 1]"),
    ("onehot", 3, torch.tensor([1.0, 0.0, 1.0]).expand(8, 3),
     "labels out of range: OneHotCategorical observations must be one-hot rows"),
    ("onehot", 3, 2 * F.one_hot(_LABELS, 3).float(),
     "labels out of range: OneHotCategorical observations must be one-hot rows"),
    ("bernoulli", 1, _LABELS.float(), "labels out of range: Bernoulli observations must be 0 or 1"),
    ("normal", 2, torch.randn(8),
     "the output layer ('w') has 2 outputs but the likelihood has 1 target columns; I-BLM "
     "needs them to match"),
], ids=["non_integer", "above", "below", "two_ones", "a_two", "bernoulli", "columns"])
def test_observations_the_targets_cannot_be_made_from_are_refused(kind, k, y, message):
    x = torch.randn(8, 4)
    guide = AutoNormal(_model(kind, k))
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        init_guide_iblm(guide, (x, y), batch_size=8)


def test_observations_without_the_rows_along_the_leading_dim_are_refused_by_name():
    # the observed value (1, 20) for 20 data rows: the rows are not along its leading dim
    x = torch.randn(20, 4)
    y = torch.randn(20)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([1, 4]).to_event(2))
        out = F.linear(x, w)
        pyro.sample("obs", dist.Normal(out.T, 1.0).to_event(2),
                    obs=None if y is None else y[None])

    guide = AutoNormal(model)
    with pytest.raises(ValueError, match=r"^the observed site has shape \(1, 20\) for 20 data "
                                         r"rows; I-BLM needs the data rows along the leading dim"):
        init_guide_iblm(guide, (x, y), batch_size=20)
