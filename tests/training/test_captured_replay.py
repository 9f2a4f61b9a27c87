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
