"""The autoregressive engine (work in progress: the sampler is here; see issue 5)."""
