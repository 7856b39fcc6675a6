"""Benchmarks run as `meshd bench NAME` (registered in `meshd.cli.main.BENCHES`).

Benchmarks drive the product from outside, as an operator or a client would; no product
module imports this package.
"""
