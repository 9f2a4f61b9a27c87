"""
NumPyro's entry in the time-to-quality race (``bench_time_to_quality.py``),
run in its own process and Python environment (jax and NumPyro, no torch):
the same network and N(0, 1/D_in) priors as the Pyro models, NumPyro's
``AutoNormal`` with its default init, ``Trace_ELBO``, Adam 1e-3 and a
``jax.jit``-compiled SVI update on random minibatches. The training clock
counts ``svi.init`` and every step (the first step's ``jit`` compilation
included, and reported apart); evaluation at the checkpoints is off the
clock. Writes ``{"curve": [...], ...}`` to ``--out``.

Usage (what ``_peers.run_numpyro`` runs)::

    .venv-numpyro/bin/python benchmarks/_race_numpyro.py --data data.npz --out out.json \\
        --arch '{"kind": "mlp", "sizes": [64, 100, 10]}' --seed 0 --budget 5 \\
        --checkpoints '[0.5, 1, 2, 5]' --num-samples 32 --batch-size 128
"""

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax.scipy.special import logsumexp
from numpyro.infer import SVI, Predictive, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal


def _layer(name, shape, fan_in):
    scale = 1.0 / math.sqrt(fan_in)
    w = numpyro.sample(f"{name}.weight", dist.Normal(0.0, scale).expand(shape).to_event(len(shape)))
    b = numpyro.sample(f"{name}.bias", dist.Normal(0.0, scale).expand(shape[:1]).to_event(1))
    return w, b


def _conv(x, w, b, stride):
    out = jax.lax.conv_general_dilated(x, w, (stride, stride), ((1, 1), (1, 1)),
                                       dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return out + b[:, None, None]


def make_model(arch, num_data):
    def model(x, y=None):
        if arch["kind"] == "mlp":
            sizes = arch["sizes"]
            h = x
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
                w, bias = _layer(f"net.{2 * i}", (b, a), a)
                h = h @ w.T + bias
                if i < len(sizes) - 2:
                    h = jax.nn.relu(h)
        else:  # the digits CNN of bench_time_to_quality.cnn()
            w, b = _layer("net.0", (8, 1, 3, 3), 9)
            h = jax.nn.relu(_conv(x, w, b, 1))
            w, b = _layer("net.2", (16, 8, 3, 3), 72)
            h = jax.nn.relu(_conv(h, w, b, 2))
            w, b = _layer("net.5", (10, 256), 256)
            h = h.reshape(h.shape[0], -1) @ w.T + b
        numpyro.deterministic("logits", h)
        with numpyro.plate("data", num_data, subsample_size=x.shape[0]):
            numpyro.sample("obs", dist.Categorical(logits=h), obs=y)

    return model


def main(args):
    data = np.load(args.data)
    x, y = jnp.asarray(data["x"]), jnp.asarray(data["y"])
    x_test, y_test = jnp.asarray(data["x_test"]), np.asarray(data["y_test"])
    n, batch_size = x.shape[0], args.batch_size
    model = make_model(json.loads(args.arch), n)
    guide = AutoNormal(model)
    svi = SVI(model, guide, numpyro.optim.Adam(1e-3), Trace_ELBO())

    @jax.jit
    def update(state, key):
        idx = jax.random.randint(key, (batch_size,), 0, n)
        return svi.update(state, x[idx], y[idx])

    @jax.jit
    def predict(params, key):
        predictive = Predictive(model, guide=guide, params=params, num_samples=args.num_samples,
                                return_sites=["logits"])
        return predictive(key, x_test)["logits"]

    def evaluate(state, seconds):
        key = jax.random.PRNGKey(args.seed + 1_000_003 * len(curve))
        logits = np.asarray(predict(svi.get_params(state), key), dtype=np.float64)
        log_p = logits - logsumexp(logits, axis=-1, keepdims=True)
        log_pred = logsumexp(log_p, axis=0) - math.log(logits.shape[0])
        curve.append({"seconds": seconds,
                      "mnll": float(-log_pred[np.arange(len(y_test)), y_test].mean()),
                      "error": float((log_pred.argmax(-1) != y_test).mean())})

    key = jax.random.PRNGKey(args.seed)
    curve = []
    start = time.perf_counter()
    key, init_key = jax.random.split(key)
    state = svi.init(init_key, x[:batch_size], y[:batch_size])
    jax.block_until_ready(state)
    clock = time.perf_counter() - start
    setup = clock
    evaluate(state, clock)
    compile_seconds = None
    for checkpoint in args.checkpoints:
        if checkpoint <= clock:
            continue
        while clock < checkpoint:
            key, step_key = jax.random.split(key)
            start = time.perf_counter()
            state, loss = update(state, step_key)
            jax.block_until_ready(loss)
            seconds = time.perf_counter() - start
            if compile_seconds is None:
                compile_seconds = seconds
            clock += seconds
        evaluate(state, clock)
    with open(args.out, "w") as f:
        json.dump({"curve": curve, "setup_seconds": setup, "first_step_seconds": compile_seconds,
                   "versions": {"numpyro": numpyro.__version__, "jax": jax.__version__}}, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--arch", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=float, required=True)
    parser.add_argument("--checkpoints", type=json.loads, required=True)
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=128)
    main(parser.parse_args())
