"""
pyro-vinit: variational inference for Bayesian neural networks in Pyro that
starts well and trains fast.
"""

from pyro_vinit import (
    data,
    distributions,
    guides,
    initialization,
    metrics,
    nn,
    poutine,
    schedules,
    training,
)
from pyro_vinit.guides import (
    AutoKTiedNormal,
    AutoMeanFieldNormal,
    AutoRadialNormal,
    posterior_as_prior,
    set_priors,
)
from pyro_vinit.initialization import (
    IBLMGuideInitializer,
    init_guide,
    init_guide_iblm,
    init_guide_pretrained,
)
from pyro_vinit.poutine import (
    FlipoutMessenger,
    LocalReparamMessenger,
    VectorizedLayersMessenger,
    WeightNoiseMessenger,
    flipout,
    local_reparam,
    vectorized_layers,
    weight_noise,
)
from pyro_vinit.training import (
    CapturedSVI,
    FitConfig,
    FitHistory,
    GroupedAdam,
    ParamAverage,
    fit,
    fit_config,
    update_batch_norm,
)

__version__ = "0.1.0"

__all__ = [
    "AutoKTiedNormal",
    "AutoMeanFieldNormal",
    "AutoRadialNormal",
    "CapturedSVI",
    "FitConfig",
    "FitHistory",
    "FlipoutMessenger",
    "GroupedAdam",
    "IBLMGuideInitializer",
    "LocalReparamMessenger",
    "ParamAverage",
    "VectorizedLayersMessenger",
    "WeightNoiseMessenger",
    "data",
    "distributions",
    "fit",
    "fit_config",
    "flipout",
    "guides",
    "init_guide",
    "init_guide_iblm",
    "init_guide_pretrained",
    "initialization",
    "local_reparam",
    "metrics",
    "nn",
    "posterior_as_prior",
    "poutine",
    "schedules",
    "set_priors",
    "training",
    "update_batch_norm",
    "vectorized_layers",
    "weight_noise",
]
