"""
Every ``Usage::`` block in a public docstring runs as printed.

The blocks are collected from the docstrings of the public modules, of every
object in a public module's ``__all__`` and of the public methods of those
classes, and each is executed in a fresh namespace holding the public API, a
few standard imports and the small fixtures of :func:`_namespace`. A block
that cannot run as written is marked ``xfail(strict=True)`` in ``KNOWN_BROKEN``
with the fix it needs; fixing the docstring makes the test pass and the marker
must then go.
"""

import importlib
import inspect
import pkgutil
import re
import textwrap

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal
from pyro.optim import Adam
from torch import nn

import pyro_vinit

PUBLIC_MODULES = ["pyro_vinit"] + sorted(
    info.name
    for info in pkgutil.walk_packages(pyro_vinit.__path__, prefix="pyro_vinit.")
    if not any(part.startswith("_") for part in info.name.split("."))
)

# Blocks that use a regression model and real-valued targets; all others get
# the classifier fixtures.
REGRESSION = {
    "pyro_vinit.metrics.RegressionMetrics",
    "pyro_vinit.metrics.regression_metrics",
    "pyro_vinit.metrics.rmse",
    "pyro_vinit.metrics.functional.regression_metrics",
    "pyro_vinit.metrics.functional.rmse",
    "pyro_vinit.metrics.streaming.RegressionMetrics",
}

# id -> the fix the block needs (the test is an expected failure until then).
KNOWN_BROKEN = {}


def _usage_blocks(doc):
    """The literal blocks introduced by a line ending in ``Usage::``."""
    lines = inspect.cleandoc(doc).splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if not line.rstrip().endswith("Usage::"):
            continue
        indent = len(line) - len(line.lstrip())
        body = []
        for following in lines[i + 1 :]:
            if following.strip() and len(following) - len(following.lstrip()) <= indent:
                break
            body.append(following)
        blocks.append(textwrap.dedent("\n".join(body)).strip("\n"))
    return blocks


def _documented_objects():
    """(qualified name, object) of every public module, ``__all__`` member and
    public method, each once, named where it is defined."""
    seen = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        seen.setdefault(module_name, module)
        for attr in module.__all__:
            obj = getattr(module, attr)
            if inspect.ismodule(obj) or not hasattr(obj, "__qualname__"):
                continue
            seen.setdefault(f"{obj.__module__}.{obj.__qualname__}", obj)
            if not inspect.isclass(obj):
                continue
            for name, member in vars(obj).items():
                if name.startswith("_") and name not in ("__init__", "__call__"):
                    continue
                if isinstance(member, property):
                    member = member.fget
                member = getattr(member, "__func__", member)  # static and class methods
                if callable(member):
                    seen.setdefault(f"{obj.__module__}.{obj.__qualname__}.{name}", member)
    return seen


def _collect():
    params = []
    for qualname, obj in sorted(_documented_objects().items()):
        blocks = _usage_blocks(obj.__doc__ or "")
        for i, block in enumerate(blocks):
            test_id = qualname if len(blocks) == 1 else f"{qualname}[{i}]"
            marks = []
            if test_id in KNOWN_BROKEN:
                marks = [pytest.mark.xfail(strict=True, reason=KNOWN_BROKEN[test_id])]
            params.append(pytest.param(test_id, block, id=test_id, marks=marks))
    return params


BLOCKS = _collect()


def _public_api():
    names = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for attr in module.__all__:
            obj = getattr(module, attr)
            assert names.setdefault(attr, obj) is obj, f"two public objects named {attr}"
    return names


