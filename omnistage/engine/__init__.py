"""The autoregressive engine: paged KV cache, attention backends, sampler, continuous
batching, CUDA-graph runner, and the model contract (:class:`model_runner.ARModel`).

Entry point: :class:`omnistage.engine.engine.AREngine`; as a pipeline stage:
:class:`omnistage.scheduling.ar.ARScheduler`.
"""
