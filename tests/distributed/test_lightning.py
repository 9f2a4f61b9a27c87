"""
The guide and ELBO module inside a ``lightning.LightningModule`` (the
optional ``[lightning]`` extra): Lightning's training loop gives exactly the
parameters of the plain torch loop.
"""

import pyro
import pytest
import torch

from tests.common import assert_close
from tests.distributed import _harness
from tests.distributed._harness import CASES

pl = pytest.importorskip("lightning.pytorch", reason="the [lightning] extra is not installed")


class SVIModule(pl.LightningModule):
    """Pyro's examples/svi_lightning.py pattern: the loss module is the model
    Lightning trains, with a torch optimizer over its parameters."""

    def __init__(self, loss_fn, lr, noise_seed):
        super().__init__()
        self.loss_fn = loss_fn
        self.lr = lr
        self.noise_seed = noise_seed

    def on_train_start(self):
        pyro.set_rng_seed(self.noise_seed)

    def training_step(self, batch, batch_idx):
        return self.loss_fn(*batch)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.loss_fn.annealing is not None:
            self.loss_fn.annealing.step()  # λ follows Lightning's global step

    def configure_optimizers(self):
        return torch.optim.Adam(self.loss_fn.parameters(), lr=self.lr)


def _loader(x, y, batches):
    # batches given as index lists; a seeded generator keeps the loader off the global RNG
    return torch.utils.data.DataLoader(
        [(x[idx], y[idx]) for idx in batches], batch_size=None,
        generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", ["ktied_lrt_kl_annealing", "radial_flipout"])
def test_lightning_matches_torch_loop(name):
    case = CASES[name]
    with pyro.settings.context(module_local_params=True):
        _, guide, loss_fn = _harness.build(case)
        x, y, batches = _harness.make_data()
        start = _harness.snapshot(guide)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.fit(SVIModule(loss_fn, _harness.LR, _harness.SEED), _loader(x, y, batches))
        assert trainer.global_step == len(batches)
        actual = _harness.snapshot(guide)

        _, guide, loss_fn = _harness.build(case)
        optim = torch.optim.Adam(loss_fn.parameters(), lr=_harness.LR)
        pyro.set_rng_seed(_harness.SEED)
        for idx in batches:
            optim.zero_grad()
            loss_fn(x[idx], y[idx]).backward()
            optim.step()
            if loss_fn.annealing is not None:
                loss_fn.annealing.step()
        expected = _harness.snapshot(guide)
    for key, value in expected.items():
        assert not torch.allclose(value, start[key]), key
        assert_close(actual[key], value, atol=1e-12, rtol=1e-12, msg=key)
