"""
Type annotations shared by the package's modules.

Pyro annotates a trace site (``pyro.poutine.runtime.Message``) with
``fn: Callable``, as a site may be of any type; the sample sites this package
reads (those of a guide's prototype trace, and those its effect handlers
see) hold a distribution and a tensor. :class:`SampleSite` is that view of
the same dict, and :func:`sample_site` / :func:`stochastic_sites` give it to
mypy without copying or checking anything at run time.
"""

from typing import Any, Dict, Iterator, Tuple, TypedDict, Union, cast

import torch
from pyro.distributions.score_parts import ScoreParts
from pyro.distributions.torch_distribution import TorchDistribution
from pyro.poutine.indep_messenger import CondIndepStackFrame
from pyro.poutine.runtime import Message
from pyro.poutine.trace_struct import Trace

__all__ = ["SampleSite", "sample_site", "stochastic_sites"]


class SampleSite(TypedDict, total=False):
    """A sample site of a trace (Pyro's ``Message``), with its distribution and value."""

    type: str
    name: str
    fn: TorchDistribution
    is_observed: bool
    value: torch.Tensor
    scale: Union[torch.Tensor, float]
    mask: Union[bool, torch.Tensor, None]
    cond_indep_stack: Tuple[CondIndepStackFrame, ...]
    infer: Dict[str, Any]  # pyro.sample always sets it
    done: bool
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    unscaled_log_prob: torch.Tensor
    log_prob: torch.Tensor
    log_prob_sum: torch.Tensor
    score_parts: ScoreParts


def sample_site(msg: "Message[..., Any]") -> SampleSite:
    """``msg``, a sample site's message, as a :class:`SampleSite`."""
    return cast(SampleSite, msg)


def stochastic_sites(trace: Trace) -> Iterator[Tuple[str, SampleSite]]:
    """``trace.iter_stochastic_nodes()``, each site as a :class:`SampleSite`."""
    for name, site in trace.iter_stochastic_nodes():
        yield name, sample_site(site)
