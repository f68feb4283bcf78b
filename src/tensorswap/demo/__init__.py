"""The federated-learning demo's model, data shards and local training (needs torch, sklearn)."""
