"""
Initialization of autoguides: I-BLM, the layer-by-layer Bayesian-linear-model
initialization of [1], and the baselines it is compared with.

[1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
Bayes for Deep Models"
"""

from pyro_vinit.initialization.baselines import init_guide
from pyro_vinit.initialization.iblm import IBLMGuideInitializer, init_guide_iblm
from pyro_vinit.initialization.pretrained import init_guide_pretrained

__all__ = ["IBLMGuideInitializer", "init_guide", "init_guide_iblm", "init_guide_pretrained"]
