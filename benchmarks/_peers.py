"""
The peers of the time-to-quality race (``bench_time_to_quality.py``), each
with the settings its own documentation recommends, as runners with a
``setup()`` and a ``step()`` (both on the training clock) and a
``logits(x, num_samples)`` (off it):

* bayesian-torch 0.5.0: ``dnn_to_bnn`` with the README's
  ``const_bnn_prior_parameters`` (N(0, 1) priors, ``posterior_rho_init``
  -3, ``Reparameterization`` layers: ``LinearReparameterization`` /
  ``Conv2dReparameterization``), Adam 1e-3, from random init and from the
  MOPED start (``moped_enable``, ``moped_delta`` 0.5) of a deterministically
  pre-trained network, whose training time is counted;
* IVON (``ivon-opt``): ``ivon.IVON(lr=0.1, ess=N, hess_init=0.1)``, one
  sample per step (``sampled_params(train=True)``), the mean cross-entropy;
* NumPyro's ``AutoNormal`` (default init) with a ``jit``-compiled SVI
  update, run by ``_race_numpyro.py`` in its own process and Python
  environment (jax and torch are not installed side by side).

bayesian-torch and IVON are benchmark-only dependencies (``make bench``
installs them with ``--no-deps``); a missing one is skipped with a note, as
is NumPyro without its environment.
"""

import json
import os
import subprocess
import tempfile
from importlib import metadata

import numpy as np
import torch
import torch.nn.functional as F

try:
    from bayesian_torch.models.dnn_to_bnn import dnn_to_bnn, get_kl_loss

    BAYESIAN_TORCH = metadata.version("bayesian-torch")
except ImportError:  # benchmark-only dependency
    dnn_to_bnn = get_kl_loss = None
    BAYESIAN_TORCH = None

try:
    import ivon

    IVON = metadata.version("ivon-opt")
except ImportError:  # benchmark-only dependency
    ivon = None
    IVON = None

HERE = os.path.dirname(os.path.abspath(__file__))
NUMPYRO_SCRIPT = os.path.join(HERE, "_race_numpyro.py")

MISSING = {
    "bayesian-torch": "bayesian-torch is not installed: its rows are skipped "
                      "(benchmark-only: pip install --no-deps bayesian-torch==0.5.0, as "
                      "`make bench` does).",
    "ivon": "ivon-opt is not installed: its rows are skipped (benchmark-only: pip install "
            "--no-deps ivon-opt==0.1.3, as `make bench` does).",
}


