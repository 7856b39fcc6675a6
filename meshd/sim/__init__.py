"""Simulation and scenarios: the network simulator, seeded geographies, the scale scripts
for membership and planning, and the benchmark workloads.

They drive the product's sans-IO code on a virtual clock, for tests, `meshd bench` and docs;
no product module imports this package.
"""
