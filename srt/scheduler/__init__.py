"""The scheduler process: continuous batching, the prefix cache and KV pool, the model runner's steps."""
