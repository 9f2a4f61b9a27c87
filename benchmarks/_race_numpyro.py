"""
NumPyro's entry in the time-to-quality race (``bench_time_to_quality.py``),
run in its own process and Python environment (jax and NumPyro, no torch):
the same network and N(0, 1/D_in) priors as the Pyro models, NumPyro's
``AutoNormal`` with its default init (or ``init_to_median``: ``--init
median``), ``Trace_ELBO``, Adam 1e-3 and a ``jax.jit``-compiled SVI update on
random minibatches. The training clock
counts ``svi.init`` and every step; with ``--warm`` jax's compilation of
both (and of the predictive) is done first on a throwaway state, off the
clock, and reported apart, otherwise it is on the clock. Evaluation at the
checkpoints is off the clock. Writes ``{"curve": [...], ...}`` to ``--out``.

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
from numpyro.infer.initialization import init_to_median


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
    # NumPyro's default init_to_uniform puts every weight in (-2, 2), far out in the tails
    # of N(0, 1/D_in); --init median starts near the prior's median instead
    guide = AutoNormal(model) if args.init == "uniform" else AutoNormal(
        model, init_loc_fn=init_to_median(num_samples=15))
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
    compile_seconds = None
    if args.warm:
        # jax compiles each shape once per process: pay that on a throwaway state, off the clock
        start = time.perf_counter()
        state = svi.init(jax.random.PRNGKey(args.seed + 1), x[:batch_size], y[:batch_size])
        jax.block_until_ready(update(state, key))
        jax.block_until_ready(predict(svi.get_params(state), key))
        compile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    key, init_key = jax.random.split(key)
    state = svi.init(init_key, x[:batch_size], y[:batch_size])
    jax.block_until_ready(state)
    clock = time.perf_counter() - start
    setup = clock
    evaluate(state, clock)
    first_step = None
    for checkpoint in args.checkpoints:
        if checkpoint <= clock:
            continue
        while clock < checkpoint:
            key, step_key = jax.random.split(key)
            start = time.perf_counter()
            state, loss = update(state, step_key)
            jax.block_until_ready(loss)
            seconds = time.perf_counter() - start
            if first_step is None:
                first_step = seconds
            clock += seconds
        evaluate(state, clock)
    with open(args.out, "w") as f:
        json.dump({"curve": curve, "setup_seconds": setup, "first_step_seconds": first_step,
                   "warm": args.warm, "warm_up_seconds": compile_seconds,
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
    parser.add_argument("--warm", action="store_true",
                        help="compile (init, update, predict) off the clock first")
    parser.add_argument("--init", choices=["uniform", "median"], default="uniform",
                        help="AutoNormal's init_loc_fn: NumPyro's default or init_to_median")
    main(parser.parse_args())