def numpyro_missing(python):
    """Why NumPyro cannot run with the interpreter ``python`` (None if it can)."""
    if not python or not os.path.isfile(python):
        return (f"NumPyro's environment {python!r} does not exist: its rows are skipped "
                "(`make .venv-numpyro/.installed` builds it; or pass --numpyro-python).")
    probe = subprocess.run([python, "-c", "import jax, numpyro; print(numpyro.__version__)"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        return (f"NumPyro or jax does not import in {python}: its rows are skipped "
                f"({probe.stderr.strip().splitlines()[-1:] or 'no message'}).")
    return None


def pretrain(net, x, y, epochs, batch_size, lr=1e-3):
    """Trains the deterministic ``net`` in place with Adam on the mean
    cross-entropy, ``epochs`` passes' worth of random minibatches (the MOPED
    start's, and our trained start's, pre-training)."""
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    steps = epochs * -(-len(x) // batch_size)
    for _ in range(steps):
        batch = torch.randint(len(x), (batch_size,))
        opt.zero_grad()
        F.cross_entropy(net(x[batch]), y[batch]).backward()
        opt.step()
    return net


# bayesian-torch's README (``const_bnn_prior_parameters``); moped_enable per start
BT_PRIOR_PARAMETERS = {
    "prior_mu": 0.0,
    "prior_sigma": 1.0,
    "posterior_mu_init": 0.0,
    "posterior_rho_init": -3.0,
    "type": "Reparameterization",
    "moped_enable": False,
    "moped_delta": 0.5,
}


class BayesianTorch:
    """bayesian-torch's ``dnn_to_bnn`` of ``make_net()``, Adam 1e-3 on the
    negative ELBO per example (mean cross-entropy + KL / N: the README divides
    the KL by the batch size instead, which weights it N / batch times more);
    with ``moped=True`` the network is first pre-trained deterministically for
    ``pretrain_epochs`` and the Bayesian layers start from it (MOPED)."""

    def __init__(self, make_net, x, y, batch_size, moped=False, pretrain_epochs=0, lr=1e-3):
        self.make_net, self.x, self.y = make_net, x, y
        self.batch_size, self.moped, self.pretrain_epochs, self.lr = (
            batch_size, moped, pretrain_epochs, lr)

    def setup(self):
        net = self.make_net()
        if self.moped:
            pretrain(net, self.x, self.y, self.pretrain_epochs, self.batch_size)
        # in place: Linear / Conv2d become Linear- / Conv2dReparameterization
        dnn_to_bnn(net, dict(BT_PRIOR_PARAMETERS, moped_enable=self.moped))
        self.net = net
        self.opt = torch.optim.Adam(self.net.parameters(), lr=self.lr)

    def step(self):
        batch = torch.randint(len(self.x), (self.batch_size,))
        self.opt.zero_grad()
        loss = (F.cross_entropy(self.net(self.x[batch]), self.y[batch])
                + get_kl_loss(self.net) / len(self.x))
        loss.backward()
        self.opt.step()

    @torch.no_grad()
    def logits(self, x, num_samples):
        return torch.stack([self.net(x) for _ in range(num_samples)])


class IVONRunner:
    """``make_net()`` trained by IVON with the settings of its README and
    paper's guidelines (lr 0.1, ess = N, hess_init 0.1, one sample per step);
    the predictive averages ``sampled_params()`` draws."""

    def __init__(self, make_net, x, y, batch_size, lr=0.1, hess_init=0.1):
        self.make_net, self.x, self.y, self.batch_size = make_net, x, y, batch_size
        self.lr, self.hess_init = lr, hess_init

    def setup(self):
        self.net = self.make_net()
        self.opt = ivon.IVON(self.net.parameters(), lr=self.lr, ess=len(self.x),
                             hess_init=self.hess_init)

    def step(self):
        batch = torch.randint(len(self.x), (self.batch_size,))
        with self.opt.sampled_params(train=True):
            self.opt.zero_grad()
            F.cross_entropy(self.net(self.x[batch]), self.y[batch]).backward()
        self.opt.step()

    @torch.no_grad()
    def logits(self, x, num_samples):
        out = []
        for _ in range(num_samples):
            with self.opt.sampled_params():
                out.append(self.net(x))
        return torch.stack(out)


def run_numpyro(python, arch, data, seed, budget, checkpoints, num_samples, batch_size,
                threads=1, init="uniform", warm=True, timeout=None):
    """Runs NumPyro's AutoNormal race on ``data`` in ``python``'s process and
    returns its output: the curve (a list of ``{"seconds", "mnll", "error"}``)
    and the set-up, first-step and (``warm``: off the clock) compilation
    seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "data.npz")
        np.savez(path, **{k: v.numpy() for k, v in zip(("x", "y", "x_test", "y_test"), data)})
        out = os.path.join(tmp, "out.json")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false "
                            f"intra_op_parallelism_threads={threads}"}
        cmd = [python, NUMPYRO_SCRIPT, "--data", path, "--out", out, "--arch", json.dumps(arch),
               "--seed", str(seed), "--budget", str(budget),
               "--checkpoints", json.dumps(checkpoints), "--num-samples", str(num_samples),
               "--batch-size", str(batch_size), "--init", init] + (["--warm"] if warm else [])
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"NumPyro's race failed:\n{result.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)
