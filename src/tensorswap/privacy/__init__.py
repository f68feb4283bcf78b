"""Privacy for federated rounds: secure aggregation (``tensorswap.privacy.secagg``)."""
