"""The Qwen3-TTS 12 Hz speech tokenizer (codec): ``config`` (config.json), ``encoder`` (Mimi,
audio -> codes), ``decoder`` (codes -> audio), ``streaming`` (exact incremental decoding in
a slot arena, CUDA graphs) and ``random_init`` (random checkpoints in the real layout)."""
