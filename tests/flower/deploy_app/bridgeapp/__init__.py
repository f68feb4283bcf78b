"""A Flower app for the deployment test (tests/flower/test_flower_deployment.py)."""
