"""CapturedSVI's replay records nothing for autograd: the gradients it hands the
optimizer are plain tensors (a recorded replay kept every step's graph alive
through them: about 35 MB a step on a 64-400-400-10 MLP at batch 1000)."""

import pyro
import torch
from pyro.infer import TraceMeanField_ELBO
from pyro.optim import PyroOptim

from pyro_vinit import AutoKTiedNormal, CapturedSVI, local_reparam
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp


class GradProbe(PyroOptim):
    """SGD at learning rate 0 that notes, per call, whether any gradient it was
    handed requires grad or has a grad_fn."""

    def __init__(self):
        super().__init__(torch.optim.SGD, {"lr": 0.0})
        self.recorded = []

    def __call__(self, params, *args, **kwargs):
        params = list(params)
        self.recorded.append(any(p.grad is not None and (p.grad.requires_grad
                                                          or p.grad.grad_fn is not None)
                                 for p in params))
        super().__call__(params, *args, **kwargs)


def test_replayed_gradients_record_no_graph():
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    model = BayesianClassifier(bayesianize(mlp((5, 8, 3))), num_data=160)
    optim = GradProbe()
    svi = CapturedSVI(model, AutoKTiedNormal(model, rank=2), optim, TraceMeanField_ELBO())
    for _ in range(4):  # eager, traced, replayed, replayed
        with local_reparam():
            svi.step(x, y)
    assert svi.num_traces == 1 and svi.fallback_reason is None
    assert optim.recorded == [False] * 4
    # the parameters still take part in autograd outside the step
    param = next(iter(pyro.get_param_store().values()))
    assert param.requires_grad


def _steps_around_a_reload(svi_class, path):
    # SVI steps, the param store saved, more steps, the store loaded (new tensors under
    # the same names), more steps: the losses, and the parameters after them
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    model = BayesianClassifier(bayesianize(mlp((5, 8, 3))), num_data=160)
    svi = svi_class(model, AutoKTiedNormal(model, rank=2), pyro.optim.Adam({"lr": 0.05}),
                    TraceMeanField_ELBO())
    losses = [svi.step(x, y) for _ in range(4)]
    pyro.get_param_store().save(path)
    losses += [svi.step(x, y) for _ in range(3)]
    pyro.get_param_store().load(path)
    loaded = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    losses += [svi.step(x, y) for _ in range(4)]
    after = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    return svi, losses, loaded, after


def test_a_loaded_param_store_is_stepped_as_svi_steps_it(tmp_path):
    # the graph read the tensors its first step found; after a load the store holds
    # others: recorded and traced afresh, it trains those, as SVI does (it trained the
    # old ones, the store's never moving, its loss still falling)
    svi, captured, loaded, after = _steps_around_a_reload(CapturedSVI, tmp_path / "a.pt")
    _, eager, _, eager_after = _steps_around_a_reload(pyro.infer.SVI, tmp_path / "b.pt")
    assert captured == eager
    assert any(not torch.equal(loaded[k], after[k]) for k in loaded)
    assert all(torch.equal(after[k], eager_after[k]) for k in after)
    assert svi.num_traces == 1 and svi.fallback_reason is None


def test_a_fallback_reason_says_a_repeated_error_once():
    from pyro_vinit.training.captured import _describe

    def raised(inner, outer):
        try:
            try:
                raise inner
            except RuntimeError:
                raise outer  # noqa: B904 (its context: the inner error, as torch raises)
        except RuntimeError as error:
            return error

    same = RuntimeError("It appears that you're trying to get value out of a tracing tensor")
    assert _describe(raised(same, RuntimeError(str(same)))) == f"RuntimeError: {same}"
    other = raised(RuntimeError("inner"), RuntimeError("outer\nmore lines"))
    assert _describe(other) == "RuntimeError: outer, after RuntimeError: inner"
