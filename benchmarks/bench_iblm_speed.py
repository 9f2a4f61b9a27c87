"""
I-BLM's time, before and after a change, side by side, with its quality
right after initialization (issue 22: "I-BLM fast enough to be worth it").

Problems (``--problems``), each a BayesianClassifier of a bayesianized ReLU
MLP with N(0, 1/D_in) priors:

* ``mnist``: MNIST-5k (:func:`pyro_vinit.data.load_mnist`, 4,000 training
  rows), 784-200-200-10, AutoKTiedNormal(rank=2),
  ``init_guide_iblm(guide, (x, y), batch_size=512, max_scale_ratio=0.1)``
  (the README's call; target ≤ 0.3 s);
* ``digits``: scikit-learn digits (1,257 rows), 64-100×5-10, AutoNormal, the
  same call with I-BLM's default ``batch_size=128`` (as
  :mod:`pyro_vinit.testing.paper_problems`; target ≤ 0.1 s);
* ``digits512``: the same with ``batch_size=512``;
* ``diabetes``: scikit-learn diabetes (standardized, 309 rows), 10-100×5-1
  with a latent noise std ``sigma ~ HalfNormal(1)``, AutoNormal, the same call
  with ``batch_size=128``: the noise estimate's search for the value of
  ``sigma`` runs the model once per step (metrics: test RMSE and MNLL);
* ``digits_cnn``: the race's digits CNN (:mod:`pyro_vinit.testing.paper_problems`,
  two convolutions and a linear layer), AutoKTiedNormal(rank=2), ``batch_size=512``.

The *baseline* is the ``pyro_vinit`` package of the git revision
``--baseline`` (default ``main``), extracted with ``git archive`` into a
temporary folder; the *current* one is this checkout's. Each runs in its own
worker process (one thread), and the rounds are interleaved (the two workers
take turns, the order alternating between rounds), so that the load of a
shared machine hits both alike; each round seeds the RNG with its number, in
both. The time of a call is its process (CPU) time, which other jobs on the
machine inflate much less than wall time (both are reported); the table shows
medians over rounds and the median of the per-round ratios. Quality is the
test error and MNLL of the Monte Carlo predictive of 32 guide draws right
after initialization (for ``diabetes`` the RMSE and the MNLL with the drawn
``sigma``), mean over rounds.

Usage::

    python -m benchmarks.bench_iblm_speed                      # 7 rounds, main vs here
    python -m benchmarks.bench_iblm_speed --baseline 5cae3f8 --rounds 3
    python -m benchmarks.bench_iblm_speed --quick               # smoke run, no files
    python -m benchmarks.bench_iblm_speed --baseline c21bfb4 --tag convolutions
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

PROBLEMS = {
    "mnist": dict(sizes=(784, 200, 200, 10), guide="ktied", batch_size=512),
    "digits": dict(sizes=(64,) + (100,) * 5 + (10,), guide="normal", batch_size=128),
    "digits512": dict(sizes=(64,) + (100,) * 5 + (10,), guide="normal", batch_size=512),
    "diabetes": dict(sizes=(10,) + (100,) * 5 + (1,), guide="normal", batch_size=128),
    # the race's digits CNN (pyro_vinit.testing.paper_problems'), at fit's options
    "digits_cnn": dict(paper="digits_cnn", guide="ktied", batch_size=512),
}


# ----------------------------------------------------------------------------- worker


def worker(num_samples):
    """Reads ``problem seed`` lines, answers one JSON line each."""
    import pyro
    import pyro.distributions as dist
    import pyro.poutine as poutine
    import torch
    from pyro.infer.autoguide import AutoNormal
    from pyro.nn import PyroModule

    from pyro_vinit import AutoKTiedNormal, init_guide_iblm
    from pyro_vinit.data import load_diabetes, load_digits, load_mnist
    from pyro_vinit.metrics import classification_metrics, regression_metrics
    from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
    from pyro_vinit.testing.paper_problems import PROBLEMS as PAPER_PROBLEMS

    class Regressor(PyroModule):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, y=None):
            sigma = pyro.sample("sigma", dist.HalfNormal(x.new_tensor(1.0)))
            mean = self.net(x).squeeze(-1)
            with pyro.plate("data", x.shape[0]):
                pyro.sample("obs", dist.Normal(mean, sigma), obs=y)
            return mean

    torch.set_num_threads(1)
    data = {}
    loaders = {"mnist": load_mnist, "diabetes": load_diabetes,
               "digits_cnn": lambda: load_digits(image=True)}

    def load(problem):
        if problem not in data:
            data[problem] = loaders.get(problem, load_digits)()
        return data[problem]

    for line in sys.stdin:
        problem, seed = line.split()
        spec = PROBLEMS[problem]
        x, y, x_test, y_test = load(problem)
        pyro.clear_param_store()
        pyro.set_rng_seed(int(seed))
        net = bayesianize(PAPER_PROBLEMS[spec["paper"]]["net"]() if "paper" in spec
                          else mlp(spec["sizes"]))
        regression = problem == "diabetes"
        model = Regressor(net) if regression else BayesianClassifier(net, num_data=len(x))
        guide = AutoKTiedNormal(model, rank=2) if spec["guide"] == "ktied" else AutoNormal(model)
        guide(x[:64], y[:64])  # set up outside the timing
        wall, cpu = time.perf_counter(), time.process_time()
        init_guide_iblm(guide, (x, y), batch_size=spec["batch_size"], max_scale_ratio=0.1)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        with torch.no_grad():
            outs, sigmas = [], []
            for _ in range(num_samples):
                trace = poutine.trace(guide).get_trace(x_test)
                outs.append(poutine.replay(model, trace=trace)(x_test))
                if regression:
                    sigmas.append(trace.nodes["sigma"]["value"])
            if regression:
                m = regression_metrics(y_test, loc=torch.stack(outs),
                                       scale=torch.stack(sigmas)[:, None])
                m["error_rate"] = m["rmse"]
            else:
                m = classification_metrics(y_test, logits=torch.stack(outs))
        print(json.dumps({"cpu": cpu, "wall": wall, "error": m["error_rate"],
                          "mnll": m["mnll"]}), flush=True)


# ----------------------------------------------------------------------------- driver


class Worker:
    def __init__(self, pythonpath, num_samples):
        env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1",
                   MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker",
             "--samples", str(num_samples)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, cwd=pythonpath)

    def run(self, problem, seed):
        self.proc.stdin.write(f"{problem} {seed}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker died on {problem} seed {seed}")
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def extract(revision, folder):
    """The ``pyro_vinit`` package of ``revision`` into ``folder``."""
    archive = os.path.join(folder, "baseline.tar")
    subprocess.run(["git", "-C", ROOT, "archive", "-o", archive, revision, "pyro_vinit"],
                   check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder)
    return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", revision], check=True,
                          capture_output=True, text=True).stdout.strip()


def main(args):
    folder = tempfile.mkdtemp(prefix="bench_iblm_speed_")
    try:
        base_rev = extract(args.baseline, folder)
        here_rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                  check=True, capture_output=True, text=True).stdout.strip()
        workers = {"baseline": Worker(folder, args.samples), "current": Worker(ROOT, args.samples)}
        results = {p: {v: [] for v in workers} for p in args.problems}
        try:
            for problem in args.problems:  # a warm-up run each (imports, first-call costs)
                for w in workers.values():
                    w.run(problem, 1000)
            for r in range(args.rounds):
                order = list(workers) if r % 2 == 0 else list(workers)[::-1]
                for problem in args.problems:
                    for variant in order:
                        out = workers[variant].run(problem, r)
                        results[problem][variant].append(out)
                        print(f"round {r} {problem:9s} {variant:8s} cpu {out['cpu']:.3f}s "
                              f"wall {out['wall']:.3f}s error {out['error']:.4f} "
                              f"mnll {out['mnll']:.4f}", flush=True)
        finally:
            for w in workers.values():
                w.close()
    finally:
        shutil.rmtree(folder)
    rows = []
    for problem in args.problems:
        b, c = results[problem]["baseline"], results[problem]["current"]
        row = {"problem": problem, **PROBLEMS[problem]}
        for name, runs in (("baseline", b), ("current", c)):
            row[name] = {key: statistics.median(o[key] for o in runs) for key in ("cpu", "wall")}
            row[name].update({key: statistics.mean(o[key] for o in runs)
                              for key in ("error", "mnll")})
        row["cpu_ratio"] = statistics.median(x["cpu"] / y["cpu"] for x, y in zip(b, c))
        row["wall_ratio"] = statistics.median(x["wall"] / y["wall"] for x, y in zip(b, c))
        rows.append(row)
    print(f"\nbaseline {args.baseline} ({base_rev}) vs current {here_rev}, {args.rounds} rounds, "
          f"medians; quality: means over rounds, {args.samples} draws\n")
    print("| problem | baseline CPU s | current CPU s | speed-up (CPU) | speed-up (wall) "
          "| error before → after | MNLL before → after |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        b, c = row["baseline"], row["current"]
        print(f"| {row['problem']} | {b['cpu']:.3f} | {c['cpu']:.3f} | {row['cpu_ratio']:.2f}× | "
              f"{row['wall_ratio']:.2f}× | {b['error']:.4f} → {c['error']:.4f} | "
              f"{b['mnll']:.4f} → {c['mnll']:.4f} |")
    if args.quick:
        return
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    # (imported here: a worker runs this file with another revision's package on its path)
    from benchmarks.harness import result_stem

    stem = result_stem(argparse.Namespace(out=os.path.join(HERE, "results"), tag=args.tag),
                       "bench_iblm_speed")
    with open(stem + ".json", "w") as f:
        json.dump({"baseline": args.baseline, "baseline_commit": base_rev,
                   "current_commit": here_rev, "rounds": args.rounds, "samples": args.samples,
                   "rows": rows, "runs": results}, f, indent=2)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--baseline", default="main", help="git revision to compare with")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--samples", type=int, default=32, help="guide draws for the metrics")
    parser.add_argument("--quick", action="store_true", help="2 rounds, 4 draws, no files")
    parser.add_argument("--tag", default="", help="suffix of the result file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.samples)
    else:
        if args.quick:
            args.rounds, args.samples = 2, 4
        main(args)
