"""tensorswap benchmarks: each module prints ratios against baselines measured in the same run."""
