"""The Flower app of benchmarks/bench_flower_bridge.py (FedAvg, a numpy model, trivial training)."""
