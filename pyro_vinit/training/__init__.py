"""
One call that trains a Bayesian neural network: I-BLM, then SVI with the
recipe that keeps I-BLM's head start (see the "Training" method page).
"""

from pyro_vinit.training.averaging import ParamAverage
from pyro_vinit.training.batch_norm import update_batch_norm
from pyro_vinit.training.captured import CapturedSVI
from pyro_vinit.training.config import FitConfig, FitHistory, fit_config, is_initialized
from pyro_vinit.training.loop import fit
from pyro_vinit.training.optim import GroupedAdam

__all__ = ["CapturedSVI", "FitConfig", "FitHistory", "GroupedAdam", "ParamAverage", "fit",
           "fit_config", "is_initialized", "update_batch_norm"]
