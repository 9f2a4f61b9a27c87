"""
An ELBO module evaluated inside effect handlers, for training loops that wrap
the loss as a module (DistributedDataParallel, Lightning).
"""

from contextlib import ExitStack
from typing import Any, Callable, ContextManager, Optional

import torch
from pyro.poutine.messenger import Messenger

from pyro_vinit.poutine.kl_annealing_messenger import KLAnnealingMessenger

__all__ = ["HandledELBO"]


class HandledELBO(torch.nn.Module):
    """
    Pyro's ``ELBOModule`` (``elbo(model, guide)``) evaluated inside a KL
    annealing messenger and a weight-noise handler. The handlers must see the
    guide *and* the model, so they wrap the whole loss; running them in
    :meth:`forward` keeps them inside whatever wraps the module, e.g.
    :class:`~torch.nn.parallel.DistributedDataParallel` or a
    ``lightning.LightningModule``. The parameters are the ELBO module's (the
    model's and the guide's), so the module can be handed to DDP and to a
    ``torch.optim`` optimizer as it is.

    Usage::

        annealing = KLAnnealingMessenger(LinearWarmup(1000))
        loss_fn = HandledELBO(TraceMeanField_ELBO()(model, guide), annealing, local_reparam)
        ddp = loss_fn  # under torchrun: DistributedDataParallel(loss_fn)
        optim = torch.optim.Adam(ddp.parameters(), lr=1e-2)
        for step in range(num_steps):
            optim.zero_grad()
            ddp(x, y).backward()
            optim.step()
            annealing.step()  # on every rank: the KL weight follows the global step

    The annealing messenger is outermost, the weight-noise handler inside it;
    either may be None.

    :param torch.nn.Module elbo_module: ``elbo(model, guide)``, e.g.
        ``TraceMeanField_ELBO()(model, guide)``.
    :param annealing: A :class:`~pyro_vinit.poutine.KLAnnealingMessenger`
        (one instance, entered at every evaluation and stepped by the caller),
        or None.
    :param callable weight_noise: Returns a fresh handler per evaluation, e.g.
        :func:`~pyro_vinit.poutine.local_reparam` or
        :func:`~pyro_vinit.poutine.flipout`; or None.
    """

    def __init__(
        self,
        elbo_module: torch.nn.Module,
        annealing: Optional[KLAnnealingMessenger] = None,
        weight_noise: Optional[Callable[[], ContextManager[object]]] = None,
    ) -> None:
        if not isinstance(elbo_module, torch.nn.Module):
            raise TypeError(
                "HandledELBO: elbo_module must be an ELBO module, elbo(model, guide) (e.g. "
                f"TraceMeanField_ELBO()(model, guide)), got {type(elbo_module).__name__}"
            )
        if annealing is not None and not isinstance(annealing, KLAnnealingMessenger):
            raise TypeError(
                "HandledELBO: annealing must be a KLAnnealingMessenger or None, got "
                f"{type(annealing).__name__}"
            )
        if weight_noise is not None and (isinstance(weight_noise, Messenger)
                                         or not callable(weight_noise)):
            raise TypeError(
                "HandledELBO: weight_noise must be a function returning a handler (e.g. "
                f"local_reparam, not local_reparam()), got {type(weight_noise).__name__}"
            )
        guide = getattr(elbo_module, "guide", None)
        if (getattr(guide, "prototype_trace", True) is None
                and next(iter(elbo_module.parameters()), None) is None):
            raise ValueError(
                "HandledELBO: the guide has not been set up yet, so the ELBO module has no "
                "parameters (DistributedDataParallel and optimizers would get none): run "
                "guide(x, y) once on a batch, or init_guide_iblm(guide, (x, y)), before "
                "building the module"
            )
        super().__init__()
        self.elbo = elbo_module
        self.annealing = annealing
        self.weight_noise = weight_noise

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The ELBO loss of ``model(*args, **kwargs)`` and the guide, under the handlers."""
        with ExitStack() as stack:
            if self.annealing is not None:
                stack.enter_context(self.annealing)
            if self.weight_noise is not None:
                stack.enter_context(self.weight_noise())
            loss: torch.Tensor = self.elbo(*args, **kwargs)
            return loss
