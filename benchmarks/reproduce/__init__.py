"""
The headline results of the papers behind pyro-vinit, on real MNIST digits
(:func:`pyro_vinit.data.load_mnist`), scaled to run on two CPU cores.

Each module is a script, run from the repository root::

    python -m benchmarks.reproduce.ktied      # Swiatkowski et al. (2020), k-tied Normal
    python -m benchmarks.reproduce.radial     # Farquhar et al. (2020), radial BNNs
    python -m benchmarks.reproduce.lrt        # Kingma et al. (2015), Table 1
    python -m benchmarks.reproduce.ood        # beyond the papers: OOD detection, calibration

``--quick`` gives a smoke run of a few seconds; ``make reproduce`` runs all
four in full and writes their JSON, figures and tables to
``docs/_static/reproduce/``, where ``docs/reproducing.rst`` shows them.
"""
