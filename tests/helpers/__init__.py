"""Plain helpers shared by the test files (the pytest fixtures built on them are in conftest.py).

- ``helpers.net``: loopback transport pairs, test certificates, servers on port 0, a manual clock.
- ``helpers.store``: block stores of each kind, ageing a block without sleeping.
- ``helpers.aggregate``: float32 arrays and matrices for the aggregators.
- ``helpers.memory``: the memory a piece of code allocates (traced, peak_of).
"""
