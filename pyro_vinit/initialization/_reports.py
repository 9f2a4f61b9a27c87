"""
The warnings of what an initializer leaves to the guide: the latent sites no
layer it fits uses, and those a ``poutine.block`` hides from the guide.
"""

from pyro_vinit._warn import warn_at_caller
from pyro_vinit.initialization._tracing import ModelStructure

__all__ = ["report_held", "report_uncovered"]


def report_uncovered(structure: ModelStructure, strict: bool, who: str) -> None:
    """Names, in one warning (or error if ``strict``), the latent sites that the
    initializer leaves at the guide's own initial values (but the stds it caps)."""
    if not structure.uncovered:
        return
    capped = list(structure.uncovered_priors)
    message = (
        f"{who} initializes the weights and biases of the layers it sees (F.linear, "
        "F.conv1d/2d/3d and matrix products of the data with a latent weight)"
        + (" and the noise site" if structure.likelihood
           and structure.likelihood.noise == "site" else "")
        + f"; these latent sites keep the guide's own initial values: "
        f"{structure.uncovered}. Such sites are used by calls it cannot see (e.g. "
        "nn.MultiheadAttention's internal projections) or are not layer weights (e.g. a "
        "hierarchical prior's scale), and the regressions take them at their medians"
        + (f"; so those with a Normal prior outside the likelihood's plates ({capped}) get "
           "their stds capped at the fitted layers' median fraction of their prior's"
           if capped else ""))
    if strict:
        raise ValueError(message + "; the guide was left unchanged.")
    warn_at_caller(message + ". Pass strict=True to make this an error.", UserWarning)


def report_held(structure: ModelStructure, who: str, noise_written: bool = False) -> None:
    """Names, in one warning, the latent sites hidden from the guide that the
    initializer held fixed, and at what (less a noise site whose estimate the
    guide list writes, with ``noise_written``)."""
    likelihood = structure.likelihood
    skip = (likelihood.noise_name if noise_written and likelihood is not None
            and likelihood.noise == "held" else None)
    items = {name: entry for name, entry in structure.held.items() if name != skip}
    if not items:
        return
    held = ", ".join(
        f"{name!r} at {source} ({value.item():.4g})" if value.numel() == 1
        else f"{name!r} at {source}" for name, (value, source) in items.items()
    )
    listed = all(source == "the guide list's median" for _, source in items.values())
    then = ("which the member of the guide list that owns them keeps" if listed else
            "and leaves them at the values of the guide that owns them (e.g. another member "
            "of an AutoGuideList, one I-BLM does not start, such as AutoDelta; a noise site "
            "gets I-BLM's estimate in a guide that owns it, or through the guide list that "
            "holds both): set them yourself, e.g. that member's params in "
            "pyro.get_param_store()")
    warn_at_caller(
        f"{who}: the guide does not own the latent sites {list(items)} (a poutine.block "
        f"around its model hides them), so it held them fixed for the whole call: {held}, "
        f"{then}", UserWarning)
