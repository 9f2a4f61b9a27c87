"""Benchmarks of pyro-vinit; ``benchmarks.reproduce`` reproduces the papers' results."""
