"""
Saving a trained guide and loading it in a fresh Python process (as
``docs/saving.rst`` describes): the reloaded guide's predictions are bit for
bit those of the trained one, for every guide class (Pyro's ``AutoNormal`` as
the control), a PyroModule model from :func:`~pyro_vinit.nn.bayesianize` and
a functional model, and each way of saving:

- ``state_dict``: ``torch.save(guide.state_dict())``, and in the new process
  a guide called once, then ``load_state_dict(torch.load(..., weights_only=True))``;
- ``param_store``: ``pyro.get_param_store().save``/``load``, then a guide
  called once (it takes its parameters from the store);
- ``local_params``: the ``state_dict`` route with
  ``pyro.settings.set(module_local_params=True)``, where the param store stays empty.

Run as ``python -m tests.test_serialization DIR`` this module is the new
process: it reloads every case saved in ``DIR`` and saves its predictions.
"""

import io
import os
import subprocess
import sys
from typing import Callable, Dict, Tuple

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal, init_to_sample

from pyro_vinit import AutoKTiedNormal, AutoMeanFieldNormal, AutoRadialNormal
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GUIDES: Dict[str, Tuple[Callable, type]] = {
    "AutoKTiedNormal": (lambda m: AutoKTiedNormal(m, rank=2, init_loc_fn=init_to_sample),
                        TraceMeanField_ELBO),
    "AutoRadialNormal": (lambda m: AutoRadialNormal(m, init_loc_fn=init_to_sample),
                         TraceMeanField_ELBO),
    "AutoMeanFieldNormal": (lambda m: AutoMeanFieldNormal(m, init_loc_fn=init_to_sample),
                            TraceMeanField_ELBO),
    "AutoNormal": (lambda m: AutoNormal(m, init_loc_fn=init_to_sample), Trace_ELBO),
}
MODELS = ["bayesianize", "functional"]
ROUTES = ["state_dict", "param_store", "local_params"]
CASES = [f"{g}-{m}-{r}" for g in GUIDES for m in MODELS for r in ROUTES]
NUM_SAMPLES = 5


def functional_model(x: torch.Tensor, y: torch.Tensor = None) -> torch.Tensor:
    """A linear softmax classifier written with ``pyro.sample`` statements."""
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1], 3]).to_event(2))
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    logits = x @ w + b
    with pyro.plate("data", x.shape[0]):
        pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
    return logits


def _data() -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return x, (x[:, :3] + 0.3 * torch.randn(32, 3, generator=g)).argmax(-1)


def _build(case: str):
    """The model and an un-set-up guide of ``case``, from a fixed seed."""
    guide_name, model_kind, _ = case.split("-")
    pyro.set_rng_seed(0)
    if model_kind == "bayesianize":
        model = BayesianClassifier(bayesianize(mlp((4, 6, 3))), num_data=32)
    else:
        model = functional_model
    return model, GUIDES[guide_name][0](model)


def _predict(model, guide, x: torch.Tensor) -> Dict[str, torch.Tensor]:
    pyro.set_rng_seed(1)
    logits = Predictive(model, guide=guide, num_samples=NUM_SAMPLES,
                        return_sites=["_RETURN"])(x)["_RETURN"]
    return {"logits": logits, **{f"median.{k}": v for k, v in guide.median(x).items()}}


def _save(case: str, directory: str) -> Dict[str, torch.Tensor]:
    """Trains ``case``, saves it the case's way to ``directory``; its predictions."""
    route = case.split("-")[-1]
    with pyro.settings.context(module_local_params=route == "local_params"):
        pyro.clear_param_store()
        model, guide = _build(case)
        x, y = _data()
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), GUIDES[case.split("-")[0]][1]())
        for _ in range(20):
            svi.step(x, y)
        path = os.path.join(directory, case + ".pt")
        if route == "param_store":
            pyro.get_param_store().save(path)
        else:
            torch.save(guide.state_dict(), path)
        return _predict(model, guide, x)


def _load(case: str, directory: str):
    """The model and the guide of ``case`` as a new process loads them, and the
    predictions of the guide before loading (set up, but not trained)."""
    route = case.split("-")[-1]
    path = os.path.join(directory, case + ".pt")
    x, y = _data()
    with pyro.settings.context(module_local_params=route == "local_params"):
        pyro.clear_param_store()
        if route == "param_store":
            pyro.get_param_store().load(path)
        model, guide = _build(case)
        guide(x[:1], y[:1])  # sets up the guide: its parameters exist from here on
        before = None
        if route != "param_store":
            before = _predict(model, guide, x)
            guide.load_state_dict(torch.load(path, weights_only=True))
        return model, guide, before


def reload_all(directory: str) -> None:
    """The new process: reloads every case and saves the predictions."""
    results = {}
    x, _ = _data()
    for case in CASES:
        route = case.split("-")[-1]
        model, guide, before = _load(case, directory)
        with pyro.settings.context(module_local_params=route == "local_params"):
            results[case] = {"after": _predict(model, guide, x), "before": before}
    torch.save(results, os.path.join(directory, "reloaded.pt"))


@pytest.fixture(scope="module")
def reloaded(tmp_path_factory):
    """Every case trained and saved here, and reloaded by one new process."""
    directory = str(tmp_path_factory.mktemp("saved"))
    trained = {case: _save(case, directory) for case in CASES}
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-m", "tests.test_serialization", directory],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return trained, torch.load(os.path.join(directory, "reloaded.pt"), weights_only=True)