def _namespace(regression):
    """
    The names a block may use, besides the public API of pyro_vinit:

    - ``x``, ``y``: one batch of 16 rows, 64 features (digits-like), and its
      targets; ``x_train``, ``y_train`` (160 rows, more than the default batch
      of 128) and ``x_test``, ``y_test`` (24 rows). Targets are labels in 0..9,
      or reals for a regression block.
    - ``model``: a ``BayesianClassifier`` (or ``BayesianRegressor``) of a
      bayesianized MLP 64-8-10 (or 64-8-1); ``guide``: an ``AutoNormal`` of it,
      already set up; ``svi``: ``SVI`` with ``Adam`` and ``TraceMeanField_ELBO``.
    - ``logits``: 5 sampled logits ``(5, 24, 10)`` for ``y_test``; ``means``:
      5 sampled means ``(5, 24)``; ``noise_scale``: 0.1.
    - ``loc``, ``scale_u``, ``scale_v``: a 6 x 4 matrix of means and rank-2
      positive factors of a ``KTiedNormal``; ``s0``: a prior standard deviation.
    - ``num_steps``: 2 (a training loop's length).
    - ``plt``: ``matplotlib.pyplot`` with the Agg backend, if installed.
    """
    ns = dict(_public_api())
    ns.update(
        torch=torch, nn=nn, pyro=pyro, dist=dist, SVI=SVI, Predictive=Predictive,
        Trace_ELBO=Trace_ELBO, TraceMeanField_ELBO=TraceMeanField_ELBO, Adam=Adam,
        AutoNormal=AutoNormal, AutoDiagonalNormal=AutoDiagonalNormal,
    )
    try:
        import matplotlib.pyplot as plt
    except ImportError:  # the [examples] extra is not installed
        pass
    else:
        plt.switch_backend("Agg")
        ns["plt"] = plt

    x_all = torch.randn(184, 64)
    if regression:
        y_all = x_all[:, :3].sum(-1) + 0.1 * torch.randn(184)
        model = pyro_vinit.nn.BayesianRegressor(
            pyro_vinit.nn.bayesianize(pyro_vinit.nn.mlp((64, 8, 1))), noise_scale=0.1
        )
    else:
        y_all = torch.randint(0, 10, (184,))
        model = pyro_vinit.nn.BayesianClassifier(
            pyro_vinit.nn.bayesianize(pyro_vinit.nn.mlp((64, 8, 10)))
        )
    guide = AutoNormal(model)
    guide(x_all[:16], y_all[:16])
    ns.update(
        x=x_all[:16], y=y_all[:16], x_train=x_all[:160], y_train=y_all[:160],
        x_test=x_all[160:], y_test=y_all[160:],
        model=model, guide=guide,
        svi=SVI(model, guide, Adam({"lr": 1e-3}), TraceMeanField_ELBO()),
        logits=torch.randn(5, 24, 10), means=torch.randn(5, 24), noise_scale=0.1,
        loc=torch.randn(6, 4), scale_u=torch.rand(6, 2) + 0.1, scale_v=torch.rand(4, 2) + 0.1,
        s0=1.0, num_steps=2,
    )
    return ns


def test_blocks_are_collected():
    # Every "Usage::" in a documented object's docstring yields one block, and the
    # blocks are not empty (a guard on the collector itself).
    for qualname, obj in _documented_objects().items():
        doc = obj.__doc__ or ""
        assert len(_usage_blocks(doc)) == len(re.findall(r"Usage::", doc)), qualname
    assert len(BLOCKS) >= 20
    assert all(param.values[1].strip() for param in BLOCKS)


# pyro_vinit warns (UserWarning) when it changes what was asked for; a block that
# triggers such a warning with these fixtures does not run as printed.
@pytest.mark.filterwarnings("error::UserWarning")
# matplotlib converting torch tensors through numpy 2 (calibration's plt.bar)
@pytest.mark.filterwarnings("ignore:__array_wrap__ must accept:DeprecationWarning")
@pytest.mark.parametrize("test_id, block", BLOCKS)
def test_usage_block_runs(test_id, block):
    ns = _namespace(regression=test_id in REGRESSION)
    if "plt." in block and "plt" not in ns:
        pytest.skip("matplotlib (the [examples] extra) is not installed")
    exec(compile(block, f"<Usage:: of {test_id}>", "exec"), ns)
