"""ouroboros_jax: Ouroboros delayed-gradient model parallelism for Transformer LMs."""