@pytest.mark.parametrize("case", CASES)
def test_reload_in_new_process_is_bit_identical(reloaded, case):
    trained, loaded = reloaded
    expected, actual = trained[case], loaded[case]["after"]
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), key
    # and the loading is what made them so: the set-up guide predicted otherwise
    before = loaded[case]["before"]
    if before is not None:
        assert not torch.equal(before["logits"], expected["logits"])


@pytest.mark.parametrize("guide_name", list(GUIDES))
def test_load_state_dict_needs_a_set_up_guide(guide_name):
    # Pyro's autoguides create their parameters at the first call: a new guide
    # refuses a state_dict with "Unexpected key(s)", as docs/saving.rst says
    case = f"{guide_name}-bayesianize-local_params"
    x, y = _data()
    with pyro.settings.context(module_local_params=True):
        model, guide = _build(case)
        guide(x[:1], y[:1])
        state = guide.state_dict()
        _, fresh = _build(case)
        with pytest.raises(RuntimeError, match="Unexpected key"):
            fresh.load_state_dict(state)
        fresh(x[:1], y[:1])
        fresh.load_state_dict(state)
        for key, value in state.items():
            assert torch.equal(fresh.state_dict()[key], value), key


def test_weights_only_loading():
    # a guide's state_dict is plain tensors: torch.load(weights_only=True) takes it;
    # the param store's file pickles constraint objects, and the whole guide its
    # classes: both need weights_only=False (Pyro's ParamStoreDict.load passes it)
    x, y = _data()
    pyro.clear_param_store()
    model, guide = _build("AutoKTiedNormal-bayesianize-param_store")
    guide(x[:1], y[:1])
    for obj, ok in [(guide.state_dict(), True), (pyro.get_param_store().get_state(), False),
                    (guide, False)]:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        if ok:
            torch.load(buffer, weights_only=True)
        else:
            with pytest.raises(Exception, match="weights_only"):
                torch.load(buffer, weights_only=True)
    pyro.clear_param_store()


def _train_with_checkpoint(route: str, path: str, num_steps: int, resume: bool = False,
                           setup_first: bool = True) -> Dict[str, torch.Tensor]:
    """SVI from a fresh guide and optimizer for ``num_steps`` steps, saving a
    checkpoint (parameters, optimizer state, RNG state, step) before step 5,
    or starting from that checkpoint; the final parameters. ``setup_first=False``
    sets the resumed guide up after restoring the RNG state (the wrong order)."""
    case = f"AutoKTiedNormal-bayesianize-{route}"
    x, y = _data()
    local = route == "local_params"
    with pyro.settings.context(module_local_params=local):
        pyro.clear_param_store()
        model, guide = _build(case)
        if local:  # torch's optimizer over the parameters of the set-up guide
            loss_fn = TraceMeanField_ELBO()(model, guide)
            guide(x[:1], y[:1])
            optim = torch.optim.Adam(loss_fn.parameters(), lr=0.05)

            def step() -> None:
                optim.zero_grad()
                loss_fn(x, y).backward()
                optim.step()
        else:  # Pyro's optimizer wrapper and the global param store
            pyro_optim = pyro.optim.Adam({"lr": 0.05})
            svi = SVI(model, guide, pyro_optim, TraceMeanField_ELBO())

            def step() -> None:
                svi.step(x, y)
        start = 0
        if resume:
            # Pyro's param store state holds constraint objects: weights_only=False
            checkpoint = torch.load(path, weights_only=local)
            if local:
                guide.load_state_dict(checkpoint["guide"])
                optim.load_state_dict(checkpoint["optim"])
            else:
                pyro.get_param_store().set_state(checkpoint["params"])
                pyro_optim.set_state(checkpoint["optim"])
                if setup_first:
                    guide(x[:1], y[:1])
            torch.set_rng_state(checkpoint["rng"])
            if not setup_first:
                guide(x[:1], y[:1])
            start = checkpoint["step"]
        for i in range(start, num_steps):
            if i == 5 and not resume:
                if local:
                    state = {"guide": guide.state_dict(), "optim": optim.state_dict()}
                else:
                    state = {"params": pyro.get_param_store().get_state(),
                             "optim": pyro_optim.get_state()}
                torch.save({**state, "rng": torch.get_rng_state(), "step": i}, path)
            step()
        return {k: v.detach().clone() for k, v in guide.state_dict().items()}


@pytest.mark.parametrize("route", ["param_store", "local_params"])
def test_resume_training_is_bit_identical(route, tmp_path):
    path = str(tmp_path / "checkpoint.pt")
    straight = _train_with_checkpoint(route, path, 12)
    resumed = _train_with_checkpoint(route, path, 12, resume=True)
    assert resumed.keys() == straight.keys()
    for key, value in straight.items():
        assert torch.equal(resumed[key], value), key
    if route == "param_store":
        # the pitfall docs/saving.rst names: a guide set up after the RNG state is
        # restored spends random numbers (init_to_sample) the straight run did not
        late = _train_with_checkpoint(route, path, 12, resume=True, setup_first=False)
        assert not all(torch.equal(late[k], v) for k, v in straight.items())


if __name__ == "__main__":
    reload_all(sys.argv[1])
