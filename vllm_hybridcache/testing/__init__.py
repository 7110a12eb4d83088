"""Test tooling shipped with the package, never imported by production code.

`instrumentation`: the probes, fault injection and restore corruption that tests, the soak
run and the connector benchmark attach to an engine (the adapter declares the slots it calls,
adapter/probes.py). `in_place_check`: the soak run's comparison of the blocks a restore took
from vLLM's pool with the rows its links stored. `replica`: an in-process engine in a Ray
actor, for the cluster tests and the cluster restore benchmark.
tests/foundation/test_import_graph.py checks that nothing outside this package and the tests
imports it.
"""
