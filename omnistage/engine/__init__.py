"""The autoregressive engine (in progress, issue 5): the sampler and the paged KV block manager."""
